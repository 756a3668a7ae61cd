"""The hub SIGKILLed (a real process, no shutdown handler runs) and restarted on its data dir.

Properties: no acknowledged update is lost, no version is corrupt, and the run ends with the
weights of the same run without the crash. Peers are in-process SyncClients (it is the hub
that dies here); they ride through the outage on their retries.

Why the results can be bit-identical: the hub folds updates into a float32 accumulator in
acknowledgement order and, after a restart, re-folds the acknowledged files in that same
order. With two updates ``0 + x + y == 0 + y + x`` exactly; a third one always comes last
in the first test. In the multi-round test three peers race, so two runs may acknowledge in
different orders and float32 sums differ in the last bits: there the runs agree within 1e-6,
while within each run every peer and the hub hold bit-identical weights.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy
import torch

from syncclient.weights import ModelView
from tests.conftest import Hub
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, Peers, assert_exact_mean, result_file, round_record, version_file, wait_for

SAMPLES = {"a": 10, "b": 30, "c": 20}
SEEDS = {"a": 1, "b": 2, "c": 3}


def open_round(hub: Hub, run: str) -> dict[str, Any] | None:
    """The hub's view of the open round, or None while it is down."""
    try:
        r = HTTP.get(f"{hub.url}/v1/runs/{run}", timeout=2)
    except httpx.TransportError:
        return None
    body = r.json()
    return {"version": body["version"], **body["open_round"]}


def two_then_one(hub: Hub, crash: bool, run: str = "crash") -> Peers:
    """a and b submit; (the hub is SIGKILLed and restarted;) c submits; round 0 closes."""
    peers = Peers(hub.url, run, ["a", "b", "c"], min_peers=3, retry_seconds=120)
    peers.join()
    for p in "ab":
        peers.start(p, lambda p=p: peers.sync(p, samples=SAMPLES[p], seed=SEEDS[p]))
    wait_for(lambda: (open_round(hub, run) or {}).get("submitted") == ["a", "b"], "a and b acked", 30)
    if crash:
        hub.kill()
        hub.start()
        state = open_round(hub, run)  # both acknowledged updates survived the crash
        assert state is not None and state["version"] == 0 and state["submitted"] == ["a", "b"]
    peers.start("c", lambda: peers.sync("c", samples=SAMPLES["c"], seed=SEEDS["c"]))
    peers.wait(120)
    peers.close()
    return peers


def test_hub_killed_after_two_of_three_submitted(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--round-timeout", "60")
    crashed = two_then_one(hub, crash=True)
    calm = two_then_one(hub, crash=False, run="calm")  # the same run without the crash, after it

    record = round_record(hub, "crash", 0)
    assert sorted(record["participants"][:2]) == ["a", "b"] and record["participants"][2] == "c"  # ack order
    assert record["samples"] == 60
    assert_exact_mean(hub, "crash", 0, [crashed.deltas[p, 0] for p in "abc"], [10, 30, 20])
    after_crash, without_crash = version_file(hub, "crash", 1), version_file(hub, "calm", 1)
    for name, value in without_crash.items():
        np.testing.assert_array_equal(after_crash[name], value, err_msg=name)  # bit-identical
    for p in "abc":
        for name, value in ModelView(crashed.models[p]).export().items():
            np.testing.assert_array_equal(value, without_crash[name], err_msg=f"{p}: {name}")
        assert not crashed.results[p].caught_up and not calm.results[p].caught_up


def test_a_peer_called_result_loses_nothing_in_the_window_before_a_commit(hub_factory: Callable[..., Hub]) -> None:
    """Peer names are not the hub's file names. A peer called ``result`` *was* stored at the
    path of its round's result, so a hub killed after the merge's rename and before the commit
    came back with the merge where that peer's acknowledged update had been.

    That window is a few milliseconds wide, so the test builds the state it leaves: the hub is
    SIGKILLed with a and ``result`` acknowledged, and a whole merge output (a file of the run's
    wire layout) is put where the merge writes round 0's result; then c submits."""
    hub = hub_factory("--round-timeout", "60")
    peers = Peers(hub.url, "named", ["a", "result", "c"], min_peers=3, retry_seconds=120)
    peers.join()
    samples = {"a": 10, "result": 30, "c": 20}
    for i, p in enumerate(["a", "result"]):
        peers.start(p, lambda p=p, i=i: peers.sync(p, samples=samples[p], seed=i + 1))
    wait_for(lambda: (open_round(hub, "named") or {}).get("submitted") == ["a", "result"], "a and result acked", 30)
    hub.kill()
    merged = {k: (v * 1000).astype(np.float32) for k, v in peers.deltas["a", 0].items()}
    safetensors.numpy.save_file(merged, str(result_file(hub, "named", 0)))  # uncommitted: the crash came first
    hub.start()
    state = open_round(hub, "named")
    assert state is not None and state["version"] == 0 and state["submitted"] == ["a", "result"]
    peers.start("c", lambda: peers.sync("c", samples=samples["c"], seed=3))
    peers.wait(120)
    peers.close()
    participants = round_record(hub, "named", 0)["participants"]  # in acknowledgement order
    assert sorted(participants[:2]) == ["a", "result"] and participants[2] == "c"
    assert_exact_mean(hub, "named", 0, [peers.deltas[p, 0] for p in samples], list(samples.values()))


# ---- SIGKILL at random points of a multi-round run ------------------------------------------

ROUNDS = 5
PHASES = ["upload", "merge", "version", "download", "anywhere"]


def mlp() -> torch.nn.Module:
    """16 MB of float32: merging takes long enough to be caught in the act."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))


def multi_round(hub: Hub, run: str, plan: list[str] | None, rng: random.Random) -> tuple[Peers, list[str]]:
    """3 peers through a proxy, ROUNDS rounds; with a ``plan``, the hub is SIGKILLed once per
    round in the planned phase and restarted at once. Returns the peers and what was hit."""
    hit: list[str] = []
    with FaultProxy(hub.port) as proxy:
        peers = Peers(proxy.url, run, list(SAMPLES), model=mlp, min_peers=3, retry_seconds=120, timeout=20)
        peers.join()

        # round r starts only once the test is watching for its phase: rounds of 16 MB take a
        # fraction of a second, and free-running peers would finish before the plan does
        gates = [threading.Event() for _ in range(ROUNDS)]

        def train(p: str) -> None:
            for gate in gates:
                assert gate.wait(120), "the test never opened this round"
                peers.sync(p, samples=SAMPLES[p], seed=SEEDS[p])

        for p in SAMPLES:
            peers.start(p, lambda p=p: train(p))
        if plan is None:
            for gate in gates:
                gate.set()
        for round_, phase in enumerate(plan or []):
            wait_for(lambda r=round_: (open_round(hub, run) or {}).get("version", -1) >= r, f"round {round_}", 60)
            hit.append(kill_during(hub, proxy, run, round_, phase, rng, go=gates[round_].set))
            proxy.throttle(None)
            hub.start()
        peers.wait(180)
        peers.close()
    return peers, hit


def kill_during(
    hub: Hub, proxy: FaultProxy, run: str, round_: int, phase: str, rng: random.Random, go: Callable[[], None]
) -> str:
    """SIGKILL the hub during ``phase`` of round ``round_`` (``go`` lets its peers start it, once
    the watch is armed); say what was going on at that moment."""
    versions = hub.data_dir / "runs" / run / "versions"
    rounds = hub.data_dir / "runs" / run / "rounds"
    result = f"/rounds/{round_}/result"
    if phase in ("upload", "download"):  # the bytes crawl through the proxy: kill while they stream
        proxy.throttle(4_000_000, match="/updates/" if phase == "upload" else result)
    go()
    if phase == "upload":
        wait_for(lambda: bool((open_round(hub, run) or {}).get("uploading")), "an upload", 30)
        time.sleep(rng.uniform(0.0, 1.0))
        what = f"upload ({sorted(open_round(hub, run)['uploading'])} streaming)"
    elif phase == "merge":  # round v's result is being written, before the commit
        wait_for(
            lambda: any(n.startswith(".result") for r in _listdir(rounds) for n in _listdir(rounds / r)), "a merge", 60
        )
        what = "merge (result file half-written)"
    elif phase == "version":  # round v committed; version v+1's file is being written after it
        wait_for(lambda: any(n.endswith(".tmp") for n in _listdir(versions)), "a version", 60)
        what = "version (round committed, version file half-written)"
    elif phase == "download":  # the round's result crawls back to the peers
        wait_for(lambda: any(r.response_bytes > 1 << 20 for r in proxy.matching(result)), "a download", 60)
        time.sleep(rng.uniform(0.0, 1.0))
        what = "download (result streaming)"
    else:
        time.sleep(rng.uniform(0.0, 0.5))  # a round here takes about that long
        what = f"anywhere ({open_round(hub, run)})"
    hub.kill()
    return what


def _listdir(path: Path) -> list[str]:
    try:
        return [entry.name for entry in path.iterdir()]
    except FileNotFoundError:
        return []


def test_a_version_lost_after_its_commit_is_rebuilt_bit_for_bit(hub_factory: Callable[..., Hub]) -> None:
    """Version v+1's file is written after round v commits (the peers need only the result), so
    a crash may leave a committed version without its file: the restarted hub rebuilds it from
    version v and round v's durable result, bit for bit, before it serves the model."""
    hub = hub_factory()
    peers = two_then_one(hub, crash=False)
    expected = version_file(hub, "crash", 1)
    path = hub.data_dir / "runs" / "crash" / "versions" / f"{1:08d}.safetensors"
    hub.kill()
    path.unlink()  # as if killed before the rename (the tmp file goes at start)
    hub.start()
    rebuilt = version_file(hub, "crash", 1)
    assert rebuilt.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(rebuilt[name], value, err_msg=name)
    for p, model in peers.models.items():  # and it is what every peer holds
        for name, value in ModelView(model).export().items():
            np.testing.assert_array_equal(value, rebuilt[name], err_msg=f"{p}: {name}")
    assert "run_recovered run=crash version=1" in hub.log()


@pytest.mark.slow
def test_hub_killed_at_random_points_of_a_multi_round_run(hub_factory: Callable[..., Hub]) -> None:
    rng = random.Random(20240611)
    plan = rng.sample(PHASES, len(PHASES))
    hub = hub_factory("--round-timeout", "60", env={"SYNC_KEEP_VERSIONS": "10"})
    crashed, hit = multi_round(hub, "multi", plan, rng)
    print("\nhub SIGKILLed during:", *hit, sep="\n  ")
    assert [h.split()[0] for h in hit] == plan
    multi_round(hub, "calm", None, rng)  # the same run without crashes, after them

    for round_ in range(ROUNDS):
        # no acknowledged update lost, none counted twice, every version whole and exact
        record = round_record(hub, "multi", round_)
        assert sorted(record["participants"]) == ["a", "b", "c"] and record["samples"] == 60
        deltas = [crashed.deltas[p, round_] for p in SAMPLES]
        assert_exact_mean(hub, "multi", round_, deltas, list(SAMPLES.values()))
    final, reference = version_file(hub, "multi", ROUNDS), version_file(hub, "calm", ROUNDS)
    identical = all(np.array_equal(final[n], reference[n]) for n in final)
    print(f"final weights {'bit-identical to' if identical else 'within 1e-6 of'} the run without crashes")
    for name, value in reference.items():
        np.testing.assert_allclose(final[name], value, rtol=0, atol=1e-6, err_msg=name)
    for p, model in crashed.models.items():  # within the crashed run: all bit-identical to the hub
        for name, value in ModelView(model).export().items():
            np.testing.assert_array_equal(value, final[name], err_msg=f"{p}: {name}")
    assert all(not r.caught_up for r in crashed.results.values())
