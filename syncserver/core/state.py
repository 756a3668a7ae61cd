"""What the hub holds in memory of a run: plain data the coordinator changes on the event loop
thread and the run view (:mod:`syncserver.core.view`) reads."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal

from syncserver.core.changes import Changes
from syncserver.core.interval import Auto, Fixed, make_pacer
from syncserver.core.ledger import Ledger
from syncserver.core.policy import RoundPolicy, make_policy
from syncserver.core.samedata import SameData
from syncserver.core.shape import RunShape
from syncserver.records import UpdateRecord
from syncserver.reduce.engine import Accumulator, Outer
from syncserver.storage.store import PeerRecord
from syncwire import Codec, Schema
from syncwire.runsettings import RUN_SETTINGS

__all__ = ["Peer", "Run", "RunConfig", "Traffic", "Via"]

#: What a run created before a setting existed had instead (its record lacks the setting).
BEFORE = {"norm_guard": None, "policy": "barrier", "round_samples": None, "max_staleness": 32, "outer_warmup": 0}
BEFORE |= {"min_merge_peers": 1, "utilization": None, "sync_min": 1, "sync_max": None}
_RunFields = make_dataclass("_RunFields", [(s.name, Any) for s in RUN_SETTINGS], kw_only=True)


class RunConfig(_RunFields):  # type: ignore[misc,valid-type]  # fields made from the run settings table
    """What a run is, fixed at creation (later peers must agree): a field per run setting."""

    @classmethod
    def load(cls, recorded: dict[str, Any]) -> RunConfig:
        """A run's config as its record holds it (one made before some settings existed too)."""
        return cls(**{**BEFORE, **recorded})

    def make_policy(self, lease_seconds: float, disconnect_grace: float, version: int) -> RoundPolicy:
        """This run's round policy, with round ``version`` open; the hub's liveness settings."""
        return make_policy(
            self.policy,
            min_merge_peers=self.min_merge_peers,
            round_timeout=self.round_timeout,
            lease_seconds=lease_seconds,
            disconnect_grace=disconnect_grace,
            round_samples=self.round_samples,
            max_staleness=self.max_staleness,
            round_=version,
        )

    @property
    def outer_optimizer(self) -> Outer:
        return Outer(self.outer, self.outer_lr, self.outer_momentum, self.outer_warmup)


#: the way a transfer went: through the hub's link, or to and from the object store (SYNC_STORE)
Via = Literal["hub", "store"]


@dataclass
class Traffic:
    """A run's bytes since the hub started, up and down by way (/metrics: what crosses the hub's link)."""

    up: dict[Via, int] = field(default_factory=lambda: {"hub": 0, "store": 0})
    down: dict[Via, int] = field(default_factory=lambda: {"hub": 0, "store": 0})


@dataclass
class Peer:
    """A peer's identity and traffic; its standing in rounds is the policy's (``Member``)."""

    name: str
    rank: int | None
    joined: float  # wall time
    group_size: int = 1  # ranks of a torch.distributed group that train as this one peer
    samples: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rate: float = 0.0  # samples/s: from its progress reports, else between its last two updates
    last_update_at: float | None = None
    last_progress: tuple[int, int, float] | None = None  # (round, samples, monotonic time) it last reported

    def observe(self, round_: int, samples: int, at: float) -> None:
        """A progress report: its speed is the samples it gained since the last report of the round."""
        last = self.last_progress
        if last is not None and last[0] == round_ and samples > last[1] and at > last[2]:
            speed = (samples - last[1]) / (at - last[2])
            self.rate = speed if self.rate == 0 else 0.5 * (self.rate + speed)  # smooth out report jitter
        self.last_progress = (round_, samples, at)


@dataclass
class Run:
    name: str
    config: RunConfig
    codec: Codec
    policy: RoundPolicy
    version: int = -1
    schema: Schema | None = None
    shape: RunShape | None = None  # what the schema implies (layout, limits, its JSON): set with it
    sealed: bool = False
    peers: dict[str, Peer] = field(default_factory=dict)
    init_claim: str | None = None  # the peer told to upload version 0
    creator: str | None = None  # the kind of token that created it (its quota's; None: created before)
    # the open round (number == version): its updates, uploads, first update (wall time), running mean
    acked: dict[str, UpdateRecord] = field(default_factory=dict)
    uploading: set[str] = field(default_factory=set)
    opened: float | None = None
    acc: Accumulator | None = None
    fold_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # the norm guard's memory: this round's accepted norms and the previous round's (a restart forgets)
    norms: dict[str, float] = field(default_factory=dict)
    previous_norms: list[float] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)  # in memory: a restart counts afresh
    # two peers found training on the same data, said once per run; in memory: a restart forgets
    # (and says it again if they still do)
    same_data: SameData | None = None
    # round -> peer -> (wall time its result download began, ended); in memory, bounded
    downloads: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    # a close that failed (say the disk is full) is tried again from this monotonic time on
    close_failures: int = 0
    close_retry_at: float = 0.0
    # writes the file of ``version`` after the round that made it committed; pulls wait for it
    writing: asyncio.Task[None] | None = None
    # (n, the reducers' bound on |version n| per tensor): a leased merge checks against it, not reading n
    peaks: tuple[int, dict[str, float]] | None = None
    ledger: Ledger = field(default_factory=Ledger)  # every sample acknowledged or lost (core/ledger.py)
    changed: Changes = field(default_factory=Changes)  # wakes every waiter of this run (they look again)
    pacer: Fixed | Auto = field(init=False)  # who picks the interval: the peers (Fixed), or the hub (Auto)

    def __post_init__(self) -> None:
        self.pacer = make_pacer(self.config)

    @property
    def closing(self) -> bool:
        return self.policy.closing

    @property
    def checks_norm(self) -> bool:
        """An update's norm is taken on receipt: for the norm guard, or to decode once a codec whose
        decoder can refuse well-formed, finite parts (topk's offsets: a 422 now, not a failed fold)."""
        return bool(self.config.norm_guard or self.codec.check_on_receipt)

    @property
    def keep_results(self) -> int | None:
        """Results to keep beyond the versions: an async peer fetches each since its base."""
        return self.config.max_staleness + 1 if self.config.policy == "async" else None

    def ordered(self) -> list[UpdateRecord]:
        """The open round's acknowledged updates, in acknowledgement order."""
        return sorted(self.acked.values(), key=lambda u: u.seq)

    def weight(self, update: UpdateRecord) -> float:
        """``update``'s weight in its round's merge (the policy's)."""
        return self.policy.weight(update.samples, update.base, update.round)

    def world_size(self) -> int:
        return max((p.rank + 1 for p in self.peers.values() if p.rank is not None), default=0)

    def record(self, peer: Peer) -> PeerRecord:
        member = self.policy.members[peer.name]
        return PeerRecord(peer.name, peer.rank, member.active_from, peer.joined, member.left, peer.group_size)

    def accumulator(self) -> Accumulator:
        assert self.schema is not None
        if self.acc is None:
            self.acc = Accumulator(self.schema)
        return self.acc


def now() -> float:
    """The policies' clock."""
    return time.monotonic()
