"""Two peers that trained on the same data: the rule, pure (no I/O, no clock, no run).

Peers of one run should each draw their own batches. A script that seeds every process with one
constant draws the same ones on every peer: the peers then repeat each other's work, and the run
learns what one peer would at K times the cost. Their updates of a round give it away: equal
bodies (the same sha-256), or, since GPUs are not bit-deterministic, nearly equal ones (the same
L2 norm to :data:`NORM_RTOL`, where the hub took both norms), or the same training loss reported
with the same samples. :func:`same_data` says which two peers, or None; the rounds call it once
per acknowledged update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from syncserver.records import UpdateRecord

__all__ = ["LOSS_KEYS", "NORM_RTOL", "SameData", "same_data"]

NORM_RTOL = 1e-6  # two norms this close (relative) are one update's, bits apart
#: the names a training loss goes by in an update's metrics (the dashboard's loss curve too)
LOSS_KEYS = ("loss", "train_loss")

Equal = Literal["digest", "norm", "metrics"]
_WHAT = {
    "digest": "identical updates",
    "norm": f"updates of the same norm (to {NORM_RTOL:g})",
    "metrics": "updates with the same training loss and samples",
}


@dataclass(frozen=True)
class SameData:
    """Two peers' updates of round ``round`` are equal (``by`` what): they trained on the same data."""

    round: int
    peers: tuple[str, str]  # the one acknowledged first, then the other
    by: Equal

    @property
    def message(self) -> str:
        """What happened and what to do, in a sentence (the log, status and the dashboard say it)."""
        first, second = self.peers
        return (
            f"peers {first} and {second} sent {_WHAT[self.by]} in round {self.round}: they trained on the same "
            "data (a script that seeds every process with one constant draws the same batches); give each peer "
            "its own seed or data shard (weightsync-run does both for peers that have a rank: under --local-peers, "
            "or given WEIGHTSYNC_RANK and WEIGHTSYNC_WORLD_SIZE on each machine)"
        )


def same_data(update: UpdateRecord, others: Iterable[UpdateRecord], norms: Mapping[str, float]) -> SameData | None:
    """The first of ``others`` (the round's acknowledged updates; ``update``'s own peer is skipped)
    equal to ``update``, or None. ``norms``: by peer, where the hub took them (``Run.norms``).

    Equal: the same digest; or both norms known and within :data:`NORM_RTOL`; or the same metrics,
    holding a training loss (:data:`LOSS_KEYS`), with the same samples. A step counter alone is not
    enough: weightsync-run's plain hook sends ``{"step": N}``, the same on every peer that keeps pace.
    Both norms 0: neither peer moved its weights, nothing was trained twice.
    """
    mine = norms.get(update.peer)
    for other in others:
        if other.peer == update.peer or other.round != update.round:
            continue
        theirs = norms.get(other.peer)
        if mine is not None and theirs is not None and mine == theirs == 0.0:
            continue
        if other.digest == update.digest:
            return SameData(update.round, (other.peer, update.peer), "digest")
        if mine is not None and theirs is not None and math.isclose(mine, theirs, rel_tol=NORM_RTOL):
            return SameData(update.round, (other.peer, update.peer), "norm")
        if _same_loss(update, other):
            return SameData(update.round, (other.peer, update.peer), "metrics")
    return None


def _same_loss(a: UpdateRecord, b: UpdateRecord) -> bool:
    """The same samples and metrics (every value equal), a training loss among them."""
    return a.samples == b.samples and a.metrics == b.metrics and any(key in a.metrics for key in LOSS_KEYS)
