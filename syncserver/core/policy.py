"""Round policies: who is waited for, when a round closes with whom, and what each update weighs.

Pure decisions: no I/O, HTTP, clock (each event carries ``now``, monotonic seconds) or tensors. The
coordinator feeds a policy a run's events and carries out its answers (:class:`Admit`,
:class:`Close`, :class:`Place`). One per run: :class:`BarrierPolicy`, :class:`SamplesPolicy`
(hivemind's ``target_batch_size``), :class:`AsyncPolicy` (FedAsync / FedBuff with a buffer of one);
docs/concepts/rounds.md tells each, and who a round waits for: live members only (a fresh lease;
a watch open, or dropped under ``disconnect_grace`` ago: a crashed process is gone in seconds,
not a lease), with at least ``min_merge_peers`` updates, a gone member counting (it may come back).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "POLICIES",
    "Admit",
    "Lost",
    "AsyncPolicy",
    "BarrierPolicy",
    "Close",
    "Member",
    "PeerState",
    "Place",
    "RoundPolicy",
    "SamplesPolicy",
    "make_policy",
]

POLICIES = ("barrier", "samples", "async")
STALENESS_EXPONENT = 0.5  # FedAsync's polynomial discount (1 + s) ** -a; FedBuff uses the same a


class PeerState(str, Enum):
    LIVE = "live"  # lease fresh: waited for in rounds it takes part in
    LATE = "late"  # lease fresh, but its round closed without it: it is catching up
    GONE = "gone"  # lease expired or connection dropped: not waited for; its next request brings it back
    LEFT = "left"  # said goodbye; joining again brings it back


class Lost(str, Enum):
    """Why a member stopped being live (the ``reason`` of the hub's ``peer_gone`` line)."""

    LEASE_EXPIRED = "lease_expired"  # no request for lease_seconds: a hung or vanished machine
    DISCONNECTED = "disconnected"  # its watch dropped and none came back within the grace: a dead process


class Place(str, Enum):
    """Where an update (or a progress report) addressed to a round belongs."""

    OPEN = "open"  # the open round takes it
    CLOSED = "closed"  # that round closed without it: catch up
    AHEAD = "ahead"  # no such round yet
    STALE = "stale"  # async: its base is more than max_staleness versions old


@dataclass
class Member:
    """What a policy knows of a peer."""

    name: str
    active_from: int  # the first round it is waited for
    counted: bool  # it has a rank: rounds wait for it (the run has started with it in)
    last_seen: float  # monotonic
    left: bool = False
    last_round: int = -1  # the last round it has an acknowledged update in
    watches: int = 0  # its watch requests held open now
    dropped: float | None = None  # when its last open watch dropped (monotonic); None: none dropped since


@dataclass(frozen=True)
class Admit:
    """A join's answer: the peer is waited for from ``first_round`` on."""

    first_round: int
    returning: bool  # it was a member already (a restart after a crash, or a leave)


@dataclass(frozen=True)
class Close:
    """Close round ``round`` with these updates, in acknowledgement order."""

    round: int
    participants: tuple[str, ...]
    dropped: tuple[str, ...]  # waited for but not in: stragglers, told to catch up


class RoundPolicy:
    """Membership, leases and the open round, shared by every policy; subclasses decide."""

    def __init__(
        self,
        *,
        round_timeout: float,
        lease_seconds: float,
        disconnect_grace: float,
        min_merge_peers: int = 1,
        round_: int = -1,
    ) -> None:
        if min_merge_peers < 1 or not round_timeout > 0 or not lease_seconds > 0 or not disconnect_grace > 0:
            raise ValueError("min_merge_peers must be >= 1, round_timeout, lease_seconds and disconnect_grace > 0")
        self.min_merge_peers = min_merge_peers
        self.round_timeout = round_timeout
        self.lease_seconds = lease_seconds
        self.disconnect_grace = disconnect_grace
        self.round = round_  # the open round (= the run's version); -1 before version 0
        self.members: dict[str, Member] = {}
        self.live: frozenset[str] = frozenset()  # as of the last event or expiry
        self.acked: list[str] = []  # the open round's updates, in acknowledgement order
        self.samples: dict[str, int] = {}  # their sample counts
        self.reported: dict[str, int] = {}  # samples each peer trained in the open round, as it said
        self.refused: set[str] = set()  # refused this round (the norm guard): not waited for
        self.opened: float | None = None  # when the open round got its first update
        self.closing = False  # a Close was answered and is being carried out

    #: what an interval counts in this policy's runs (sync_every auto's, syncserver/core/interval.py)
    unit = "steps"

    def resize(self, every: int) -> None:
        """The hub picked the next interval (sync_every auto): the peers count steps, nothing here."""

    # ---- membership ------------------------------------------------------------------------
    def restore(self, name: str, *, active_from: int, counted: bool, left: bool, now: float) -> None:
        """A member as stored (the hub restarted): it gets a fresh lease, to ride through."""
        self.members[name] = Member(name, active_from, counted, now, left)
        if not left:
            self.live |= {name}

    def join(self, name: str, now: float, *, counted: bool) -> Admit:
        """A peer joins (again); one coming in mid-round is waited for from the next, like any new peer."""
        in_round = bool(self.acked) or self.closing
        member = self.members.get(name)
        returning = member is not None
        if member is None:
            member = Member(name, max(self.round, 0) + int(in_round), counted, now)
            self.members[name] = member
        else:
            member.left, member.last_seen, member.dropped = False, now, None  # a request: alive
            if in_round:
                member.active_from = max(member.active_from, self.round + 1)
        self.live |= {name}
        return Admit(member.active_from, returning)

    def seal(self, names: Iterable[str]) -> None:
        """The run starts with these peers: from now on rounds wait for them."""
        for name in names:
            self.members[name].counted = True

    def seen(self, name: str, now: float) -> bool:
        """A request from a member begins: a fresh lease, a dropped watch forgiven; True if it was
        gone. Only a request's start says so: a long poll a dead peer left must not keep it alive."""
        member = self.members[name]
        member.last_seen, member.dropped = now, None
        back = name not in self.live
        self.live |= {name}
        return back

    def watch(self, name: str, now: float) -> bool:
        """A watch request of ``name`` is held open from now on (its heartbeat); as :meth:`seen`."""
        self.members[name].watches += 1
        return self.seen(name, now)

    def unwatch(self, name: str, now: float, *, dropped: bool) -> None:
        """A watch ended: answered, or ``dropped`` by the peer's side (dead): none open, gone after the grace."""
        member = self.members[name]
        member.watches = max(0, member.watches - 1)
        if dropped and member.watches == 0 and not member.left:
            member.dropped = now

    def lost(self, name: str, now: float) -> Lost | None:
        """Why ``name`` is not live at ``now`` (None: it is, or it left)."""
        m = self.members[name]
        if m.left:
            return None
        if now - m.last_seen > self.lease_seconds:
            return Lost.LEASE_EXPIRED
        if m.dropped is not None and m.watches == 0 and now - m.dropped >= self.disconnect_grace:
            return Lost.DISCONNECTED
        return None

    def next_loss(self) -> float | None:
        """When a live member's lease runs out first: the ticker looks then (a hung peer gone at its lease)."""
        due = [self.members[name].last_seen + self.lease_seconds for name in self.live]
        return min(due, default=None)

    def leave(self, name: str, now: float) -> Close | None:
        self.members[name].left = True
        self.live -= {name}
        return self.decide(now)

    def expire(self, now: float) -> dict[str, Lost]:
        """Recompute who is live; return the members gone since last time, and why."""
        lost = {m.name: self.lost(m.name, now) for m in self.members.values() if not m.left}
        live = frozenset(name for name, why in lost.items() if why is None)
        gone = {name: why for name in sorted(self.live - live) if (why := lost.get(name)) is not None}
        self.live = live
        return gone

    # ---- the open round --------------------------------------------------------------------
    def begin(self, round_: int) -> None:
        """Round ``round_`` is open (version 0 exists, or the hub restarted at this version)."""
        self.round = round_

    def place(self, round_: int, open_: int | None = None) -> Place:
        """Where an update computed from version ``round_`` goes while round ``open_`` (None: the
        open one) is open: only the open round takes it."""
        open_ = self.round if open_ is None else open_
        if round_ < open_:
            return Place.CLOSED
        return Place.AHEAD if round_ > open_ or open_ < 0 else Place.OPEN

    def progress(self, name: str, samples: int, now: float) -> Close | None:
        """``name`` trained ``samples`` in the open round (the samples policy acts on it, others show it)."""
        if name not in self.samples:  # an update in says it all
            self.reported[name] = samples
        return self.decide(now)

    def round_total(self) -> int:
        """The open round's samples so far: every acknowledged update, and live peers' reports."""
        held = sum(self.samples.values())
        return held + sum(n for name, n in self.reported.items() if name in self.live and name not in self.samples)

    @property
    def due(self) -> bool:
        """Whether every peer should send its update now (the samples policy's signal)."""
        return False

    def acknowledged(self, name: str, now: float, samples: int = 1) -> Close | None:
        """``name``'s update for the open round (``samples`` samples) is durable."""
        if self.closing and name not in self.acked:
            raise ValueError(f"round {self.round} is closing: an update now belongs to the next one")
        self.restore_update(name, now, samples)
        return self.decide(now)

    def restore_update(self, name: str, now: float, samples: int = 1) -> None:
        """An update the open round had before a restart (no decision yet: the next tick makes it)."""
        if name in self.acked:
            raise ValueError(f"{name!r} already has an update in round {self.round}")
        self.acked.append(name)
        self.samples[name] = samples
        self.members[name].last_round = self.round
        if self.opened is None:
            self.opened = now

    def refuse(self, name: str, now: float) -> Close | None:
        """``name``'s update was refused (the norm guard): the round stops waiting for it."""
        self.refused.add(name)
        return self.decide(now)

    @property
    def deadline(self) -> float | None:
        return None if self.opened is None else self.opened + self.round_timeout

    def expected(self) -> frozenset[str]:
        """Whom the open round waits for."""
        return frozenset(
            m.name for m in self.members.values() if m.counted and m.name in self.live and m.active_from <= self.round
        ) - frozenset(self.refused)

    def quorum(self) -> int:
        """The updates a round needs to close: ``min_merge_peers``, or fewer once members left (a
        peer done training must not hold back the others). A gone member counts: it may come back."""
        staying = sum(1 for m in self.members.values() if m.counted and not m.left)
        return max(1, min(self.min_merge_peers, staying))

    def floor_wait(self, now: float) -> bool:
        """Whether the open round waits on its floor alone (all it waits for in, or overdue, under quorum)."""
        if self.closing or not self.acked or len(self.acked) >= self.quorum():
            return False
        deadline = self.deadline
        return self.expected() <= set(self.acked) or (deadline is not None and now >= deadline)

    def decide(self, now: float) -> Close | None:
        raise NotImplementedError

    def _close(self, dropped: Iterable[str]) -> Close:
        self.closing = True
        return Close(self.round, tuple(self.acked), tuple(sorted(dropped)))

    def committed(self, close: Close) -> None:
        """The round ``close`` named is durable: the next one opens, empty."""
        if close.round != self.round:
            raise ValueError(f"round {close.round} committed, but round {self.round} is open")
        self.round += 1
        self.acked, self.samples, self.reported, self.refused = [], {}, {}, set()
        self.opened, self.closing = None, False

    def abandoned(self) -> None:
        """Closing failed (say the disk filled up): the round stays open and is decided again."""
        self.closing = False

    # ---- what an update weighs ---------------------------------------------------------------
    def weight(self, samples: int, base: int, round_: int) -> float:
        """An update's weight in the merge of round ``round_`` (computed from version ``base``)."""
        return float(samples)

    def total(self, samples: int) -> float:
        """What the sum of a round's weighted updates is divided by (``samples``: their sum)."""
        return float(samples)

    def fraction(self, samples: int) -> float:
        """How much of an outer step ``samples`` make (Delayed Nesterov's clock): a barrier round is one."""
        return math.inf

    # ---- reading -------------------------------------------------------------------------
    def state(self, name: str) -> PeerState:
        member = self.members[name]
        if member.left:
            return PeerState.LEFT
        if name not in self.live:
            return PeerState.GONE
        if 0 <= member.last_round < self.round - 1 and member.active_from <= self.round - 1:
            return PeerState.LATE
        return PeerState.LIVE


class BarrierPolicy(RoundPolicy):
    """Every live peer, or those in once the deadline passed; never under the merge floor."""

    def decide(self, now: float) -> Close | None:
        """Close the open round if it is complete, or overdue with a quorum; else wait."""
        if self.closing or not self.acked:
            return None
        expected = self.expected()
        enough = len(self.acked) >= self.quorum()
        everyone = expected <= set(self.acked)
        overdue = self.deadline is not None and now >= self.deadline
        if not (enough and (everyone or overdue)):
            return None
        return self._close(expected - set(self.acked))


class SamplesPolicy(RoundPolicy):
    """Due once the live peers' samples reach ``round_samples``; closed once all who reported sent."""

    def __init__(self, *, round_samples: int, **common: Any) -> None:
        super().__init__(**common)
        if round_samples < 1:
            raise ValueError("round_samples must be >= 1")
        self.round_samples = round_samples
        self.due_since: float | None = None

    unit = "samples"

    def resize(self, every: int) -> None:
        """The hub picked the next round's size (sync_every auto)."""
        self.round_samples = every

    @property
    def due(self) -> bool:
        return self.due_since is not None

    @property
    def deadline(self) -> float | None:
        return None if self.due_since is None else self.due_since + self.round_timeout

    def decide(self, now: float) -> Close | None:
        """Due at the target; close when every live peer with samples (or every one) is in, or overdue."""
        if self.closing:
            return None
        if self.due_since is None and self.round_total() >= self.round_samples:
            self.due_since = now
        if not self.acked or len(self.acked) < self.quorum():
            return None
        acked = set(self.acked)
        expected = self.expected()
        if expected <= acked:  # everyone is in (say, every peer's last update at the end of training)
            return self._close(())
        if self.due_since is None:
            return None
        with_samples = {name for name in expected if self.reported.get(name, 0) > 0}
        if with_samples <= acked or now >= self.due_since + self.round_timeout:
            return self._close(with_samples - acked)
        return None

    def committed(self, close: Close) -> None:
        super().committed(close)
        self.due_since = None


class AsyncPolicy(RoundPolicy):
    """No barrier: each update applied as acknowledged, discounted; ``round_samples``: an outer step."""

    def __init__(self, *, round_samples: int, max_staleness: int, **common: Any) -> None:
        super().__init__(**common)
        if round_samples < 1 or max_staleness < 0:
            raise ValueError("round_samples must be >= 1 and max_staleness >= 0")
        self.round_samples = round_samples
        self.max_staleness = max_staleness

    def place(self, round_: int, open_: int | None = None) -> Place:
        """Into the open version, unless over ``max_staleness`` versions old."""
        open_ = self.round if open_ is None else open_
        if round_ > open_ or open_ < 0:
            return Place.AHEAD
        return Place.STALE if open_ - round_ > self.max_staleness else Place.OPEN

    def decide(self, now: float) -> Close | None:
        """Apply what is in, now: no one is waited for."""
        if self.closing or not self.acked:
            return None
        return self._close(())

    def expected(self) -> frozenset[str]:
        return frozenset()

    def floor_wait(self, now: float) -> bool:
        return False  # each update is applied alone: there is no floor to wait on

    def weight(self, samples: int, base: int, round_: int) -> float:
        """``samples * (1 + late) ** -0.5``, ``late`` the outer steps since its base beyond the first (N
        equal peers' updates, N - 1 versions old, are not discounted): a stale one counts less, not 0."""
        staleness = round_ - base
        if staleness < 0:
            raise ValueError(f"an update from version {base} cannot go into round {round_}")
        late = max(0.0, staleness * samples / self.round_samples - 1.0)
        return samples * (1.0 + late) ** -STALENESS_EXPONENT

    def total(self, samples: int) -> float:
        """``round_samples``, or more: a whole step's update moves by its whole delta, a smaller by its share."""
        return float(max(self.round_samples, samples))

    def fraction(self, samples: int) -> float:
        return samples / self.round_samples

    def state(self, name: str) -> PeerState:
        state = super().state(name)
        return PeerState.LIVE if state is PeerState.LATE else state  # nobody is late without rounds


def make_policy(name: str, *, round_samples: int | None, max_staleness: int, **common: Any) -> RoundPolicy:
    """The policy a run's config names; ``common``: :class:`RoundPolicy`'s keywords."""
    if name == "barrier":
        return BarrierPolicy(**common)
    if round_samples is None:
        raise ValueError(f"policy {name!r} needs round_samples")
    if name == "samples":
        return SamplesPolicy(round_samples=round_samples, **common)
    if name == "async":
        return AsyncPolicy(round_samples=round_samples, max_staleness=max_staleness, **common)
    raise ValueError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
