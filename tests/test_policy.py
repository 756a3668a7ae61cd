"""The barrier policy in-process: hand-built event sequences, hand-checked decisions. No hub,
no HTTP, no clock (every event carries its time), so each test runs in microseconds."""

from __future__ import annotations

import pytest

from syncserver.policy import Admit, BarrierPolicy, Close, PeerState

LEASE = 60.0
TIMEOUT = 10.0


def started(*names: str, min_peers: int = 1, round_: int = 0) -> BarrierPolicy:
    """A policy whose run has started (version ``round_`` open) with ``names`` as members."""
    policy = BarrierPolicy(min_peers=min_peers, round_timeout=TIMEOUT, lease_seconds=LEASE, round_=-1)
    for name in names:
        policy.join(name, 0.0, counted=False)
    policy.begin(round_)
    policy.seal(names)
    return policy


def test_the_round_closes_when_every_live_member_is_in() -> None:
    policy = started("a", "b", "c")
    assert policy.acknowledged("b", 1.0) is None
    assert policy.acknowledged("a", 2.0) is None
    assert policy.acknowledged("c", 3.0) == Close(0, ("b", "a", "c"), ())
    assert policy.closing
    assert policy.decide(4.0) is None, "one Close per round"
    policy.committed(Close(0, ("b", "a", "c"), ()))
    assert (policy.round, policy.acked, policy.opened, policy.closing) == (1, [], None, False)


def test_the_deadline_closes_with_a_quorum_and_drops_the_straggler() -> None:
    policy = started("a", "b", "c", min_peers=2)
    assert policy.acknowledged("a", 5.0) is None
    assert policy.deadline == 5.0 + TIMEOUT
    assert policy.decide(5.0 + TIMEOUT - 0.001) is None
    assert policy.acknowledged("b", 6.0) is None
    assert policy.decide(5.0 + TIMEOUT) == Close(0, ("a", "b"), ("c",))


def test_no_quorum_no_close_even_past_the_deadline() -> None:
    policy = started("a", "b", "c", min_peers=2)
    policy.acknowledged("a", 0.0)
    assert policy.decide(1000.0) is None
    assert policy.acknowledged("c", 1001.0) == Close(0, ("a", "c"), ("b",))


def test_a_round_with_no_update_never_closes() -> None:
    policy = started("a")
    assert policy.decide(1e9) is None


def test_an_expired_lease_stops_the_wait() -> None:
    policy = started("a", "b")
    policy.seen("a", 55.0)
    policy.acknowledged("a", 55.0)  # its deadline: 65
    assert policy.expire(LEASE) == frozenset()  # b last seen at 0: still fresh at 60
    assert policy.decide(LEASE) is None
    assert policy.expire(LEASE + 0.5) == {"b"}
    assert policy.state("b") is PeerState.GONE
    assert policy.decide(LEASE + 0.5) == Close(0, ("a",), ())  # b is not waited for, nor dropped


def test_a_gone_peer_comes_back_on_its_next_request() -> None:
    policy = started("a", "b")
    policy.expire(LEASE + 1)
    assert policy.live == frozenset()
    assert policy.seen("b", LEASE + 2) is True
    assert policy.seen("b", LEASE + 3) is False
    assert policy.live == {"b"}


def test_leaving_closes_a_round_that_only_waited_for_the_leaver() -> None:
    policy = started("a", "b")
    policy.acknowledged("a", 1.0)
    assert policy.leave("b", 2.0) == Close(0, ("a",), ())
    assert policy.state("b") is PeerState.LEFT


def test_a_refused_update_is_not_waited_for() -> None:
    policy = started("a", "b")
    policy.acknowledged("a", 1.0)
    assert policy.refuse("b", 2.0) == Close(0, ("a",), ())


def test_a_peer_joining_mid_round_waits_for_the_next() -> None:
    policy = started("a", "b")
    assert policy.join("late", 1.0, counted=True) == Admit(0, returning=False)  # nothing sent yet: this round
    policy.acknowledged("a", 2.0)
    assert policy.join("later", 3.0, counted=True) == Admit(1, returning=False)
    assert policy.expected() == {"a", "b", "late"}
    policy.acknowledged("b", 4.0)
    assert policy.acknowledged("late", 5.0) == Close(0, ("a", "b", "late"), ())


def test_a_member_restarting_mid_round_is_waited_for_from_the_next_round() -> None:
    policy = started("a", "b")
    policy.acknowledged("a", 1.0)
    assert policy.join("b", 2.0, counted=True) == Admit(1, returning=True)
    assert policy.decide(2.0) == Close(0, ("a",), ())
    policy.committed(Close(0, ("a",), ()))
    assert policy.expected() == {"a", "b"}


def test_before_the_run_starts_nobody_is_waited_for() -> None:
    policy = BarrierPolicy(min_peers=2, round_timeout=TIMEOUT, lease_seconds=LEASE)
    policy.join("a", 0.0, counted=False)
    policy.begin(0)
    assert policy.expected() == frozenset()
    policy.join("b", 1.0, counted=False)
    policy.seal(["a", "b"])
    assert policy.expected() == {"a", "b"}


def test_a_failed_close_is_decided_again() -> None:
    policy = started("a")
    close = policy.acknowledged("a", 1.0)
    assert close is not None
    policy.abandoned()
    assert policy.decide(2.0) == close


def test_late_is_a_peer_whose_last_update_missed_a_round() -> None:
    policy = started("a", "b")
    policy.acknowledged("a", 0.0)
    policy.committed(Close(0, ("a", "b"), ()) if policy.acknowledged("b", 0.5) else pytest.fail("no close"))
    assert policy.state("a") is policy.state("b") is PeerState.LIVE
    policy.acknowledged("a", 1.0)
    assert policy.decide(1.0 + TIMEOUT) == Close(1, ("a",), ("b",))  # b missed round 1
    policy.committed(Close(1, ("a",), ("b",)))
    assert policy.state("a") is PeerState.LIVE
    assert policy.state("b") is PeerState.LATE


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="min_peers"):
        BarrierPolicy(min_peers=0, round_timeout=1, lease_seconds=1)
    policy = started("a")
    policy.acknowledged("a", 0.0)
    with pytest.raises(ValueError, match="already has an update"):
        policy.acknowledged("a", 0.0)
    with pytest.raises(ValueError, match="round 0 is open"):
        policy.committed(Close(3, ("a",), ()))
