"""What the hub holds in memory of a run. Plain data: the coordinator changes it on the
event loop thread, the run view (:mod:`syncserver.view`) reads it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from syncserver.engine import Accumulator, Outer
from syncserver.policy import BarrierPolicy
from syncserver.shape import RunShape
from syncserver.store import PeerRecord, UpdateRecord
from syncwire import Codec, Schema

__all__ = ["CONFIG_FIELDS", "Peer", "Run", "RunConfig"]

CONFIG_FIELDS = ("codec", "outer", "outer_lr", "outer_momentum", "min_peers", "round_timeout", "norm_guard")


@dataclass
class RunConfig:
    """What a run is, fixed at creation (the first peer may choose; later peers must agree)."""

    codec: str
    outer: str
    outer_lr: float
    outer_momentum: float
    min_peers: int
    round_timeout: float
    # refuse an update whose norm is over norm_guard x the median of accepted ones; None: off
    # (a default, so that runs created before the guard existed load as they were)
    norm_guard: float | None = None

    @property
    def outer_optimizer(self) -> Outer:
        return Outer(self.outer, self.outer_lr, self.outer_momentum)


@dataclass
class Peer:
    """A peer's identity and traffic; its standing in rounds is the policy's (:class:`~syncserver.policy.Member`)."""

    name: str
    rank: int | None
    joined: float  # wall time
    samples: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rate: float = 0.0  # samples/s between its last two updates
    last_update_at: float | None = None


@dataclass
class Run:
    name: str
    config: RunConfig
    codec: Codec
    policy: BarrierPolicy
    version: int = -1
    schema: Schema | None = None
    shape: RunShape | None = None  # what the schema implies (layout, limits, its JSON): set with it
    sealed: bool = False
    peers: dict[str, Peer] = field(default_factory=dict)
    init_claim: str | None = None  # the peer told to upload version 0
    creator: str | None = None  # the kind of token that created it (its quota's; None: created before)
    # the open round (number == version): its acknowledged updates, uploads under way, when it
    # got its first update (wall time), and its running mean
    acked: dict[str, UpdateRecord] = field(default_factory=dict)
    uploading: set[str] = field(default_factory=set)
    opened: float | None = None
    acc: Accumulator | None = None
    fold_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # the norm guard's memory: norms of this round's accepted updates and of the previous
    # round's. In memory: a restart starts it afresh.
    norms: dict[str, float] = field(default_factory=dict)
    previous_norms: list[float] = field(default_factory=list)
    # round -> peer -> (wall time its result download began, ended); in memory, bounded
    downloads: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    # a close that failed (say the disk is full) is tried again from this monotonic time on
    close_failures: int = 0
    close_retry_at: float = 0.0
    # writes the file of ``version`` after the round that made it committed; pulls wait for it
    writing: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake every waiter of this run (they re-check what they wait for)."""
        self.changed.set()
        self.changed = asyncio.Event()

    @property
    def closing(self) -> bool:
        return self.policy.closing

    def world_size(self) -> int:
        ranks = [p.rank for p in self.peers.values() if p.rank is not None]
        return max(ranks) + 1 if ranks else 0

    def record(self, peer: Peer) -> PeerRecord:
        """The peer as stored."""
        member = self.policy.members[peer.name]
        return PeerRecord(peer.name, peer.rank, member.active_from, peer.joined, member.left)

    def accumulator(self) -> Accumulator:
        assert self.schema is not None
        if self.acc is None:
            self.acc = Accumulator(self.schema)
        return self.acc


def now() -> float:
    """The policies' clock."""
    return time.monotonic()
