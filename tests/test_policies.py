"""The samples and async round policies end to end: real hubs, real SDK peers of unequal speed.

What each must keep of the barrier's invariants: in a samples run every peer ends every round
bit-identical to the hub's version, and each version is the exact sample-weighted mean of the
updates it took; in an async run every acknowledged update is applied exactly once, with its
staleness weight, and a peer's base after a sync is the hub's version bit for bit.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from syncclient import SyncClient, SyncError
from syncclient.weights import ModelView
from tests.conftest import Hub
from tests.harness import HTTP, perturb, run_peers, status, version_file, wait_for, weighted_mean64
from tests.models import tiny_gpt2

Arrays = dict[str, np.ndarray]
STEP = 20  # round_samples of the async runs: an outer step is two pushes of 10-12 samples


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One hub for every test here that does not kill it, each test on runs of its own: a hub
    start (~1-2 s on a busy 2-core VM) cost the bad-input tests more than their checks. It keeps
    every version, for the tests that check each one."""
    tmp = tmp_path_factory.mktemp("policies")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    shared = Hub(tmp / "hub", ["--keep-versions", "100"], env, tmp / "hub.log").start()
    yield shared
    shared.stop()


@pytest.fixture
def run(request: pytest.FixtureRequest) -> str:
    """A run name of this test's own (its parameters included), on the shared hub."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name.removeprefix("test_"))[:64].strip("-")


def export(model: torch.nn.Module) -> Arrays:
    return {k: v.copy() for k, v in ModelView(model).export().items()}


def assert_same(a: Arrays, b: Arrays) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


class Sent:
    """What the peers sent, by (peer, base version): the delta and its samples."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.updates: dict[tuple[str, int], tuple[Arrays, int]] = {}
        self.bases: list[tuple[str, int, Arrays]] = []  # (peer, version, base after the sync)

    def add(self, peer: str, base: int, delta: Arrays, samples: int) -> None:
        with self.lock:
            self.updates[peer, base] = (delta, samples)


def test_samples_rounds_close_on_the_global_count_and_every_peer_stays_identical(hub: Hub) -> None:
    """Three peers, one four times slower, each reporting 4 samples per step; a round is 48
    samples. The fast peers send more samples per round than the slow one, every round is the
    exact weighted mean of what was sent, and all peers hold the hub's version after it."""
    rounds, sent = 3, Sent()
    names, delays = ["fast-a", "fast-b", "slow"], [0.01, 0.01, 0.04]
    after: dict[str, dict[int, Arrays]] = {n: {} for n in names}

    def peer(i: int) -> None:
        name, model = names[i], tiny_gpt2(seed=0)
        client = SyncClient(hub.url, run="smp", peer=name, round_samples=48, min_peers=3, retry_seconds=60)
        client.join(model)
        base, steps = export(model), 0
        while client.version < rounds:
            perturb(model, seed=i, round_=steps, scale=0.001)
            steps += 1
            time.sleep(delays[i])  # a slower GPU
            client.progress(4)
            if client.due:
                version, samples = client.version, client.pending_samples
                delta = {k: v - base[k] for k, v in export(model).items()}
                result = client.sync(model, samples=samples)
                assert not result.caught_up
                sent.add(name, version, delta, samples)
                base = export(model)
                after[name][result.version] = base
        client.leave()

    run_peers(3, peer, timeout=240)
    records = {r["round"]: r for r in status(hub, "smp")["rounds"]}
    shares = {n: 0 for n in names}
    for r in range(rounds):
        record = records[r]
        assert record["samples"] >= 48, record  # due only once the target was reached
        deltas = [sent.updates[p, r][0] for p in record["participants"]]
        samples = [sent.updates[p, r][1] for p in record["participants"]]
        assert sum(samples) == record["samples"]
        for p, n in zip(record["participants"], samples, strict=True):
            shares[p] += n
        before, version = version_file(hub, "smp", r), version_file(hub, "smp", r + 1)
        expected = weighted_mean64(deltas, samples)
        for name, mean in expected.items():
            got = version[name].astype(np.float64) - before[name].astype(np.float64)
            np.testing.assert_allclose(got, mean, rtol=0, atol=1e-6, err_msg=name)
        for p in names:  # every peer that synced to this version holds it bit for bit
            if r + 1 in after[p]:
                assert_same(after[p][r + 1], version)
    assert shares["fast-a"] > shares["slow"] and shares["fast-b"] > shares["slow"], shares


def test_step_syncs_when_the_round_is_due(hub: Hub) -> None:
    """``client.step`` counts and syncs when due: one peer alone makes every round due itself; in
    a barrier run every ``sync_every`` steps, and not at all without it."""
    model = tiny_gpt2(seed=1)
    with SyncClient(hub.url, run="step", peer="solo", round_samples=10) as client:
        client.join(model)
        assert client.policy == "samples" and not client.due
        results = []
        while len(results) < 2:
            perturb(model, seed=1, round_=len(results), scale=0.001)
            result = client.step(model, samples=3)
            if result is not None:
                results.append(result)
        assert [r.version for r in results] == [1, 2]
        assert_same(export(model), version_file(hub, "step", 2))
    with SyncClient(hub.url, run="barrier-run", peer="b") as client:
        client.join(tiny_gpt2(seed=1))
        with pytest.raises(SyncError, match="close on samples"):
            client.step(model, samples=1)
    with SyncClient(hub.url, run="every-2", peer="c", sync_every=2) as client:  # the same clock, by steps
        client.join(model)
        synced = [client.step(model, samples=3) for _ in range(5)]
        assert [r.version if r else None for r in synced] == [None, 1, None, 2, None]
        assert client.clock.next == 6 and client.pending_samples == 3


def async_peers(hub: Hub, run: str, sent: Sent, pushes: int, delays: list[float], **client: Any) -> None:
    """``len(delays)`` async peers, each pushing ``pushes`` updates (``delays[i]`` seconds of
    "training" before each) and recording what it sent and the base it got back."""

    def peer(i: int) -> None:
        name, model = f"p{i}", tiny_gpt2(seed=0)
        options = {"policy": "async", "round_samples": STEP, "min_peers": len(delays), "retry_seconds": 120, **client}
        sdk = SyncClient(hub.url, run=run, peer=name, **options)
        sdk.join(model)
        base = export(model)
        for k in range(pushes):
            perturb(model, seed=i, round_=k, scale=0.001)
            time.sleep(delays[i])
            version, delta = sdk.version, {n: v - base[n] for n, v in export(model).items()}
            result = sdk.sync(model, samples=10 + i)
            assert not result.caught_up
            sent.add(name, version, delta, 10 + i)
            base = export(model)
            with sent.lock:
                sent.bases.append((name, result.version, base))
        sdk.leave()

    run_peers(len(delays), peer, timeout=300)


def assert_async_exact(hub: Hub, run: str, sent: Sent) -> None:
    """Every update the peers sent is in exactly one version; each version is the previous one
    plus its updates' deltas times ``samples * (1 + late) ** -0.5 / max(STEP, samples)``, with
    ``late = max(0, staleness * samples / STEP - 1)``; each base a peer got back is the hub's
    version bit for bit."""
    state = status(hub, run)
    assert state["config"]["policy"] == "async"
    updates = state["updates"]
    assert sorted((u["peer"], u["base"]) for u in updates) == sorted(sent.updates)  # each once, none lost
    by_round: dict[int, list[dict[str, Any]]] = {}
    for u in updates:
        by_round.setdefault(u["round"], []).append(u)
    assert state["version"] == len(by_round) == max(by_round) + 1
    assert any((u["round"] - u["base"]) * u["samples"] > STEP for u in updates), "nothing was late: not an async test"
    for r, members in by_round.items():
        before, after = version_file(hub, run, r), version_file(hub, run, r + 1)
        total = max(STEP, sum(u["samples"] for u in members))
        for name in before:
            expected = sum(
                sent.updates[u["peer"], u["base"]][0][name].astype(np.float64)
                * u["samples"]
                * (1 + max(0.0, (r - u["base"]) * u["samples"] / STEP - 1)) ** -0.5
                for u in members
            )
            got = after[name].astype(np.float64) - before[name].astype(np.float64)
            np.testing.assert_allclose(got, expected / total, rtol=0, atol=1e-6, err_msg=f"round {r} {name}")
    for _, version, base in sent.bases:
        assert_same(base, version_file(hub, run, version))


def test_async_applies_every_update_once_with_its_staleness_weight(hub: Hub) -> None:
    """Three async peers push at their own pace: each update lands in exactly one version, with
    its staleness weight, and a peer's base after a sync is the hub's version."""
    sent = Sent()
    async_peers(hub, "async", sent, pushes=4, delays=[0.0, 0.05, 0.15])
    assert_async_exact(hub, "async", sent)


def test_async_survives_sigkills_of_the_hub(hub_factory: Any) -> None:
    """The hub is SIGKILLed three times while three async peers push, and restarted on its data
    dir: every acknowledged update is applied exactly once (none lost, none twice), exactly."""
    hub = hub_factory("--keep-versions", "100")
    sent = Sent()
    pushing = threading.Thread(target=async_peers, args=(hub, "crash", sent, 6, [0.0, 0.05, 0.1]), daemon=True)
    pushing.start()
    for kill in range(3):
        wait_for(lambda k=kill: len(sent.updates) >= 3 * (k + 1), f"pushes before kill {kill + 1}", 120)
        hub.kill()
        hub.start()
    pushing.join(300)
    assert not pushing.is_alive()
    assert len(sent.updates) == 18
    assert_async_exact(hub, "crash", sent)


def test_async_refuses_an_update_older_than_max_staleness(hub: Hub) -> None:
    """An update whose base is more than ``max_staleness`` versions old gets 409 stale_update;
    the SDK then catches up to the latest version."""
    fast_model, slow_model = tiny_gpt2(seed=0), tiny_gpt2(seed=0)
    options: dict[str, Any] = {"policy": "async", "round_samples": 10, "max_staleness": 1, "min_peers": 2}
    fast = SyncClient(hub.url, run="stale", peer="fast", **options)
    slow = SyncClient(hub.url, run="stale", peer="slow", **options)
    run_peers(2, lambda i: (fast, slow)[i].join((fast_model, slow_model)[i]))
    for k in range(2):  # version 2: slow's base (0) is now 2 versions old
        perturb(fast_model, seed=1, round_=k)
        fast.sync(fast_model, samples=5)
    perturb(slow_model, seed=2, round_=0)
    result = slow.sync(slow_model, samples=5)
    assert result.caught_up and result.version == 2
    assert_same(export(slow_model), version_file(hub, "stale", 2))
    assert [u["peer"] for u in status(hub, "stale")["updates"]] == ["fast", "fast"]  # nothing of slow's
    fast.close()
    slow.close()


# ---- bad input ----------------------------------------------------------------------------------


def started_run(hub: Hub, run: str, **config: Any) -> httpx.Client:
    """A run with one peer ``a`` that has uploaded version 0 (through the SDK) and stays a member,
    its SDK closed (so that the test's own reports are the only ones)."""
    client = SyncClient(hub.url, run=run, peer="a", **config)
    client.join(tiny_gpt2(seed=0))
    client.close()
    return httpx.Client(base_url=f"{hub.url}/v1/runs/{run}", timeout=30)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"round": 0, "samples": -1}, "greater than or equal to 0"),
        ({"round": 0, "samples": 1.5}, "valid integer"),
        ({"round": 0, "samples": "12"}, "valid integer"),
        ({"round": 0, "samples": 2**60}, "less than or equal to"),
        ({"round": -1, "samples": 3}, "greater than or equal to 0"),
        ({"samples": 3}, "Field required"),
    ],
)
def test_a_bad_progress_report_is_refused(hub: Hub, run: str, body: dict[str, Any], reason: str) -> None:
    api = started_run(hub, run, round_samples=100)
    before = status(hub, run)
    r = api.post("/peers/a/progress", json=body)
    assert r.status_code == 422 and reason in r.text, r.text
    assert status(hub, run)["open_round"] == before["open_round"]


def test_a_progress_report_for_another_round_is_refused(hub: Hub) -> None:
    api = started_run(hub, "other-round", round_samples=100)
    r = api.post("/peers/a/progress", json={"round": 5, "samples": 3})
    assert r.status_code == 409 and r.json()["error"] == "conflict" and "not open" in r.json()["detail"]
    good = api.post("/peers/a/progress", json={"round": 0, "samples": 30}).json()
    assert good == {"round": 0, "version": 0, "due": False, "samples": 30, "target": 100}
    assert api.post("/peers/nobody/progress", json={"round": 0, "samples": 3}).status_code == 404


def test_a_progress_report_for_a_closed_round_says_round_closed(hub: Hub) -> None:
    model = tiny_gpt2(seed=0)
    client = SyncClient(hub.url, run="closed", peer="a", round_samples=8)
    client.join(model)
    client.sync(model, samples=8)
    r = HTTP.post(f"{hub.url}/v1/runs/closed/peers/a/progress", json={"round": 0, "samples": 3})
    assert r.status_code == 409 and r.json()["error"] == "round_closed" and r.json()["current_version"] == 1
    client.close()


@pytest.mark.parametrize(
    ("config", "status_code", "reason"),
    [
        ({"policy": "samples"}, 422, "needs round_samples"),
        ({"policy": "async"}, 422, "needs round_samples"),
        ({"policy": "barrier", "round_samples": 10}, 422, "round_samples goes with"),
        ({"policy": "gossip", "round_samples": 10}, 422, "barrier"),
        ({"round_samples": 0}, 422, "greater than or equal to 1"),
        ({"round_samples": 2.5}, 422, "valid integer"),
        ({"max_staleness": -1}, 422, "greater than or equal to 0"),
    ],
)
def test_a_bad_policy_config_is_refused(
    hub: Hub, run: str, config: dict[str, Any], status_code: int, reason: str
) -> None:
    r = HTTP.post(f"{hub.url}/v1/runs/{run}/peers", json={"peer": "a", **config})
    assert r.status_code == status_code and reason in r.text, r.text
    assert run not in {r["run"] for r in HTTP.get(f"{hub.url}/v1/runs").json()}  # no run was created
    assert HTTP.get(f"{hub.url}/v1/runs/{run}").status_code == 404


def test_a_peer_asking_for_another_policy_is_refused(hub: Hub) -> None:
    started_run(hub, "policy-clash", round_samples=100)
    r = HTTP.post(f"{hub.url}/v1/runs/policy-clash/peers", json={"peer": "b", "policy": "async"})
    assert r.status_code == 409 and "policy" in r.json()["detail"]
    r = HTTP.post(f"{hub.url}/v1/runs/policy-clash/peers", json={"peer": "b", "round_samples": 99})
    assert r.status_code == 409 and "round_samples" in r.json()["detail"]


def test_status_shows_the_samples_so_far_and_when_a_round_is_due(hub: Hub) -> None:
    api = started_run(hub, "show", round_samples=100, min_peers=1)
    api.post("/peers/a/progress", json={"round": 0, "samples": 60})
    state = status(hub, "show")
    assert state["open_round"]["samples"] == 60 and state["open_round"]["due"] is False
    answer = api.post("/peers/a/progress", json={"round": 0, "samples": 100}, params={"wait": 5}).json()
    assert answer["due"] is True
    wait_for(lambda: status(hub, "show")["open_round"]["due"], "the round shown as due")
