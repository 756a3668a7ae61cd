"""The bounds of every number the hub takes from outside, in one place.

The run settings' bounds are in their table (:mod:`syncwire.runsettings`, which both the hub
and the SDK take them from); the reasons for them are here. Every bound is finite: pydantic
refuses NaN and ±Inf (``allow_inf_nan=False``; JSON's ``1e999`` parses as Inf) and anything out
of range with a 422 that names the field. Integers from paths and headers are bounded here too,
before sqlite (64-bit), ``struct`` or numpy ever see them.

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
    """A header's non-negative decimal integer (``Content-Length``), or None if it is not one.

    ASCII digits only (``"²".isdigit()`` is true, and ``int("²")`` raises) and at most 19 of
    them (under 2^63), so that ``int()`` never parses thousands of digits and sqlite never
    sees a number it cannot store.
    """
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > 19:
        return None
    return int(value)
