"""A sync interval that changes over the run: frequent early, when the peers' models drift apart
fastest, sparse late, when each sync buys less and costs the same.

``SyncSchedule.parse("5:60,15")`` syncs every 5 optimizer steps until step 60, then every 15
(steps 5, 10, ..., 60, 75, 90, ...). Pass it as ``SyncCallback(sync_every=...)``. The interval
after a sync depends only on that sync's global step, so every peer with the same schedule syncs
at the same steps and the rounds agree, as with an int.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncSchedule", "interval_after"]


@dataclass(frozen=True)
class SyncSchedule:
    """Intervals in optimizer steps: ``phases`` are ``(interval, until_step)`` pairs with rising
    ``until_step``, then ``last`` holds to the end."""

    phases: tuple[tuple[int, int], ...]
    last: int

    def __post_init__(self) -> None:
        for every in (*(e for e, _ in self.phases), self.last):
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"sync schedule intervals must be ints >= 1, got {every!r}")
        untils = [u for _, u in self.phases]
        if any(u < 1 for u in untils) or untils != sorted(set(untils)):
            raise ValueError(f"sync schedule UNTIL steps must rise from 1, got {untils}")

    @classmethod
    def parse(cls, text: str) -> SyncSchedule:
        """``"EVERY:UNTIL,...,EVERY"`` (e.g. ``"5:60,15"``); ``ValueError`` with the reason."""
        *early, tail = [part.strip() for part in text.split(",")]
        try:
            phases = tuple((int(e), int(u)) for e, u in (part.split(":") for part in early))
            return cls(phases, int(tail))
        except ValueError as exc:
            reason = str(exc) if "schedule" in str(exc) else "want EVERY:UNTIL,...,EVERY such as 5:60,15"
            raise ValueError(f"bad sync schedule {text!r}: {reason}") from None

    @property
    def first(self) -> int:
        """The interval at the start (PeerLR's warm-up of one round)."""
        return self.phases[0][0] if self.phases else self.last

    def interval_at(self, step: int) -> int:
        """The steps from a sync at global ``step`` (0: the start) to the next one."""
        return next((every for every, until in self.phases if step < until), self.last)

    def step_of_sync(self, syncs: int) -> int:
        """The global step of the ``syncs``-th sync when every sync came on time (a late
        joiner's way in: the run's version counts its syncs)."""
        step = 0
        for _ in range(syncs):
            step += self.interval_at(step)
        return step

    def from_step(self, step: int) -> SyncSchedule:
        """The same schedule seen from a sync at global ``step`` on, by a Trainer that counts
        from 0 there (a late joiner): it then syncs at the same steps as the others."""
        return SyncSchedule(tuple((e, u - step) for e, u in self.phases if u > step), self.last)

    def __str__(self) -> str:
        return ",".join([*(f"{e}:{u}" for e, u in self.phases), str(self.last)])


def interval_after(sync_every: int | SyncSchedule, step: int) -> int:
    """The steps from a sync at global ``step`` to the next one, for either form of ``sync_every``."""
    return sync_every.interval_at(step) if isinstance(sync_every, SyncSchedule) else sync_every
