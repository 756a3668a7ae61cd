"""The barrier policy in-process: hand-built event sequences, hand-checked decisions. No hub,
no HTTP, no clock (every event carries its time), so each test runs in microseconds."""

from __future__ import annotations

import pytest

from syncserver.core.policy import (
    Admit,
    AsyncPolicy,
    BarrierPolicy,
    Close,
    Lost,
    PeerState,
    Place,
    SamplesPolicy,
    make_policy,
)

LEASE = 60.0
TIMEOUT = 10.0
GRACE = 2.0


def started(*names: str, min_merge_peers: int = 1, round_: int = 0) -> BarrierPolicy:
    """A policy whose run has started (version ``round_`` open) with ``names`` as members."""
    policy = BarrierPolicy(
        min_merge_peers=min_merge_peers,
        round_timeout=TIMEOUT,
        lease_seconds=LEASE,
        disconnect_grace=GRACE,
        round_=-1,
    )
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
    policy = started("a", "b", "c", min_merge_peers=2)
    assert policy.acknowledged("a", 5.0) is None
    assert policy.deadline == 5.0 + TIMEOUT
    assert policy.decide(5.0 + TIMEOUT - 0.001) is None
    assert policy.acknowledged("b", 6.0) is None
    assert policy.decide(5.0 + TIMEOUT) == Close(0, ("a", "b"), ("c",))


def test_no_quorum_no_close_even_past_the_deadline() -> None:
    policy = started("a", "b", "c", min_merge_peers=2)
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
    assert policy.expire(LEASE) == {}  # b last seen at 0: still fresh at 60
    assert policy.decide(LEASE) is None
    assert policy.expire(LEASE + 0.5) == {"b": Lost.LEASE_EXPIRED}
    assert policy.state("b") is PeerState.GONE
    assert policy.decide(LEASE + 0.5) == Close(0, ("a",), ())  # b is not waited for, nor dropped


def test_a_gone_member_does_not_hold_the_round() -> None:
    """The issue's scenario at the policy: three members (as with min_peers 3), a and b sent
    round 1, c died: the round closes with a and b as soon as c is gone, not at a deadline."""
    policy = started("a", "b", "c")
    for name in "abc":
        policy.watch(name, 0.0)
    policy.acknowledged("a", 1.0)
    assert policy.acknowledged("b", 1.5) is None  # c is live: waited for
    policy.unwatch("c", 2.0, dropped=True)  # its process died: the kernel closed its socket
    assert policy.expire(2.0 + GRACE - 0.01) == {} and policy.decide(2.0 + GRACE - 0.01) is None
    assert policy.expire(2.0 + GRACE) == {"c": Lost.DISCONNECTED}
    assert policy.state("c") is PeerState.GONE
    assert not policy.floor_wait(2.0 + GRACE)
    assert policy.decide(2.0 + GRACE) == Close(0, ("a", "b"), ())  # c is neither waited for nor dropped


def test_a_dropped_watch_is_forgiven_by_a_request_within_the_grace() -> None:
    """A reset link: the SDK asks again at once, and the peer never stops being live. A watch
    answered (not dropped) starts no grace at all."""
    policy = started("a", "b")
    policy.watch("b", 0.0)
    policy.unwatch("b", 1.0, dropped=False)  # answered at its hold's end
    assert policy.expire(1.0 + 10 * GRACE) == {}
    policy.watch("b", 1.0)
    policy.unwatch("b", 2.0, dropped=True)
    assert policy.watch("b", 2.5) is False  # back within the grace: it was never gone
    assert policy.expire(2.0 + 10 * GRACE) == {}
    policy.unwatch("b", 30.0, dropped=True)
    policy.seen("b", 31.0)  # any request that begins proves the process alive
    assert policy.expire(30.0 + 10 * GRACE) == {}
    assert policy.lost("b", LEASE + 31.5) is Lost.LEASE_EXPIRED  # a hung machine: its lease alone


def test_a_peer_with_two_watches_is_gone_only_when_both_dropped() -> None:
    policy = started("a")
    policy.watch("a", 0.0)
    policy.watch("a", 0.1)  # a watch re-issued before the hub saw the old one drop
    policy.unwatch("a", 1.0, dropped=True)
    assert policy.expire(1.0 + GRACE) == {}
    policy.unwatch("a", 2.0, dropped=True)
    assert policy.expire(2.0 + GRACE) == {"a": Lost.DISCONNECTED}
    assert policy.seen("a", 5.0) is True  # its next request brings it back


def test_a_restarted_process_joining_within_the_grace_is_not_gone() -> None:
    """The old process's watch dropped; the new one joins before its own watch begins."""
    policy = started("a")
    policy.watch("a", 0.0)
    policy.unwatch("a", 1.0, dropped=True)
    assert policy.join("a", 1.5, counted=True).returning
    assert policy.expire(1.0 + 10 * GRACE) == {}


def test_the_merge_floor_holds_a_round_and_says_so() -> None:
    """min_merge_peers 3: a and b are in, c is gone: the round waits on the floor (and says
    so) until c comes back and sends its update."""
    policy = started("a", "b", "c", min_merge_peers=3)
    policy.watch("c", 0.0)
    policy.acknowledged("a", 1.0)
    assert not policy.floor_wait(1.0)  # waiting for b and c, not for the floor
    policy.acknowledged("b", 1.5)
    policy.unwatch("c", 2.0, dropped=True)
    policy.expire(2.0 + GRACE)
    assert policy.floor_wait(2.0 + GRACE) and policy.decide(2.0 + GRACE) is None
    policy.seen("c", 5.0)
    assert not policy.floor_wait(5.0)  # c is live: waited for again, as any member
    assert policy.acknowledged("c", 6.0) == Close(0, ("a", "b", "c"), ())


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


def test_a_member_that_left_no_longer_counts_towards_the_quorum() -> None:
    """A floor of 2, and b finished its training (its last update in round 0, then it left): a's
    next rounds close with a alone, at once, instead of never."""
    policy = started("a", "b", min_merge_peers=2)
    policy.acknowledged("a", 1.0)
    close = policy.acknowledged("b", 2.0)
    assert close == Close(0, ("a", "b"), ())
    policy.committed(close)
    assert policy.leave("b", 3.0) is None
    assert policy.quorum() == 1
    assert policy.acknowledged("a", 4.0) == Close(1, ("a",), ())


def test_a_gone_member_still_counts_towards_the_merge_floor() -> None:
    """With min_merge_peers 2, the floor holds a round of one: a gone member may come back."""
    policy = started("a", "b", "c", min_merge_peers=2)
    policy.expire(LEASE + 1)
    policy.seen("a", LEASE + 2)
    policy.acknowledged("a", LEASE + 2)
    assert policy.quorum() == 2
    assert policy.floor_wait(LEASE + 2)  # every live member is in: the floor alone holds it
    assert policy.decide(1e9) is None  # b and c may come back: no run of one
    assert policy.leave("b", 1e9) is None
    assert policy.leave("c", 1e9) == Close(0, ("a",), ())  # the last one that might have come back left
    assert policy.quorum() == 1


def test_a_samples_round_needs_no_quorum_of_members_that_left() -> None:
    policy = SamplesPolicy(
        round_samples=10, min_merge_peers=2, round_timeout=TIMEOUT, lease_seconds=LEASE, disconnect_grace=GRACE
    )
    for name in ("a", "b"):
        policy.join(name, 0.0, counted=False)
    policy.begin(0)
    policy.seal(["a", "b"])
    policy.leave("b", 1.0)
    assert policy.acknowledged("a", 2.0, samples=4) == Close(0, ("a",), ())


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
    policy = BarrierPolicy(min_merge_peers=2, round_timeout=TIMEOUT, lease_seconds=LEASE, disconnect_grace=GRACE)
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
    with pytest.raises(ValueError, match="min_merge_peers"):
        BarrierPolicy(min_merge_peers=0, round_timeout=1, lease_seconds=1, disconnect_grace=1)
    policy = started("a")
    policy.acknowledged("a", 0.0)
    with pytest.raises(ValueError, match="already has an update"):
        policy.acknowledged("a", 0.0)
    with pytest.raises(ValueError, match="round 0 is open"):
        policy.committed(Close(3, ("a",), ()))


# ---- samples: rounds that close on a global sample count ----------------------------------------


def samples_run(*names: str, target: int = 100, min_merge_peers: int = 1) -> SamplesPolicy:
    policy = SamplesPolicy(
        round_samples=target,
        min_merge_peers=min_merge_peers,
        round_timeout=TIMEOUT,
        lease_seconds=LEASE,
        disconnect_grace=GRACE,
    )
    for name in names:
        policy.join(name, 0.0, counted=False)
    policy.begin(0)
    policy.seal(names)
    return policy


def test_a_samples_round_is_due_once_the_reports_reach_the_target() -> None:
    policy = samples_run("a", "b", "c")
    assert policy.progress("a", 40, 1.0) is None and policy.progress("b", 30, 1.0) is None
    assert not policy.due and policy.round_total() == 70
    assert policy.progress("c", 30, 2.0) is None
    assert policy.due and policy.deadline == 2.0 + TIMEOUT
    assert policy.acknowledged("a", 3.0, samples=45) is None  # b and c have samples: they are waited for
    assert policy.acknowledged("c", 3.5, samples=31) is None
    assert policy.acknowledged("b", 4.0, samples=30) == Close(0, ("a", "c", "b"), ())
    assert policy.round_total() == 106


def test_a_due_round_does_not_wait_for_a_peer_without_samples() -> None:
    policy = samples_run("fast", "fresh")
    policy.progress("fresh", 0, 1.0)
    policy.progress("fast", 100, 1.0)
    assert policy.due
    assert policy.acknowledged("fast", 2.0, samples=100) == Close(0, ("fast",), ())


def test_a_due_round_closes_at_its_deadline_with_a_quorum() -> None:
    policy = samples_run("a", "b")
    policy.progress("a", 60, 1.0)
    policy.progress("b", 40, 1.0)
    assert policy.acknowledged("a", 2.0, samples=60) is None
    assert policy.decide(1.0 + TIMEOUT - 0.01) is None
    assert policy.decide(1.0 + TIMEOUT) == Close(0, ("a",), ("b",))


def test_a_samples_round_closes_early_when_every_live_peer_is_in() -> None:
    policy = samples_run("a", "b")  # say both finished training: their last updates are small
    assert policy.acknowledged("a", 1.0, samples=5) is None
    assert policy.acknowledged("b", 2.0, samples=7) == Close(0, ("a", "b"), ())
    assert not policy.due


def test_only_live_peers_reports_count() -> None:
    policy = samples_run("a", "b")
    policy.progress("b", 50, 0.0)
    policy.seen("a", LEASE)
    policy.progress("a", 60, LEASE)
    assert policy.due
    policy = samples_run("a", "b")
    policy.progress("b", 50, 0.0)
    policy.seen("a", LEASE)
    policy.expire(LEASE + 1)  # b's lease ran out: its samples will not come
    policy.progress("a", 60, LEASE + 1)
    assert not policy.due and policy.round_total() == 60


def test_a_committed_samples_round_starts_the_count_afresh() -> None:
    policy = samples_run("a")
    policy.progress("a", 100, 1.0)
    close = policy.acknowledged("a", 1.0, samples=100)
    assert close is not None
    policy.committed(close)
    assert (policy.round, policy.due, policy.round_total(), policy.deadline) == (1, False, 0, None)


def test_an_update_cannot_join_a_closing_round() -> None:
    policy = samples_run("a", "b")
    policy.progress("a", 90, 1.0)
    policy.progress("b", 10, 1.0)
    assert policy.acknowledged("a", 1.0, samples=90) is None
    assert policy.acknowledged("b", 1.0, samples=11) == Close(0, ("a", "b"), ())
    with pytest.raises(ValueError, match="closing"):
        policy.acknowledged("c", 1.0)


# ---- async: no barrier, staleness-weighted ------------------------------------------------------


def async_run(*names: str, round_: int = 5, max_staleness: int = 2) -> AsyncPolicy:
    policy = AsyncPolicy(
        round_samples=200,
        max_staleness=max_staleness,
        round_timeout=TIMEOUT,
        lease_seconds=LEASE,
        disconnect_grace=GRACE,
    )
    for name in names:
        policy.join(name, 0.0, counted=False)
    policy.begin(round_)
    policy.seal(names)
    return policy


def test_async_takes_updates_up_to_max_staleness_versions_old() -> None:
    policy = async_run("a", round_=5, max_staleness=2)
    assert [policy.place(b) for b in (6, 5, 4, 3, 2)] == [Place.AHEAD, Place.OPEN, Place.OPEN, Place.OPEN, Place.STALE]
    assert BarrierPolicy(round_timeout=1, lease_seconds=1, disconnect_grace=0.5, round_=5).place(4) is Place.CLOSED


def test_async_applies_each_update_at_once_and_never_waits() -> None:
    policy = async_run("a", "b", "c")
    assert policy.acknowledged("b", 1.0, samples=10) == Close(5, ("b",), ())
    policy.committed(Close(5, ("b",), ()))
    assert policy.expected() == frozenset() and policy.state("a") is PeerState.LIVE
    policy.expire(LEASE + 1)
    assert policy.state("a") is PeerState.GONE


def test_async_weights_discount_staleness_and_total_is_a_whole_outer_step() -> None:
    policy = async_run("a")  # an outer step is 200 samples
    assert policy.weight(100, 5, 5) == 100.0
    assert policy.weight(50, 2, 5) == 50.0  # 3 versions of ~50 samples: less than a step behind, not late
    assert policy.weight(100, 2, 5) == pytest.approx(100 / 1.5**0.5)  # 3 x 100 / 200 = 1.5 steps: 0.5 late
    assert policy.weight(100, 0, 5) == pytest.approx(100 / 2.5**0.5)
    assert policy.total(50) == 200.0 and policy.total(300) == 300.0  # never more than a whole mean
    assert policy.fraction(50) == 0.25
    with pytest.raises(ValueError, match="cannot go into"):
        policy.weight(1, 6, 5)
    barrier = started("a")
    assert (barrier.weight(7, 0, 0), barrier.total(7), barrier.fraction(7)) == (7.0, 7.0, float("inf"))


def test_make_policy_names_each_and_wants_a_target() -> None:
    common = {"round_timeout": 1.0, "lease_seconds": 1.0, "disconnect_grace": 0.5, "max_staleness": 3}
    assert isinstance(make_policy("barrier", round_samples=None, **common), BarrierPolicy)
    assert isinstance(make_policy("samples", round_samples=8, **common), SamplesPolicy)
    assert isinstance(make_policy("async", round_samples=8, **common), AsyncPolicy)
    with pytest.raises(ValueError, match="needs round_samples"):
        make_policy("samples", round_samples=None, **common)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("gossip", round_samples=8, **common)


def test_the_next_loss_is_the_earliest_live_lease_end_so_the_hub_looks_then() -> None:
    """The hub's ticker sleeps until :meth:`next_loss`: a hung peer is gone at its lease's end,
    not up to a tick after it (bench/failures.py measured 0.2-0.5 s over the lease at a 0.5 s tick)."""
    policy = started("a", "b", "c")
    policy.seen("a", 3.0)
    policy.seen("b", 1.0)
    policy.seen("c", 2.0)
    assert policy.next_loss() == 1.0 + LEASE
    assert policy.expire(1.0 + LEASE) == {}, "a lease is lost once strictly older than the lease"
    assert policy.expire(1.0 + LEASE + 0.005) == {"b": Lost.LEASE_EXPIRED}
    assert policy.next_loss() == 2.0 + LEASE, "a gone member is no longer looked after"
    policy.leave("c", 2.5)
    assert policy.next_loss() == 3.0 + LEASE
    policy.leave("a", 4.0)
    assert policy.next_loss() is None, "nobody live: the ticker keeps its interval"
