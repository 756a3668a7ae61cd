"""``weightsync-run --local-peers`` as a user runs it: a real embedded hub and real peer processes.

Peers here are tiny programs written for each test: SDK peers that sync a 10-parameter model,
and plain Python ones that fail, get killed or wait, to check the supervision.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from syncserver.local import SETTINGS_EXIT, LaunchError, RoundTable, check_final, hub_settings_for
from tests.conftest import REPO
from tests.harness import HTTP, wait_for

SDK_PEER = """
import os, sys, torch
from syncclient import SyncClient
from syncwire.digest import left_line, weights_sha256

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
env = os.environ
client = SyncClient(env["WEIGHTSYNC_HUB"], run=env["WEIGHTSYNC_RUN"], peer=env["WEIGHTSYNC_PEER"],
                    token=env["WEIGHTSYNC_TOKEN"])
info = client.join(model)
assert (info.rank, info.world_size) == (int(env["WEIGHTSYNC_RANK"]), int(env["WEIGHTSYNC_WORLD_SIZE"]))
for step in (1, 2, 3):
    with torch.no_grad():
        model.weight.add_(0.1 * (info.rank + 1))
    client.sync(model, samples=8, metrics={"acc": 0.5 + info.rank / 10 + step / 100, "step": step})
client.leave()
open(os.path.join(env["WEIGHTSYNC_PEER_DIR"], "done"), "w").write(str(info.rank))
digest = weights_sha256({k: v.detach().numpy() for k, v in model.named_parameters()})
print(left_line(client.peer, client.run, client.version, digest), file=sys.stderr)  # what the launcher checks
print(f"rank {info.rank} done")
"""

# A peer that records its pid, then does what the test's MODE says.
PLAIN_PEER = """
import os, signal, sys, time
rank = int(os.environ["WEIGHTSYNC_RANK"])
open(os.path.join(os.environ["WEIGHTSYNC_PEER_DIR"], "pid"), "w").write(str(os.getpid()))
mode = sys.argv[1]
if rank == 1 and mode == "fail":
    print("rank 1 gives up"); sys.exit(3)
if rank == 1 and mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


def launch(tmp_path: Path, *args: str, peer: str, peer_args: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    script = tmp_path / "peer.py"
    script.write_text(peer)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "WEIGHTSYNC_"))}
    cmd = [sys.executable, "-m", "weightsync_run", "--out", str(tmp_path / "out"), *args]
    return subprocess.Popen(
        [*cmd, "--", sys.executable, str(script), *peer_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def assert_all_stopped(out: Path) -> None:
    for pid_file in out.glob("peer-*/pid"):
        assert gone(int(pid_file.read_text())), pid_file
    with pytest.raises(httpx.ConnectError):  # the hub no longer listens
        HTTP.get((out / "hub.url").read_text().strip() + "/healthz", timeout=5)


def test_sdk_peers_print_a_row_per_round(tmp_path: Path) -> None:
    proc = launch(tmp_path, "--local-peers", "2", "--metric", "acc", "--token", "hub-secret", peer=SDK_PEER)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout + stderr
    out = tmp_path / "out"
    assert sorted((out / p / "done").read_text() for p in ("peer-0", "peer-1")) == ["0", "1"]
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    # round, step, peers, samples, acc of peer-0 and peer-1, MB up, MB down, round s, elapsed
    assert [r[:6] for r in rows] == [
        ["0", "1", "2", "16", "0.51", "0.61"],
        ["1", "2", "2", "16", "0.52", "0.62"],
        ["2", "3", "2", "16", "0.53", "0.63"],
    ]
    assert "hub-secret" not in stdout + stderr
    assert (out / "hub.log").stat().st_size > 0 and (out / "hub").is_dir()
    assert all((out / f"{p}.log").exists() for p in ("peer-0", "peer-1"))
    # Then the check, for any program whose peers print their digest as they leave, and each one's last line.
    assert "final weights identical across peers: yes; equal to the hub's version 3: yes" in stdout
    assert "peer-0: rank 0 done" in stdout and "peer-1: rank 1 done" in stdout
    results = json.loads((out / "results.json").read_text())
    assert results["weights_identical"] and results["weights_equal_hub"] and results["hub_version"] == 3
    assert {f["weights_sha256"] for f in results["final"].values()} == {results["hub_weights_sha256"]}
    assert [r["metrics"]["peer-1"]["acc"] for r in results["rounds"]] == [0.61, 0.62, 0.63]
    assert (out / "acc.png").stat().st_size > 10_000  # --metric per peer against the step


def test_the_final_check_names_a_peer_that_left_early_and_fails_one_that_differs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = "a" * 64, "b" * 64
    assert check_final({"p0": {"version": 3, "weights_sha256": a}, "p1": None}, (3, a)) == {
        "weights_identical": True,
        "weights_equal_hub": True,
    }
    early = {"p0": {"version": 3, "weights_sha256": a}, "p1": {"version": 2, "weights_sha256": b}}
    assert check_final(early, (3, a)) == {"weights_identical": False, "weights_equal_hub": True}
    assert capsys.readouterr().out.splitlines()[-1].endswith("equal to the hub's version 3: yes; p1 left at version 2")
    differs = {"p0": {"version": 3, "weights_sha256": a}, "p1": {"version": 3, "weights_sha256": b}}
    assert check_final(differs, (3, a)) == {"weights_identical": False, "weights_equal_hub": False}
    assert "identical across peers: NO; equal to the hub's version 3: NO" in capsys.readouterr().out
    assert check_final({"p0": None}, (3, a)) == {}  # no peer printed its digest: nothing to check


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("fail", "weightsync-run: error: peer-1 exited with code 3: rank 1 gives up"),
        ("kill", "weightsync-run: error: peer-1 was killed by SIGKILL"),
    ],
)
def test_a_failed_peer_stops_the_others_and_the_hub(tmp_path: Path, mode: str, message: str) -> None:
    proc = launch(tmp_path, "--local-peers", "2", peer=PLAIN_PEER, peer_args=(mode,))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1].startswith(message), stderr
    assert f"(log: {tmp_path / 'out' / 'peer-1.log'})" in stderr
    assert_all_stopped(tmp_path / "out")


def test_sigint_stops_every_child(tmp_path: Path) -> None:
    proc = launch(tmp_path, "--local-peers", "2", peer=PLAIN_PEER, peer_args=("wait",))
    out = tmp_path / "out"
    wait_for(lambda: all((out / p / "pid").exists() for p in ("peer-0", "peer-1")), "both peers")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert_all_stopped(out)


def test_a_command_that_does_not_exist(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    cmd = [sys.executable, "-m", "weightsync_run", "--local-peers", "1", "--out", str(tmp_path / "out")]
    proc = subprocess.run([*cmd, "--", "no-such-program-here"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("weightsync-run: error: cannot start peer-0: no-such-program-here"), proc.stderr


def test_round_table_rows_from_a_status() -> None:
    lines: list[str] = []
    table = RoundTable(["peer-0", "peer-1"], "eval_ppl", lines.append, t0=time.time())
    status = {
        "rounds": [
            {"round": 0, "opened": 10.0, "closed": 12.5, "participants": ["peer-0", "peer-1"], "dropped": [],
             "samples": 64, "bytes_in": 2_000_000, "result_bytes": 1_000_000},
        ],
        "updates": [
            {"peer": "peer-0", "round": 0, "metrics": {"eval_ppl": 101.25, "step": 10.0}},
            {"peer": "peer-1", "round": 0, "metrics": {"eval_ppl": 99.5, "step": 10.0}},
        ],
    }  # fmt: skip
    table.update(status)
    table.update(status)  # a round is printed once
    assert len(table.rows) == 1 and len(lines) == 1
    row = table.rows[0]
    assert (row["round"], row["version"], row["step"], row["participants"], row["samples"]) == (0, 1, 10, 2, 64)
    assert (row["bytes_up"], row["bytes_down"], row["seconds"]) == (2_000_000, 2_000_000, 2.5)
    assert lines[0].split()[:9] == ["0", "10", "2", "64", "101.25", "99.5", "2.00", "2.00", "2.50"]


def test_launchers_take_the_hub_settings_from_the_launcher_not_the_hubs_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``weightsync-run --local-peers`` and the reference job's ``--local-peers``: the hub's data
    in OUT/hub, a rendezvous of all K, the token given, over the SYNC_* variables; a bad variable
    is one line. Neither imports the hub's CLI module (a job needs no typer, no serve)."""
    monkeypatch.setenv("SYNC_MIN_PEERS", "7")
    monkeypatch.setenv("SYNC_KEEP_VERSIONS", "5")
    settings = hub_settings_for(tmp_path, 3, "secret")
    assert (settings.data_dir, settings.min_peers, settings.keep_versions) == (tmp_path / "hub", 3, 5)
    assert settings.token is not None and settings.token.get_secret_value() == "secret"
    monkeypatch.setenv("SYNC_KEEP_VERSIONS", "none")
    with pytest.raises(LaunchError, match=r"^hub settings: SYNC_KEEP_VERSIONS: ") as caught:
        hub_settings_for(tmp_path, 3)
    assert caught.value.exit_code == SETTINGS_EXIT
    for source in ("train/finetune_gpt2.py", "weightsync_run/cli.py", "syncserver/local.py"):
        tree = ast.parse((REPO / source).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert "syncserver.cli" not in imported, source
