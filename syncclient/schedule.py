"""When a sync is due: the interval (an int, or a :class:`SyncSchedule` that changes over the
run) and :class:`SyncClock`, the one place that decides from the steps taken.

``SyncSchedule.parse("5:60,15")`` syncs every 5 optimizer steps until step 60, then every 15:
frequent early, when the peers drift apart fastest, sparse late, when each sync buys less and
costs the same. The interval after a sync depends only on that sync's global step, so peers with
the same schedule sync at the same steps and the rounds agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from syncwire.runsettings import AUTO

__all__ = ["AUTO", "SyncClock", "SyncEvery", "SyncSchedule", "interval_after"]


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
        """The global step of the ``syncs``-th sync when every sync came on time (a late joiner's)."""
        step = 0
        for _ in range(syncs):
            step += self.interval_at(step)
        return step

    def from_step(self, step: int) -> SyncSchedule:
        """The same schedule for a Trainer that counts from 0 at global ``step`` (a late joiner)."""
        return SyncSchedule(tuple((e, u - step) for e, u in self.phases if u > step), self.last)

    def __str__(self) -> str:
        return ",".join([*(f"{e}:{u}" for e, u in self.phases), str(self.last)])


#: ``sync_every``'s forms: steps, a schedule of them, or ``"auto"`` (the hub picks each interval).
SyncEvery = int | SyncSchedule | Literal["auto"]


def interval_after(sync_every: int | SyncSchedule, step: int) -> int:
    """The steps from a sync at global ``step`` to the next one, for either form of ``sync_every``."""
    return sync_every.interval_at(step) if isinstance(sync_every, SyncSchedule) else sync_every


class SyncClock:
    """The steps and samples a peer trained, and the step its next sync is due at: the one
    decision every integration asks (torchft's ``_step_post_hook``), through ``SyncClient``.

    Steps fall in windows of ``every`` steps from the clock's start (a schedule's intervals), and
    each window makes at most one round, so peers of any kind agree on their rounds: a sync at a
    window's end is on time; one inside a window (a final one, at a read of the model's state)
    takes that window's round; a flush round takes the next window's. ``next`` is where a later
    rule would set the step (a preemption).

    ``every="auto"``: the hub picks each interval (syncserver/core/interval.py) and each result
    says it (:meth:`told`); the next sync is due that many steps after the sync that made the
    result. Until a sync's result is in, none is due: an overlapped peer whose result comes
    after that step syncs at once when it does.

    Attributes:
        every: the interval (None: the hub says when, in runs whose rounds close on samples;
            ``"auto"``: the hub says how far).
        step: the global optimizer step reached; ``last``: the step of the last sync (or start).
        samples: trained since the last sync began.
        next: the step the next sync is due at (None without ``every``).
    """

    def __init__(self, every: SyncEvery | None = None) -> None:
        bad_int = isinstance(every, bool) or not isinstance(every, int) or every < 1
        if every is not None and every != AUTO and not isinstance(every, SyncSchedule) and bad_int:
            raise ValueError(
                f"sync_every must be an int >= 1 (optimizer steps), a SyncSchedule or 'auto', got {every!r}"
            )
        self.every = every
        self._told: int | None = None  # auto: the hub's interval after the last sync
        self.start(0)

    def start(self, step: int) -> None:
        """Count from global ``step`` (a Trainer starting there, a late peer whose steps were dropped)."""
        self.step = self.last = self._opened = step
        self.samples = 0
        self.next = self._after(step)

    def tick(self, samples: int, step: int | None = None) -> None:
        """Training reached global ``step`` (None: one step more), with ``samples`` more."""
        self.step = self.step + 1 if step is None else step
        self.samples += samples

    def sent(self) -> None:
        """A sync (or a flush) began at the current step: it takes this window's round (at its end,
        the next one's); what is counted from here goes into the next."""
        self.last, self.samples = self.step, 0
        if self.every == AUTO:  # due again once the hub says how far (told)
            self._opened, self.next = self.step, None
        elif self.next is not None:
            self._opened = self.step if self.step >= self.next else self.next
            self.next = self._after(self._opened)

    def told(self, every: int | None) -> None:
        """A result of a run that picks its interval came in: the next sync is ``every`` steps after
        the one that made it (ignored in other runs, whose results say None)."""
        if self.every == AUTO and every is not None:
            self._told = every
            self.next = self._opened + every

    @property
    def on_time(self) -> bool:
        """The interval's sync is due (a schedule's step reached)."""
        return self.next is not None and self.step >= self.next

    @property
    def unsynced(self) -> bool:
        """Steps were trained since the last sync."""
        return self.step > self.last

    @property
    def window_open(self) -> bool:
        """Steps were trained since the last sync in a window whose round is not taken yet (interval runs)."""
        return self.next is not None and self.unsynced and self.step > self._opened

    def _after(self, step: int) -> int | None:
        if self.every is None or isinstance(self.every, str):  # auto: as far as the hub said
            return None if self._told is None else step + self._told
        return step + interval_after(self.every, step)
