"""The benchmarks still run end to end and write the rows their tables are made of.

A tiny model and 2 peers: seconds, not minutes. The numbers are not checked (they mean
nothing at this size); that every row, baseline and target is there, with sane bytes, is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, needs_data
from tests.harness import wait_for


def run_bench(script: str, out: Path, *args: str, timeout: float = 240) -> tuple[str, dict[str, Any]]:
    """Run ``bench/<script>.py`` with ``args`` and ``--out out``; its stdout and the one JSON it wrote."""
    command = [sys.executable, str(REPO / "bench" / f"{script}.py"), *args, "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob(f"{script}-*.json")
    return proc.stdout, json.loads(path.read_text())


def test_round_benchmark_runs_and_writes_every_row(tmp_path: Path) -> None:
    # --go-delay 0.05: the peers get a tiny model's commands in ms (each timed phase waited 0.5 s for them)
    args = ["--model", "tiny", "--peers", "2", "--codecs", "fp32", "int8", "--rounds", "1", "--gloo-reps", "1",
            "--go-delay", "0.05"]  # fmt: skip
    stdout, result = run_bench("round", tmp_path / "results", *args)
    assert result["model"]["kind"] == "tiny" and result["model"]["fp32_bytes"] > 0
    rows = {(r["peers"], r["codec"]): r for r in result["rows"]}
    assert set(rows) == {(2, "fp32"), (2, "int8")}
    fp32, int8 = rows[2, "fp32"], rows[2, "int8"]
    for row in (fp32, int8):
        assert row["round_s"] > 0 and row["limit_s"] > 0 and row["hub_peak_rss"] > 0
        assert row["bytes_up"] == row["limit_bytes_up"], "the limit moves the same bytes as the round"
        assert row["hub_cpu_s"] > 0 and row["limit_cpu_s"] >= 0, "the hub's own CPU-s, beside the relay limit's"
    assert fp32["bytes_up"] >= result["model"]["fp32_bytes"]
    assert int8["bytes_up"] < fp32["bytes_up"] and int8["bytes_down"] < fp32["bytes_down"]
    baseline = result["baselines"]["2"]
    assert baseline["gloo_s"] > 0 and baseline["origin_s"] > 0 and baseline["origin_cpu_s"] >= 0
    assert baseline["origin_bytes_up"] > fp32["bytes_up"], "the origin sends the GPT-2 tie twice"
    targets = {t["target"] for t in result["targets"]}
    assert any(t.startswith("fp32, 2 peers: origin") for t in targets)
    assert "| 2 | fp32 |" in result["table"] and "| 2 | int8 |" in result["table"]
    assert result["table"] in stdout


def test_peer_benchmark_times_every_phase_both_ways(tmp_path: Path) -> None:
    _, result = run_bench("peer", tmp_path / "results", "--model", "tiny", "--codecs", "fp32", "int8", "--reps", "1")
    cases = {(r["codec"], r["case"].split(",")[0].split(":")[0]) for r in result["rows"]}
    assert cases == {(c, p) for c in ("fp32", "int8") for p in ("encode", "digest", "download + fold")}
    assert len(result["rows"]) == 2 * 5  # encode on 1 thread and on the pool; fold after and while
    assert all(r["wall_best"] > 0 and r["cpu_best"] >= 0 for r in result["rows"])


def test_hostwork_benchmark_times_snapshot_apply_and_the_copy(tmp_path: Path) -> None:
    _, result = run_bench("hostwork", tmp_path / "results", "--quick")
    assert [r["codec"] for r in result["rows"]] == ["fp32", "int8"]
    assert result["baselines"]["copy"] > 0 and result["baselines"]["add"] > 0
    for row in result["rows"]:
        assert all(row[k] > 0 for k in ("snapshot", "apply", "host", "blocking", "ratio"))
    assert [t["target"] for t in result["targets"]] == [f"{c}: snapshot + apply / plain copy" for c in ("fp32", "int8")]


def test_hub_benchmark_times_receive_fold_merge_and_version(tmp_path: Path) -> None:
    _, result = run_bench("hub", tmp_path / "results", "--model", "tiny", "--codecs", "fp32", "int8", "--reps", "2")
    assert [r["codec"] for r in result["rows"]] == ["fp32", "int8"]
    for row in result["rows"]:
        assert all(row[p] > 0 and row[p + "_median"] >= row[p] for p in ("receive", "fold", "merge", "version"))


def test_reducers_benchmark_closes_every_k_to_the_same_bits(tmp_path: Path) -> None:
    args = ["--model", "tiny", "--codecs", "int8", "--reducers", "0", "2", "--rounds", "2"]
    stdout, result = run_bench("reducers", tmp_path / "results", *args)
    rows = {r["reducers"]: r for r in result["rows"]}
    assert set(rows) == {0, 2} and all(r["close"] > 0 and len(r["closes"]) == 2 for r in rows.values())
    assert rows[0]["model_sha256"] == rows[2]["model_sha256"] and not rows[0]["leases"]
    assert sum(r["leases"] for r in rows[2]["leases"].values()) >= 2
    assert "same bits as K=0" in stdout


def test_pagecache_benchmark_times_every_mode(tmp_path: Path) -> None:
    # --settle 0: no wait for writeback between modes (4 of the run's 5 s); the rates mean nothing here.
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pagecache.py"), "--dir", str(tmp_path), "--mb", "8", "--reps", "1",
         "--settle", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith(("| yes", "| no"))]
    assert {(w.strip(), f.strip()) for w, f, *_ in rows} == {("no", "no"), ("yes", "no"), ("no", "yes"), ("yes", "yes")}
    assert all(float(r[4]) > 0 for r in rows), "every mode wrote at a positive rate"
    assert list(tmp_path.iterdir()) == [], "the test file is removed"


def test_starve_benchmark_runs_and_writes_its_figures(tmp_path: Path) -> None:
    """bench/starve.py with a small big run: the attack gets going, every figure is written."""
    args = ["--tensors", "2000", "--rounds", "1", "--phases", "1", "--honest-mb", "0.5"]
    stdout, result = run_bench("starve", tmp_path / "results", *args)
    assert len(result["alone"]) == len(result["attacked"]) == 1 and result["ratio"] > 0
    statuses = result["attack"]["statuses"]
    assert set(statuses) == {"head", "put", "status", "start"}
    assert all(int(code) < 500 for counts in statuses.values() for code in counts), statuses
    assert "attacked / alone" in stdout


@needs_data
def test_unequal_benchmark_runs_every_policy(tmp_path: Path) -> None:
    """bench/unequal.py --quick: every policy trains to the same budget and is evaluated."""
    args = ["--quick", "--peers", "2", "--scenarios", "slow"]
    stdout, result = run_bench("unequal", tmp_path / "results", *args, timeout=400)
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"barrier", "samples", "async"}
    budget = result["settings"]["budget"]
    for row in rows.values():
        assert row["curve"] and row["final_val_ppl"] > 1 and row["wall"] > 0
        assert row["curve"][-1]["version"] == row["version"], "the final perplexity is the last version's"
        assert sum(p["samples"] for p in row["peers"]) >= budget
        assert row["bytes_up"] > 0 and row["bytes_down"] > 0
    slow = [p for p in rows["samples"]["peers"] if p["slow"]]
    assert len(slow) == 1 and all(p["steps"] > slow[0]["steps"] for p in rows["samples"]["peers"] if not p["slow"])
    assert "| slow | samples |" in stdout


def test_group_benchmark_times_every_peer_shape(tmp_path: Path) -> None:
    """bench/group.py: 1 rank, 2 ranks DDP, 2 ranks FSDP, each rank checked against the hub."""
    cmd = [
        sys.executable,
        str(REPO / "bench" / "group.py"),
        "--model",
        "tiny",
        "--syncs",
        "1",
        "--warmup",
        "0",
        "--results",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(next(tmp_path.glob("group-*.json")).read_text())
    assert [(r["mode"], r["ranks"]) for r in record["rows"]] == [("plain", 1), ("ddp", 2), ("fsdp", 2)]
    assert all(len(r["sync_s"]) == 1 and r["sync_s"][0] > 0 for r in record["rows"])
    assert len(record["rows"][1]["broadcast_s"]) == 1


def test_lease_benchmark_measures_a_peer_s_lease_age(tmp_path: Path) -> None:
    """bench/lease.py for half a second of the idle load: a hub, a peer, the ages of its lease."""
    out, data = run_bench("lease", tmp_path, "--loads", "idle", "--seconds", "0.5", "--lease", "3", timeout=120)
    (row,) = data["rows"]
    assert row["load"] == "idle" and row["samples"] > 0 and row["false_gone"] == 0
    assert 0 <= row["max_age_s"] < 3 and row["margin_s"] > 0
    assert "| idle | 3 | 1 |" in out


def test_hooks_benchmark_times_hooked_and_plain_steps(tmp_path: Path) -> None:
    """bench/hooks.py with a few steps: both processes run, the hooked one synced, every ratio is there."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "hooks.py"), "--models", "null", "--pairs", "1", "--steps", "40",
         "--warmup", "5", "--alone-blocks", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("hooks-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["model"] == "null" and row["params"] == 2
    assert row["on_step_s"] > 0 and row["off_step_s"] > 0 and row["baseline_step_s"] > 0
    assert "| null |" in proc.stdout


def test_workdirs_benchmark_times_a_start_with_and_without_the_overlay() -> None:
    """bench/workdirs.py once each way: the probe, both children, a ratio for each."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "workdirs.py"), "--repeats", "1"],
                          capture_output=True, text=True, timeout=180, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("probe (once per launch): ") and lines[0].endswith(" ms")
    for child, line in zip(("python -c pass", "import torch"), lines[2:], strict=True):
        assert line.startswith(child) and len(line[len(child) :].split()) == 5, line


def _namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [name for name in listed if name.startswith(prefix + "-")]


@pytest.fixture
def netns_prefix() -> str:
    """A namespace prefix of this test's own; skips where ``ip netns add`` is not permitted."""
    prefix = f"wst{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", f"{prefix}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"bench/wire.py needs `ip netns add` (root): {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", f"{prefix}-probe"], check=True)
    return prefix


def test_wire_benchmark_shapes_links_and_leaves_no_namespace(tmp_path: Path, netns_prefix: str) -> None:
    """bench/wire.py with a tiny model, today's hub and a hub with SeaweedFS in a namespace of
    its own (``--store``): a row per (codec, link, hub), figures in them, namespaces gone."""
    args = ["--model", "tiny", "--peers", "2", "--codecs", "fp32", "--slow-codecs", "int8",
            "--links", "shared:1gbit", "peer:100mbit", "--warmup", "1", "--ns-prefix", netns_prefix,
            "--store", "--reducers", "1", "--hub-cpus", "0", "--go-delay", "0.05"]  # fmt: skip
    stdout, result = run_bench("wire", tmp_path / "results", *args)
    rows = {(r["codec"], r["link"], r["hub"]): r for r in result["rows"]}
    cases = {("fp32", "shared:1gbit"), ("int8", "peer:100mbit")}
    assert set(rows) == {(*case, hub) for case in cases for hub in ("disk", "store")}, "fp32 stays off the slow link"
    assert [r["version"] for row in rows.values() for r in row["rounds"]] == [2, 2, 2, 2], "one untimed round first"
    for row in rows.values():
        assert row["round_s"] > 0 and row["limit_s"] > 0 and row["hub_peak_rss"] > 0
        assert row["bytes_up"] > 0 and row["bytes_down"] > 0
        assert row["tcp_up_s"] > 0 and row["tcp_down_s"] > 0, "the bare-TCP floor ran on the same link"
        assert row["round_x_tcp"] == pytest.approx(row["round_s"] / (row["tcp_up_s"] + row["tcp_down_s"]))
        assert row["hub_cpus"] == "0", "--hub-cpus pinned the hub"
        assert row["hub_cpu_s"] > 0, "the hub process's own CPU-s per round"
    fp32, int8 = rows["fp32", "shared:1gbit", "disk"], rows["int8", "peer:100mbit", "disk"]
    assert fp32["limit_s"] == pytest.approx((2 * fp32["bytes_up"] + 2 * fp32["bytes_down"]) * 8 / 1e9)
    assert int8["limit_s"] == pytest.approx((int8["bytes_up"] + int8["bytes_down"]) * 8 / 1e8)
    for case in cases:
        disk, store = rows[(*case, "disk")], rows[(*case, "store")]
        assert disk["ceiling_s"] is None and store["ceiling_s"] > 0 and store["ceiling_up_s"] > 0
        assert store["round_x_ceiling"] == pytest.approx(store["round_s"] / store["ceiling_s"])
        # without a store both updates come in through the hub's link and a result goes to each peer;
        # with the store and a reducer the model's bytes skip the hub: only control crosses its link
        # (on this 26 KB model that control, presigned URLs in jobs and plans, weighs about a result)
        assert disk["hub_rx"] > 2 * disk["bytes_up"] and disk["hub_tx"] > 2 * disk["bytes_down"]
        assert store["hub_rx"] < store["bytes_up"] and store["hub_tx"] < disk["hub_tx"]
    assert {r["reducers"] for r in result["rows"] if r["hub"] == "store"} == {1}
    assert all(r["leases"] > 0 for r in result["rows"] if r["hub"] == "store"), "the reducer did the merges"
    targets = {t["target"] for t in result["targets"]}
    assert any("shared:1gbit" in t for t in targets)
    assert any(t.startswith("fp32, 2 peers, shared:1gbit, store: bytes through the hub's link") for t in targets)
    assert any(t.endswith("round / today's local-disk hub's <= 1.0") for t in targets)
    assert any(t.endswith("1 reducers: hub CPU-s per round / today's hub's <= 0.05") for t in targets)
    assert result["table"] in stdout
    assert _namespaces(netns_prefix) == []


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--reducers", "2"], "--reducers and --store-link go with --store"),
        (["--store", "--reducers", "-1"], "--reducers -1: want 0 or more"),
        (["--store", "--store-link", "fast"], "rate 'fast': want e.g. 100mbit or 1gbit"),
        (["--hub-cpus", "1-0"], "CPU list '1-0': want e.g. 0-1 or 2,4-7"),
    ],
)
def test_wire_benchmark_refuses_bad_settings_in_one_line(args: list[str], reason: str) -> None:
    """A setting it cannot use: exit 2 with the reason, before any namespace (no root needed)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "wire.py"), *args], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert proc.returncode == 2 and proc.stderr.strip().endswith(reason), proc.stderr


def test_wire_benchmark_removes_its_namespaces_when_terminated(tmp_path: Path, netns_prefix: str) -> None:
    """SIGTERM while it sets up or runs: its ``finally`` still deletes every namespace it made."""
    command = [sys.executable, str(REPO / "bench" / "wire.py"), "--model", "tiny", "--peers", "2", "--codecs",
               "fp32", "--links", "peer:1gbit", "--ns-prefix", netns_prefix, "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(_namespaces(netns_prefix)) == 4 or proc.poll() is not None, "the namespaces")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _namespaces(netns_prefix) == []


def test_utilization_benchmark_measures_every_interval_and_a_killed_peer(tmp_path: Path, netns_prefix: str) -> None:
    """bench/utilization.py --quick: peers in namespaces over shaped links, a row per H with its
    utilization from the timed intervals, the killed peer's survivor too; sync_every auto on a
    link, and on one slowed in place mid-run, with their targets; namespaces gone."""
    args = ["--quick", "--ns-prefix", netns_prefix]
    stdout, result = run_bench("utilization", tmp_path / "results", *args, timeout=180)
    auto = [r for r in result["rows"] if r["h"] == "auto"]
    rows = {(r["kill"], r["h"]): r for r in result["rows"] if r["h"] != "auto"}
    # the auto case on 1 Gbit/s, then the drop case before (1 Gbit/s) and after (100 Mbit/s) its drop
    assert [(r["link"], r["dropped_from"]) for r in auto] == [("1gbit", None), ("1gbit", None), ("100mbit", "1gbit")]
    for row in auto:
        assert row["syncs"] >= 1 and row["mean_h"] >= 1 and 0 < row["utilization"] <= 1
        assert all(h >= 1 for steps in row["steps"] for h in steps), "each interval ran the steps its result said"
    assert sum("utilization within 1 point of 95%" in t["target"] for t in result["targets"]) == 3
    assert set(rows) == {(False, 4), (False, 8), (True, 4)}
    for (kill, h), row in rows.items():
        assert row["codec"] == "int8" and row["link"] == "1gbit"
        assert row["compute_s"] == pytest.approx(h * row["step_s"] * row["syncs"])
        assert 0 < row["utilization"] <= 1 and row["wall_s"] >= row["compute_s"]
        assert row["mb_up"] > 0 and row["mb_down"] > 0, "every timed sync moved an update and a result"
        assert len(row["per_interval"]) == (1 if kill else 2), "the killed peer's intervals are not counted"
    assert rows[True, 4]["syncs"] == 3
    assert "| int8 (1 peer killed) | 1gbit | 4 |" in stdout
    assert _namespaces(netns_prefix) == []


def test_failures_benchmark_measures_a_sigkill_from_the_hubs_records(tmp_path: Path) -> None:
    """bench/failures.py --quick, SIGKILL on loopback: the round without the victim closes, the
    restarted peer is back, nothing acknowledged is lost, and every figure is in its row."""
    stdout, result = run_bench("failures", tmp_path / "results", "--quick", "--kills", "sigkill", "--no-netns")
    (row,) = result["rows"]
    assert (row["peers"], row["kill"], row["lease"]) == (3, "sigkill", 3.0)
    # its connection drops at the kill, unless the kill fell between two of its watches (a loaded
    # machine widens that gap): then its lease; test_peer_failures pins the disconnect itself
    assert not row["victim_in_failure_round"] and row["gone_reason"] in ("disconnected", "lease_expired")
    assert 0 < row["to_first_round_s"] <= row["idle_s"], "the survivors were all in before the kill"
    assert row["healthy_idle_s"] >= 0 and row["survivor_sync_s"] > 0 and row["healthy_sync_s"] > 0
    assert row["first_round"] >= row["join_version"] and row["restart_to_first_round_s"] > row["restart_join_s"] > 0
    assert row["lost"] == 0 and row["acked"] >= 3 + 2 and row["last_round"] >= 3
    assert {t["target"] for t in result["targets"]} >= {"N=3 sigkill: survivors' idle"}
    assert result["skipped"] == {} and result["table"] in stdout


def test_failures_benchmark_cuts_a_link_and_leaves_no_namespace(tmp_path: Path, netns_prefix: str) -> None:
    """--kills vanish: the victim's link is cut at the switch; the hub sees it gone by its lease,
    and every namespace is removed after."""
    args = ["--quick", "--peers", "2", "--kills", "vanish", "--ns-prefix", netns_prefix]
    _, result = run_bench("failures", tmp_path / "results", *args)
    (row,) = result["rows"]
    assert row["kill"] == "vanish" and row["gone_reason"] == "lease_expired" and not row["victim_in_failure_round"]
    assert row["idle_s"] > 0 and row["lost"] == 0 and row["rounds_after_join"] is not None
    assert result["namespaces"] == netns_prefix
    assert _namespaces(netns_prefix) == []


@needs_data
def test_ttq_benchmark_times_serial_and_peers_to_serials_perplexity(tmp_path: Path, netns_prefix: str) -> None:
    """bench/ttq.py --quick: serial (before and after the peers) on one core, 2 peers of the reference
    job in namespaces through a real hub, per-device and equal global batch; nothing evaluated while
    timed: serial's checkpoints and the hub's versions scored afterwards; the target, each time and
    where the peers' time went; namespaces gone."""
    args = ("--quick", "--ignore-load", "--ns-prefix", netns_prefix)
    stdout, result = run_bench("ttq", tmp_path / "results", *args, timeout=300)
    (serial,) = result["serial"]
    assert serial["target"] > 1 and 0 < serial["startup_s"] < serial["time_a_s"] and serial["time_b_s"] > 0
    steps = [s for s, _, _ in serial["curve"]]
    assert steps[:2] == [2, 4] and steps[-1] == serial["steps"] and serial["curve"][-1][2] == serial["final_ppl"]
    assert serial["target"] == pytest.approx(serial["final_ppl"]), "two checks: the line through them, at the last"
    rows = {r["regime"]: r for r in result["rows"]}
    assert set(rows) == {"per-device", "equal-batch"} and {r["link"] for r in rows.values()} == {"1gbit"}
    assert (rows["per-device"]["batch_per_peer"], rows["equal-batch"]["batch_per_peer"]) == (8, 4)
    for row in rows.values():
        assert row["curve"] and row["syncs"] >= 1 and row["start_s"] > 0 and row["join_s"] >= 0
        assert row["stall_s"] >= 0 and row["wait_s"] >= 0 and row["load"] >= 0
        if row["reached"]:
            assert row["x_serial"] == pytest.approx(row["time_s"] / serial["time_s"])
            assert min(p for _, _, p in row["curve"]) <= serial["target"]
        else:
            assert row["best_ppl"] > serial["target"] and row["cause"].startswith("not reached")
    (target,) = [t for t in result["targets"] if "1gbit" in t["target"]]
    assert target["threshold"] == 0.6 and result["lr_scaling"] == "none"
    assert result["table"] in stdout
    assert _namespaces(netns_prefix) == []


@needs_data
def test_chaos_benchmark_preempts_and_restarts_a_reference_job_peer(tmp_path: Path) -> None:
    """bench/chaos.py --quick --variants preempt: two peers of train/finetune_gpt2.py, one preempted
    (SIGTERM: it hands in its steps and leaves, exit 143) and started again; the run ends on one
    version with the restarted peer in it, and loses nothing acknowledged. (The SIGKILL variant is
    the same loop with another signal; tests/test_peer_failures.py kills for real.)"""
    args = ("--quick", "--variants", "preempt", "--data-root", str(tmp_path))
    _, result = run_bench("chaos", tmp_path / "results", *args, timeout=300)
    (run,) = result["runs"]
    assert run["run"] == "preempt" and run["final_version"] == 6 and run["val_ppl_identical"]
    assert run["lost"] == 0 and run["acked"] >= 6 + 1, "every round merged an update, round 0 both"
    assert run["samples_acknowledged"] > 0 and set(run["ledger"]) == {"peer-0", "peer-1"}, "the hub's ledger"
    (failure,) = run["failures"]
    assert failure["exit_code"] == 143, "it handed in and left"
    assert failure["killed_in_round"] >= 1 and failure["first_round_after"] >= 1
    assert failure["idle_s"] >= 0 and failure["to_first_round_s"] > 0
    # back in a round of the run, at most one after its join; or restarted after the run's end (a loaded box)
    assert failure["ended_first"] or 0 <= failure["rounds_after_join"] <= 1
    targets = [t["target"] for t in result["targets"]]
    assert targets == [
        "preempt: acknowledged updates lost",
        "preempt: samples lost (the ledger)",
        "preempt: survivors' idle per preemption",
    ]
    assert run["samples_lost"] == 0, "the preempted peer handed in all it trained"
    assert list(tmp_path.glob("bench-chaos-*")) == [], "its folders are removed"
