"""The bounds of every number the hub takes from outside, in one place (the run settings' own are
in their table, :mod:`syncwire.runsettings`; the reasons are here). Every bound is finite: pydantic
refuses NaN, ±Inf (JSON's ``1e999``) and anything out of range with a 422 that names the field;
integers from paths and headers are bounded before sqlite (64-bit), ``struct`` or numpy see them.
Why these numbers:

- ``outer_lr`` up to 10: DiLoCo's is 0.7; 1e38 times any update overflows float32.
- ``MAX_PEERS`` x ``MAX_SAMPLES`` = 2^53: a round's total weight stays an exact float64 and an
  sqlite INTEGER, whatever every peer sends.
- seconds up to a week: a round deadline or a lease longer than that is a typo, and an
  infinite one never fires.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from syncwire.runsettings import MAX_PEERS, MAX_SAMPLES, MAX_SECONDS

__all__ = ["MAX_BYTES", "MAX_PEERS", "MAX_ROUND", "MAX_SAMPLES", "MAX_SECONDS", "RoundNumber", "Seconds", "header_int"]

#: Bytes of any body or offset (16 TiB; ``SYNC_MAX_BODY_BYTES`` is at most this).
MAX_BYTES = 2**44
#: Round numbers and versions: one merge at a time will never get there, and it is exact in JSON.
MAX_ROUND = 2**53

Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
RoundNumber = Annotated[int, Field(ge=0, le=MAX_ROUND)]


def header_int(value: str | None) -> int | None:
    """A header's non-negative decimal integer (``Content-Length``), or None: ASCII digits only
    (``int("²")`` raises) and at most 19 (under 2^63: no parsing thousands of digits, nothing sqlite
    cannot store)."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 19:
        return None
    return int(value)
