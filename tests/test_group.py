"""Peers that are torch.distributed groups of 2 ranks under real torchrun, gloo on CPU.

After every round every rank of every peer (DDP, FSDP and Trainer groups in one run) holds
bit-identical weights, equal to the hub's version; a rank killed mid-run makes its group leave
the run, and the other peer carries on; a hub gone for good stops every rank.

A torchrun costs ~10 s of CPU before its first step (torch in three processes, transformers in
two) and seconds to exit: each scenario runs as few as it needs, with GPT-2 where its shapes are
the point (FSDP's sharding, the Trainer) and a plain-torch model where any model proves it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from syncclient import SyncClient, SyncError
from tests.conftest import REPO, Hub
from tests.harness import status, version_file, wait_for
from tests.models import tiny_gpt2

PEER = REPO / "tests" / "group_peer.py"


def torchrun(hub: Hub, run: str, peer: str, mode: str, rounds: int, out: Path, *more: str) -> subprocess.Popen[bytes]:
    """``torchrun --standalone --nproc-per-node 2 tests/group_peer.py ...``: one peer, two ranks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "WEIGHTSYNC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(PEER)]
    command += ["--hub", hub.url, "--job", run, "--peer", peer, "--mode", mode, "--rounds", str(rounds)]
    log = (out / f"{peer}.log").open("wb")
    return subprocess.Popen(
        [*command, "--out", str(out), *more],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )


def kill_all(proc: subprocess.Popen[bytes], out: Path, peer: str) -> None:
    """SIGKILL torchrun and the ranks it started (each in a session of its own, so by the pid
    files they wrote), so that no rank outlives a failed test."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pidfile in out.glob(f"{peer}-r*.pid"):
        pid = int(pidfile.read_text())
        with contextlib.suppress(OSError):
            if "group_peer.py" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)


def hub_digest(hub: Hub, run: str, version: int) -> str:
    """The sha-256 the peers write, of the hub's version file (the tied lm_head is not in it)."""
    h = hashlib.sha256()
    arrays = version_file(hub, run, version)
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(np.ascontiguousarray(arrays[name], "<f4").tobytes())
    return h.hexdigest()


def finish(procs: dict[str, subprocess.Popen[bytes]], out: Path) -> None:
    """Wait for every peer's torchrun to end well (its ranks' and the hub's logs if not)."""
    for peer, proc in procs.items():
        try:
            code: int | None = proc.wait(300)
        except subprocess.TimeoutExpired:
            code = None  # hung: say so with the logs below
        finally:
            kill_all(proc, out, peer)
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in out.glob("*.log"))
        assert code == 0, logs


SHAPES = {"a": "ddp", "b": "fsdp", "c": "trainer"}  # peer: how its two ranks train


def test_every_rank_of_every_peer_holds_the_hubs_version(hub_factory: Any, tmp_path: Path) -> None:
    """Three peers of three shapes in one run: DistributedDataParallel, FSDP (``fully_shard``:
    each rank holds a shard) and a Hugging Face Trainer (its own DDP, synced by SyncCallback)."""
    hub = hub_factory("--keep-versions", "100")
    rounds = 3
    # min_peers 3: the run seals once every shape has joined, so each round has all three
    procs = {
        peer: torchrun(hub, "shapes", peer, mode, rounds, tmp_path, "--min-peers", "3") for peer, mode in SHAPES.items()
    }
    finish(procs, tmp_path)
    state = status(hub, "shapes")
    assert state["version"] == rounds
    assert {p["peer"]: p["group_size"] for p in state["peers"]} == dict.fromkeys(SHAPES, 2)
    assert all(sorted(r["participants"]) == sorted(SHAPES) for r in state["rounds"])
    assert all(r["samples"] == len(SHAPES) * 2 * 4 * 2 for r in state["rounds"]), (
        "each update counts both ranks' samples"
    )
    for version in range(1, rounds + 1):
        expected = hub_digest(hub, "shapes", version)
        held = {f.name: f.read_text() for f in tmp_path.glob(f"*-r*-v{version}")}
        assert sorted(held) == sorted(f"{p}-r{r}-v{version}" for p in SHAPES for r in (0, 1)), held
        assert set(held.values()) == {expected}, f"version {version}: {held}"


def test_a_killed_rank_takes_its_group_out_and_the_other_peer_carries_on(hub_factory: Any, tmp_path: Path) -> None:
    hub = hub_factory("--lease-seconds", "30", "--keep-versions", "100")
    # Both started at once, min_peers 2: the run seals with both, so a's six rounds start with b
    # in them (and b waits for a at the rendezvous instead of burning CPU on rounds alone while
    # a's ranks start); a round needs fewer once a member left, so a goes on alone. A two-layer
    # model of plain torch: the property holds for any model, and a rank that does not import
    # transformers starts and exits seconds sooner.
    small = ("--min-peers", "2", "--model", "bigram")
    b = torchrun(hub, "kill", "b", "ddp", 1000, tmp_path, *small)
    a = torchrun(hub, "kill", "a", "ddp", 6, tmp_path, *small)
    wait_for(lambda: len(list(tmp_path.glob("a-r1-v*"))) >= 2, "a's ranks through two rounds with b", 240)
    os.kill(int((tmp_path / "b-r1.pid").read_text()), signal.SIGKILL)
    try:
        b.wait(120)  # torchrun stops b's rank 0 (SIGTERM), which leaves the run
    finally:
        kill_all(b, tmp_path, "b")
    assert b.returncode != 0
    finish({"a": a}, tmp_path)
    state = status(hub, "kill")
    peers = {p["peer"]: p["state"] for p in state["peers"]}
    assert peers["b"] == "left", peers  # it said goodbye: a stopped waiting at once, not after its lease
    assert state["version"] >= 6 and state["rounds"][-1]["participants"] == ["a"]
    assert sorted(state["rounds"][0]["participants"]) == ["a", "b"], state["rounds"][0]  # b was in the run
    last = state["version"]
    assert {f.read_text() for f in tmp_path.glob(f"a-r*-v{last}")} == {hub_digest(hub, "kill", last)}


def test_a_hub_gone_for_good_stops_every_rank_of_the_group(hub_factory: Any, tmp_path: Path) -> None:
    """Rank 0 gives up on the hub after its retries; the other rank hears so and raises too,
    rather than waiting forever in the next collective."""
    hub = hub_factory()
    # retries for 0.5 s (at least one: the first back-off is 0.5-1.5 s): the test waits them out,
    # and nothing needs them while the hub is up
    peer = torchrun(
        hub, "gone", "a", "ddp", 1000, tmp_path, "--min-peers", "1", "--retry-seconds", "0.5", "--model", "bigram"
    )
    wait_for(lambda: (tmp_path / "a-r1-v1").exists(), "a round on both ranks", 240)
    hub.kill()
    try:
        code = peer.wait(120)
    finally:
        kill_all(peer, tmp_path, "a")
    log = (tmp_path / "a.log").read_text(errors="replace")
    assert code != 0
    assert "HubUnreachable" in log, log[-3000:]
    assert "GroupError: rank 0 of this peer failed: HubUnreachable" in log, log[-3000:]


def test_collectives_return_once_gloo_let_go_of_their_tensors(tmp_path: Path) -> None:
    """PeerGroup's tell, flag, total and DDP scatter, 40 of each on 2 ranks: none returns while
    gloo's worker still holds a tensor it lent (tests/group_lend.py). *Was*: the worker let go a
    moment after the collective returned (right after a broadcast it still held the tensor in 2
    of 3 calls), and then freed what Python had dropped meanwhile, taking the GIL to do it: at a
    script's end, while the interpreter finalised, Python ended that thread inside a C++
    destructor and the rank aborted (SIGABRT, "terminate called without an active exception";
    a 2-rank FSDP script ending in a group call aborted in 7 of 10 loaded runs, 0 of 10 since).
    Others' collectives (the Trainer's) are waited for at exit: ``_quiesce`` must find the workers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "WEIGHTSYNC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*command, str(REPO / "tests" / "group_lend.py")], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the two ranks share one stdout: their lines may run together, so find each rank's, not lines
    found = re.findall(r"rank (\d+): (\d+) calls, still held after (\d+) of them", proc.stdout)
    assert sorted(found) == [(str(r), "160", "0") for r in (0, 1)], proc.stdout[-3000:]
    # the exit's wait for gloo's workers finds them by name (a rename in torch would make it a no-op);
    # found the same way (one rank's line can run into the other's, as the first line may)
    workers = re.findall(r"rank (\d+): gloo workers (\d+)", proc.stdout)
    assert sorted(workers) == [(str(r), "2") for r in (0, 1)], proc.stdout


def test_a_group_client_rejects_what_a_group_cannot_do(hub: Hub, tmp_path: Path) -> None:
    """Without torch.distributed there is no group to serve; in a group (here of one rank, in this
    process) syncs work as for one process, overlap is refused, and samples are the ranks' sum."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"torch\.distributed initialised"):
        SyncClient(hub.url, run="g", peer="p", group=object())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = tiny_gpt2(0)
        client = SyncClient(hub.url, run="g", peer="p", group=dist.group.WORLD)
        assert client.join(model).version == 0
        with pytest.raises(SyncError, match="not supported"):
            client.sync_async(model, samples=4)
        assert client.sync(model, samples=4).version == 1
        assert status(hub, "g")["rounds"][0]["samples"] == 4 and status(hub, "g")["peers"][0]["group_size"] == 1
        client.leave()
    finally:
        dist.destroy_process_group()


def test_a_group_follows_the_intervals_the_hub_picks(hub_factory: Any, tmp_path: Path) -> None:
    """``sync_every="auto"`` in a group: only the leader's client hears each interval, and every
    rank learns from it when a sync is due (else the ranks would part at the first sync)."""
    hub = hub_factory("--keep-versions", "100")
    procs = {"a": torchrun(hub, "auto", "a", "ddp", 6, tmp_path, "--min-peers", "1", "--model", "bigram", "--auto")}
    finish(procs, tmp_path)
    state = status(hub, "auto")
    assert state["version"] >= 3 and state["interval"]["every"] <= 4, state["interval"]
    for version in range(1, state["version"] + 1):
        held = {f.name: f.read_text() for f in tmp_path.glob(f"a-r*-v{version}")}
        assert sorted(held) == [f"a-r0-v{version}", f"a-r1-v{version}"], held
        assert set(held.values()) == {hub_digest(hub, "auto", version)}, f"version {version}: {held}"
