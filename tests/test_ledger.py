"""The samples ledger (syncserver/core/ledger.py): every sample a peer reported, acknowledged or lost.

The rule's cases are pure (a Ledger and a policy's ``place``, no hub); one end-to-end test runs a
real hub and two peer processes, SIGKILLs one after it reported, then SIGKILLs the hub."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from syncclient import SyncClient
from syncserver.core.ledger import Ledger
from syncserver.core.policy import AsyncPolicy, BarrierPolicy, Place, RoundPolicy
from syncserver.records import Loss
from tests.conftest import Hub
from tests.harness import HTTP, launch, sigkill, status, wait_for
from tests.models import perturb, tiny_bigram
from tests.peer_proc import events

LIVENESS = {"round_timeout": 60.0, "lease_seconds": 10.0, "disconnect_grace": 1.5}


def close(ledger: Ledger, policy: RoundPolicy, round_: int) -> list[Loss]:
    """What the hub does at round ``round_``'s commit (syncserver/core/rounds.py)."""
    lost = ledger.lost(lambda base: policy.place(base, round_ + 1) is Place.OPEN)
    ledger.book(lost)
    return lost


def test_a_report_its_update_carries_is_acknowledged_not_lost() -> None:
    ledger, policy = Ledger(), BarrierPolicy(**LIVENESS, round_=0)
    ledger.report("a", 0, 16)
    ledger.report("a", 0, 32)  # a running count: the latest says it all
    assert ledger.pending("a") == 32
    ledger.acknowledged("a", 0, 40)  # the update carries more than the last report
    assert close(ledger, policy, 0) == []
    assert (ledger.accounts["a"].acknowledged, ledger.accounts["a"].lost, ledger.pending("a")) == (40, 0, 0)


def test_a_round_closed_without_the_peer_loses_its_report_once() -> None:
    """Killed, or late (its catch-up drops its local steps): lost at its round's close, and only then."""
    ledger, policy = Ledger(), BarrierPolicy(**LIVENESS, round_=3)
    ledger.report("b", 3, 30)
    ledger.report("c", 4, 7)  # (a round ahead: not this close's business)
    assert close(ledger, policy, 3) == [Loss(3, "b", 30)]
    assert close(ledger, policy, 4) == [Loss(4, "c", 7)]
    assert close(ledger, policy, 5) == [], "booked once"
    assert ledger.accounts["b"].lost == 30 and ledger.pending("b") == 0


def test_overlap_counts_in_flight_steps_in_the_next_round_and_ignores_late_reports() -> None:
    """sync_async: the update from version 5 is acknowledged; the steps trained meanwhile are
    reported for version 6; a report for 5 that arrives after the acknowledgement is old news."""
    ledger, policy = Ledger(), BarrierPolicy(**LIVENESS, round_=5)
    ledger.report("a", 5, 8)
    ledger.acknowledged("a", 5, 10)
    ledger.report("a", 5, 9)  # sent before the update, arrived after it
    assert ledger.pending("a") == 0
    ledger.report("a", 6, 4)  # trained while the update was in flight
    assert close(ledger, policy, 5) == []
    assert ledger.pending("a") == 4


def test_a_peer_that_joins_again_or_leaves_forfeits_what_it_did_not_deliver() -> None:
    """A restarted process starts from nothing: what its old self reported is lost even while its
    round is open; what the new one reports for the same round counts apart. Its old update in
    that round does not hide the new one's steps (it cannot deliver them)."""
    ledger, policy = Ledger(), BarrierPolicy(**LIVENESS, round_=2)
    ledger.acknowledged("a", 2, 10)
    ledger.report("b", 2, 30)
    assert ledger.forfeit("a") is None
    loss = ledger.forfeit("b")
    assert loss == Loss(2, "b", 30)
    ledger.forfeited("b", loss)
    ledger.forfeited("a", None)
    ledger.report("a", 2, 5)  # a's new process, from the same version
    ledger.report("b", 2, 12)
    assert close(ledger, policy, 2) == [Loss(2, "a", 5), Loss(2, "b", 12)]
    assert ledger.accounts["b"].lost == 42 and ledger.accounts["a"].acknowledged == 10
    assert ledger.forfeit("b") is None


def test_async_reports_are_lost_once_over_max_staleness() -> None:
    """In async runs an update from an older base still goes in: lost only when it may not."""
    ledger = Ledger()
    policy = AsyncPolicy(**LIVENESS, round_samples=100, max_staleness=2, round_=10)
    ledger.report("a", 10, 50)
    for round_ in (10, 11):
        assert close(ledger, policy, round_) == []
    assert close(ledger, policy, 12) == [Loss(10, "a", 50)]  # round 13 would take it 3 versions old


def test_place_in_a_later_round() -> None:
    policy = BarrierPolicy(**LIVENESS, round_=4)
    assert [policy.place(b, 5) for b in (4, 5, 6)] == [Place.CLOSED, Place.OPEN, Place.AHEAD]
    assert policy.place(4) is Place.OPEN, "the open round by default"


# ---- end to end --------------------------------------------------------------------------------


def ledger(hub: Hub, run: str) -> dict[str, object]:
    return status(hub, run)["ledger"]  # type: ignore[no-any-return]


def peer_samples(hub: Hub, run: str) -> dict[str, tuple[int, int, int]]:
    peers = ledger(hub, run)["peers"]
    assert isinstance(peers, list)
    return {p["peer"]: (p["acknowledged"], p["lost"], p["pending"]) for p in peers}


def test_a_killed_peer_loses_what_it_reported_and_a_killed_hub_keeps_the_ledger(
    hub_factory: Callable[..., Hub], tmp_path: Path
) -> None:
    """a trains 10 samples and syncs; b reports 30 trained, then is SIGKILLed mid-interval: round 0
    closes with a, and b's 30 are lost for it. The hub SIGKILLed and restarted shows the same."""
    hub = hub_factory("--min-peers", "2")
    a = launch(hub.url, "ledger", "a", 1, 10, tmp_path, until_version=1)
    b = launch(hub.url, "ledger", "b", 2, 30, tmp_path, until_version=1, train_seconds=600)
    try:
        (tmp_path / "go_0").touch()
        wait_for(lambda: [e for e in events(tmp_path, "b") if e["event"] == "training"], "b trains", 120)
        wait_for(lambda: peer_samples(hub, "ledger").get("b", (0, 0, 0))[2] == 30, "b's report reached the hub", 120)
        sigkill(b)
        assert a.wait(120) == 0
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                sigkill(proc)
    before = ledger(hub, "ledger")
    assert peer_samples(hub, "ledger") == {"a": (10, 0, 0), "b": (0, 30, 0)}
    assert (before["acknowledged"], before["lost"], before["pending"]) == (10, 30, 0)
    assert before["losses"] == [{"round": 0, "peer": "b", "samples": 30}]
    assert "samples_lost run=ledger round=0 peer=b samples=30" in hub.log()
    metrics = HTTP.get(f"{hub.url}/metrics").text
    assert 'weightsync_samples_lost_total{run="ledger"} 30.0' in metrics

    hub.kill()
    hub.start()
    assert ledger(hub, "ledger") == before


def test_a_lossy_final_sync_and_its_flush_count_their_samples_once(hub_factory: Callable[..., Hub]) -> None:
    """int8: a final sync takes two rounds (the update, then its residual weighing as much): the
    ledger counts its samples once, after a hub restart too."""
    hub = hub_factory()
    client = SyncClient(hub.url, run="flush", peer="p", codec="int8", sync_every=5, preemption="off", timeout=10)
    model = tiny_bigram(0)
    try:
        client.join(model)
        perturb(model, seed=1, round_=0)
        client.sync(model, samples=10)
        perturb(model, seed=1, round_=1)
        client.sync(model, samples=7, final=True)
        assert client.version == 3, "the final sync and its flush round"
    finally:
        client.close()
    assert peer_samples(hub, "flush") == {"p": (17, 0, 0)}
    hub.kill()
    hub.start()
    assert peer_samples(hub, "flush") == {"p": (17, 0, 0)}
