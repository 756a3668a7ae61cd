"""How far apart syncs are when the run picks it (``sync_every="auto"``): one decision per round.

Pure decisions, like the round policies: no I/O, clock or tensors. One object per run, chosen at
creation from its config (:func:`make_pacer`): :class:`Fixed` (the peers' own interval: nothing
to decide) or :class:`Auto`. At each round's close the hub hands :meth:`Auto.decide` what it
measured of that round, and the decision travels with the round's result (``X-Sync-Next-Every``),
so every peer syncs next at the same step and the rounds agree.

The rule (docs/concepts/outer.md, "How the interval is chosen"), for each peer *p*:

- its compute per step ``t_p`` and its training-thread work per sync ``host_p`` (snapshot, apply),
  from the figures its update carries (:data:`PACE_KEYS`);
- the round's time ``R``: the slowest upload, the hub's merge, the slowest download, all measured
  by the hub (a download not measured yet counts as long as the upload of the same bytes);
- a peer that overlaps its sync with training needs ``R x (1 + MARGIN)`` seconds of compute per
  interval for the result to be in before its next sync; one that blocks needs none (it waits);
- either needs ``u / (1 - u) x stall`` seconds of compute for a stall per sync (``host_p``, plus
  the wait it measured when it blocks: the round and any straggler) to leave the share ``u`` (the
  target) computing.

The interval is the largest of those needs in steps (``need_p / t_p``; a samples run: in samples,
``need_p`` x the peers' summed rate), the median of the last :data:`HISTORY` rounds' (one slow
round does not swing it; a lasting change moves it in two), within ``[sync_min, sync_max]``.
The first interval is a probe of :data:`PROBE_STEPS` steps (a samples run: its ``round_samples``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from syncwire.runsettings import PACE_KEYS, PROBE_STEPS

__all__ = ["HISTORY", "KEPT", "MARGIN", "Auto", "Fixed", "Interval", "Pace", "make_pacer"]

#: The share of an interval's compute kept free after the round's expected time: a round that runs
#: this much over its measure is still in before the next sync.
MARGIN = 0.2
#: Rounds whose needs make the decision (their median).
HISTORY = 3
#: Rounds whose decision is remembered for their results (older ones carry the current).
KEPT = 64


@dataclass(frozen=True)
class Pace:
    """One peer's last interval (its update's :data:`PACE_KEYS`) and its transfers (the hub's)."""

    peer: str
    steps: int
    samples: int
    seconds: float
    host: float
    wait: float
    overlap: bool
    upload: float  # this update's upload, seconds
    download: float | None  # the previous result's download, seconds (None: not measured)

    @classmethod
    def of(cls, peer: str, metrics: Mapping[str, float], upload: float, download: float | None) -> Pace | None:
        """From an update's metrics; None when it lacks them (an older SDK), trained nothing (a flush
        round) or held no sync (the first interval: what a sync costs is not known yet)."""
        if any(key not in metrics for key in PACE_KEYS) or metrics["sync_steps"] < 1:
            return None
        steps, samples, seconds, host, wait, overlap = (metrics[key] for key in PACE_KEYS)
        host, wait = max(0.0, host), max(0.0, wait)
        if host == wait == 0.0:
            return None
        return cls(peer, int(steps), int(samples), seconds, host, wait, overlap > 0, upload, download)

    @property
    def compute(self) -> float:
        """Seconds of the interval spent on anything but the sync (training, the user's own work)."""
        return max(1e-9, self.seconds - self.host - self.wait)

    @property
    def utilization(self) -> float:
        return min(1.0, self.compute / self.seconds) if self.seconds > 0 else 1.0


@dataclass(frozen=True)
class Interval:
    """A decision: ``every`` steps (a samples run: samples) to the next sync, and why.

    ``bound``: what set it (``probe``, ``round``: the round's time, whose slowest link is
    ``link``'s; ``stall``: ``peer``'s work per sync; ``sync_min`` / ``sync_max``; ``fixed``).
    ``utilization``: the slowest peer's share of the last interval spent computing (None: not
    measured yet). ``round_seconds``: the round's measured time."""

    every: int
    bound: str
    peer: str | None = None
    link: str | None = None
    utilization: float | None = None
    round_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, recorded: Mapping[str, Any]) -> Interval:
        values: dict[str, Any] = {f.name: recorded.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**values)

    def why(self, unit: str) -> str:
        """One line: the interval and what bounds it (``syncserver status``, the log)."""
        said = {
            "probe": "a first probe",
            "round": f"the round's {self.round_seconds or 0:.1f} s must fit in it (slowest link: {self.link})",
            "stall": f"{self.peer}'s work per sync must stay a small share",
            "sync_min": "sync_min",
            "sync_max": "sync_max",
        }.get(self.bound, self.bound)
        used = "" if self.utilization is None else f"; last interval {self.utilization:.1%} computing"
        return f"every {self.every} {unit}: {said}{used}"


class Fixed:
    """The peers' own interval: nothing to decide (``utilization`` unset)."""

    current: Interval | None = None

    def decide(self, round_: int, paces: Sequence[Pace], aggregate: float) -> Interval | None:
        return None

    def after(self, round_: int) -> int | None:
        return None

    def restore(self, records: Sequence[Any]) -> None:
        pass


@dataclass
class Auto:
    """The hub picks each interval (see the module docstring). ``samples``: a samples run, whose
    interval is its rounds' size in samples, starting at ``first``."""

    target: float
    low: int = 1
    high: int | None = None
    samples: bool = False
    first: int = PROBE_STEPS
    current: Interval = field(init=False)
    needs: list[float] = field(default_factory=list)
    decided: dict[int, int] = field(default_factory=dict)  # round -> the interval its result carries

    def __post_init__(self) -> None:
        self.current = Interval(self._bounded(self.first)[0], "probe")

    def after(self, round_: int) -> int:
        """The interval round ``round_``'s result carries (an old round's: the current one)."""
        return self.decided.get(round_, self.current.every)

    def restore(self, records: Sequence[Any]) -> None:
        """After a restart: the decisions of the rounds recorded (``RoundRecord``), the last current."""
        for record in records:
            if record.interval is not None:
                self.current = Interval.load(record.interval)
                self.decided[record.round] = self.current.every

    def decide(self, round_: int, paces: Sequence[Pace], aggregate: float) -> Interval:
        """The interval after round ``round_``, from its participants' paces (those that sent
        them; the current one again when none did) and the hub's seconds on it."""
        if round_ in self.decided:  # a close tried again after a failed commit: decided already
            return self.current
        self.decided[round_] = self._decide(paces, aggregate).every
        while len(self.decided) > KEPT:
            del self.decided[min(self.decided)]
        return self.current

    def _decide(self, paces: Sequence[Pace], aggregate: float) -> Interval:
        if not paces:
            return self.current
        upload = max(paces, key=lambda p: p.upload)
        # a download the hub has not seen yet (the first round's) takes as long as the upload
        downloads = {p.peer: p.download if p.download is not None else p.upload for p in paces}
        slowest = max(downloads, key=lambda name: downloads[name])
        round_s = upload.upload + aggregate + downloads[slowest]
        link = upload.peer if upload.upload >= downloads[slowest] else slowest
        share = self.target / (1.0 - self.target)
        rate = sum(p.samples / p.compute for p in paces)  # the run's samples per second of compute
        best: tuple[float, str, str | None] = (0.0, "round", None)
        for p in paces:
            fits = round_s * (1.0 + MARGIN) if p.overlap else 0.0
            stall = share * (p.host + (0.0 if p.overlap else p.wait))
            seconds, bound = (fits, "round") if fits >= stall else (stall, "stall")
            need = seconds * rate if self.samples else seconds * p.steps / p.compute
            if need > best[0]:
                best = (need, bound, p.peer)
        self.needs = [*self.needs, best[0]][-HISTORY:]
        every, clamp = self._bounded(math.ceil(statistics.median(self.needs)))
        self.current = Interval(
            every=every,
            bound=clamp or best[1],
            peer=best[2],
            link=link,
            utilization=round(min(p.utilization for p in paces), 4),
            round_seconds=round(round_s, 3),
        )
        return self.current

    def _bounded(self, every: int) -> tuple[int, str | None]:
        if every < self.low:
            return self.low, "sync_min"
        if self.high is not None and every > self.high:
            return self.high, "sync_max"
        return every, None


def make_pacer(config: Any) -> Fixed | Auto:
    """A run's interval keeper, from its config (a ``RunConfig``): Auto when it has a utilization."""
    if config.utilization is None:
        return Fixed()
    samples = config.policy == "samples"
    first = config.round_samples if samples else PROBE_STEPS
    return Auto(config.utilization, config.sync_min, config.sync_max, samples=samples, first=first)
