"""Each peer's learning rate, from the number of peers: ``lr x sqrt(N)`` or ``lr x N``.

With N peers each trains on 1/N of the global batch; Adam makes a step from that noisier batch
about as long as serial's, so it carries less signal, and the average of N of them is shorter
than serial's step (docs/sdk.md, "Each peer's learning rate"). ``sqrt`` is the rule for Adam-type
optimizers (the noise of a mean of N falls as ``1/sqrt(N)``), ``linear`` large-batch SGD's (Goyal
et al., 2017). No free lunch: at the quality grid's low rate both helped (x N most: 4 peers from
+2.9% to +1.0% over serial at the same rate, 3 seeds), but at serial's best rate x sqrt(N) did
not beat plain averaging and x N with 4 peers was worse, so the default is ``none``
(bench/RESULTS.md, issue 27). Try ``linear`` with 2 peers, or when --lr is below serial's best.

The factor ramps in linearly over the first ``warmup`` optimizer steps, as Goyal et al. ramp
theirs. :class:`LRScaler` multiplies the optimizer's ``lr`` just before each step and puts the
scheduler's value back right after it, so any scheduler (and its checkpoint) sees exactly the
rates it set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from syncclient.schedule import SyncEvery, SyncSchedule
from syncwire.runsettings import PROBE_STEPS

__all__ = ["DEFAULT_PEER_LR", "LR_SCALINGS", "LRScaler", "PeerLR", "scale_each_step"]

#: ``none``: every peer at the given rate; ``sqrt``: x sqrt(N); ``linear``: x N.
LR_SCALINGS = ("none", "sqrt", "linear")


@dataclass(frozen=True)
class PeerLR:
    """How a peer's learning rate follows the number of peers ``N``: ``scaling``, one of
    :data:`LR_SCALINGS`, ramped in over ``warmup`` optimizer steps (0: none; None: one round,
    ``sync_every`` steps, :meth:`for_rounds`)."""

    scaling: str = "none"
    warmup: int | None = None

    def __post_init__(self) -> None:
        if self.scaling not in LR_SCALINGS:
            raise ValueError(f"lr_scaling must be one of {', '.join(LR_SCALINGS)}, got {self.scaling!r}")
        bad = isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0
        if self.warmup is not None and bad:
            raise ValueError(f"lr_scaling_warmup must be an int >= 0 (optimizer steps) or None, got {self.warmup!r}")

    def for_rounds(self, sync_every: SyncEvery | None) -> PeerLR:
        """This scaling with its warm-up in steps: None becomes one round (a schedule's first
        interval; an auto run's probe; 0 in a samples run, whose rounds are no fixed number of steps)."""
        if self.warmup is not None:
            return self
        if isinstance(sync_every, SyncSchedule):
            return PeerLR(self.scaling, sync_every.first)
        return PeerLR(self.scaling, PROBE_STEPS if isinstance(sync_every, str) else sync_every or 0)

    def factor(self, peers: int, step: int) -> float:
        """The multiplier of the given learning rate at optimizer step ``step`` (0: the first)."""
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
            raise ValueError(f"peers must be an int >= 1, got {peers!r}")
        full = {"none": 1.0, "sqrt": math.sqrt(peers), "linear": float(peers)}[self.scaling]
        warmup = self.warmup or 0
        if step >= warmup:
            return full
        return 1.0 + (full - 1.0) * max(step, 0) / warmup


#: Every integration's default: every peer at the rate it is given. At serial's best learning rate
#: neither scaling won over 3 seeds (x sqrt(N) within noise of none, worse on one seed; x N better
#: with 2 peers, worse with 4; bench/RESULTS.md, issue 27).
DEFAULT_PEER_LR = PeerLR("none", None)


class LRScaler:
    """Multiplies an optimizer's learning rates for one step: ``before(optimizer, factor)`` just
    before ``optimizer.step()``, ``after()`` right after it (before the scheduler steps)."""

    def __init__(self) -> None:
        self._saved: list[tuple[dict[str, Any], Any]] = []

    def before(self, optimizer: Any, factor: float) -> None:
        self.after()  # a step that never got its after(): restore first, never compound
        if factor == 1.0:
            return
        for group in optimizer.param_groups:
            lr = group.get("lr")
            if isinstance(lr, (int, float)) and not isinstance(lr, bool):
                self._saved.append((group, lr))
                group["lr"] = lr * factor

    def after(self) -> None:
        for group, lr in self._saved:
            group["lr"] = lr
        self._saved = []


def scale_each_step(optimizer: Any, peer_lr: PeerLR, peers: int, step: Any) -> Any:
    """Scale ``optimizer``'s rate for each of its steps through torch's per-optimizer hooks (loops
    whose events the SDK does not see); ``step()``: the steps taken so far. Returns what removes
    the hooks (nothing is hooked when the factor is always 1)."""
    if peer_lr.factor(peers, peer_lr.warmup or 0) == 1.0:
        return lambda: None
    scaler = LRScaler()
    pre = optimizer.register_step_pre_hook(lambda opt, args, kwargs: scaler.before(opt, peer_lr.factor(peers, step())))
    post = optimizer.register_step_post_hook(lambda opt, args, kwargs: scaler.after())

    def remove() -> None:
        pre.remove()
        post.remove()
        scaler.after()

    return remove
