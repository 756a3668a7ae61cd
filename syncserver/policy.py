"""Round policies: who is waited for, and when a round closes with whom.

Pure decisions: no I/O, no HTTP, no clock (every event carries ``now``, a monotonic time in
seconds), no tensors. The coordinator feeds a policy the events of a run (a peer joins, is
seen, leaves; an update is acknowledged or refused; time passes) and carries out what it
answers: :class:`Admit` for a join, :class:`Close` when a round must close. Unit tests drive a
policy with hand-built event sequences, the way Flower tests its aggregation functions.

:class:`BarrierPolicy` is the rule the hub has always had: round v closes once every live
peer that is waited for in v has an acknowledged update, or once the round's deadline
(``round_timeout`` after its first acknowledgement) has passed with at least ``min_peers``
updates; the live peers that did not make it are dropped (they catch up). A peer is live while
its lease is fresh: any request renews it (``seen``). Other policies (rounds that close on a
global sample count, asynchronous merging) implement the same events.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

__all__ = ["Admit", "BarrierPolicy", "Close", "Member", "PeerState"]


class PeerState(str, Enum):
    LIVE = "live"  # lease fresh: waited for in rounds it takes part in
    LATE = "late"  # lease fresh, but its round closed without it: it is catching up
    GONE = "gone"  # lease expired: not waited for; its next request brings it back
    LEFT = "left"  # said goodbye; joining again brings it back


@dataclass
class Member:
    """What a policy knows of a peer."""

    name: str
    active_from: int  # the first round it is waited for
    counted: bool  # it has a rank: rounds wait for it (the run has started with it in)
    last_seen: float  # monotonic
    left: bool = False
    last_round: int = -1  # the last round it has an acknowledged update in


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


class BarrierPolicy:
    """Quorum + deadline barrier: every live peer, or ``min_peers`` once the deadline passed."""

    name = "barrier"

    def __init__(self, *, min_peers: int, round_timeout: float, lease_seconds: float, round_: int = -1) -> None:
        if min_peers < 1 or round_timeout <= 0 or lease_seconds <= 0:
            raise ValueError("min_peers must be >= 1, round_timeout and lease_seconds > 0")
        self.min_peers = min_peers
        self.round_timeout = round_timeout
        self.lease_seconds = lease_seconds
        self.round = round_  # the open round (= the run's version); -1 before version 0
        self.members: dict[str, Member] = {}
        self.live: frozenset[str] = frozenset()  # as of the last event or expiry
        self.acked: list[str] = []  # the open round's updates, in acknowledgement order
        self.refused: set[str] = set()  # refused this round (the norm guard): not waited for
        self.opened: float | None = None  # when the open round got its first update
        self.closing = False  # a Close was answered and is being carried out

    # ---- membership ------------------------------------------------------------------------
    def restore(self, name: str, *, active_from: int, counted: bool, left: bool, now: float) -> None:
        """A member as stored (the hub restarted): it gets a fresh lease, to ride through."""
        self.members[name] = Member(name, active_from, counted, now, left)
        if not left:
            self.live |= {name}

    def join(self, name: str, now: float, *, counted: bool) -> Admit:
        """A peer joins (or joins again). One that comes in while a round is under way waits
        for the next round: it starts from the latest version, like any new peer."""
        in_round = bool(self.acked) or self.closing
        member = self.members.get(name)
        returning = member is not None
        if member is None:
            member = Member(name, max(self.round, 0) + int(in_round), counted, now)
            self.members[name] = member
        else:
            member.left, member.last_seen = False, now
            if in_round:
                member.active_from = max(member.active_from, self.round + 1)
        self.live |= {name}
        return Admit(member.active_from, returning)

    def seal(self, names: Iterable[str]) -> None:
        """The run starts with these peers: from now on rounds wait for them."""
        for name in names:
            self.members[name].counted = True

    def seen(self, name: str, now: float) -> bool:
        """Any request from a member renews its lease; True if it had expired (it is back)."""
        self.members[name].last_seen = now
        back = name not in self.live
        self.live |= {name}
        return back

    def leave(self, name: str, now: float) -> Close | None:
        self.members[name].left = True
        self.live -= {name}
        return self.decide(now)

    def expire(self, now: float) -> frozenset[str]:
        """Recompute who is live; return the members whose lease ran out since last time."""
        live = frozenset(
            m.name for m in self.members.values() if not m.left and now - m.last_seen <= self.lease_seconds
        )
        gone = self.live - live
        self.live = live
        return gone

    # ---- the open round --------------------------------------------------------------------
    def begin(self, round_: int) -> None:
        """Round ``round_`` is open (version 0 exists, or the hub restarted at this version)."""
        self.round = round_

    def acknowledged(self, name: str, now: float) -> Close | None:
        """``name``'s update for the open round is durable."""
        self.restore_update(name, now)
        return self.decide(now)

    def restore_update(self, name: str, now: float) -> None:
        """An update the open round had before a restart (no decision yet: the next tick makes it)."""
        if name in self.acked:
            raise ValueError(f"{name!r} already has an update in round {self.round}")
        self.acked.append(name)
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

    def decide(self, now: float) -> Close | None:
        """Close the open round if it is complete, or overdue with a quorum; else wait."""
        if self.closing or not self.acked:
            return None
        expected = self.expected()
        enough = len(self.acked) >= self.min_peers
        everyone = expected <= set(self.acked)
        overdue = self.deadline is not None and now >= self.deadline
        if not (enough and (everyone or overdue)):
            return None
        self.closing = True
        return Close(self.round, tuple(self.acked), tuple(sorted(expected - set(self.acked))))

    def committed(self, close: Close) -> None:
        """The round ``close`` named is durable: the next one opens, empty."""
        if close.round != self.round:
            raise ValueError(f"round {close.round} committed, but round {self.round} is open")
        self.round += 1
        self.acked, self.refused, self.opened, self.closing = [], set(), None, False

    def abandoned(self) -> None:
        """Closing failed (say the disk filled up): the round stays open and is decided again."""
        self.closing = False

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
