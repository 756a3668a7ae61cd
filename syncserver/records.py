"""What the hub records of a run's updates and rounds: plain data that every layer reads (the rounds
make them, the store keeps them, the run view hands them to the dashboard and /metrics), defined
once so that a field added reaches every reader. They import nothing of the hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Loss", "RoundRecord", "UpdateRecord"]


@dataclass
class UpdateRecord:
    peer: str
    round: int  # the round it is merged in
    seq: int
    digest: str
    samples: int
    metrics: dict[str, float]
    nbytes: int
    received: float
    seconds: float
    base: int  # the version it was computed from: its round, but in async runs an older one
    final: bool = False  # its peer's last update of the run (X-Sync-Final): nothing trains after it
    object: str | None = None  # its name in the object store when it went there (no file on the hub's disk)


@dataclass
class RoundRecord:
    round: int
    opened: float
    closed: float
    participants: list[str]
    dropped: list[str]
    samples: int
    bytes_in: int
    result_bytes: int
    timings: dict[str, float]
    # sync_every auto: the interval picked at this close, which its result carries (Interval.as_dict)
    interval: dict[str, Any] | None = None


@dataclass(frozen=True)
class Loss:
    """Samples ``peer`` reported training from version ``round`` that no acknowledged update carried
    (the ledger's rule: :mod:`syncserver.core.ledger`)."""

    round: int
    peer: str
    samples: int
