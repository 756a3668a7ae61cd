"""``weightsync-run``: unmodified programs made collaborative, as a user runs them.

The three examples (``examples/``: a Hugging Face ``Trainer``, a plain PyTorch loop, a Lightning
module; none imports weightsync) each run as 2 local peers beside a real embedded hub: rounds
close, every peer leaves at the hub's last version with the same weights (the sha-256 each peer
prints as it leaves, and the one the launcher prints of the hub's last version), and what each
script writes lands in its own peer folder. Then the edges: a program with nothing to sync keeps
its exit code, ``python -m`` and console scripts are hooked too, a Trainer subclass syncs through
its callback only (not through the optimizer hook as well), and two models in one optimizer are
refused in one line.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from syncwire.digest import weights_sha256
from tests.conftest import REPO, Hub, needs_data
from tests.harness import status, wait_for

LEFT = re.compile(r"^weightsync: (\S+) left run '(\S+)' at version (\d+); weights sha256 ([0-9a-f]{64})$", re.M)
PEERS = ("peer-0", "peer-1")
HUB = re.compile(r"^hub: run '(\S+)' ended at version (\d+); weights sha256 ([0-9a-f]{64})$", re.M)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "WEIGHTSYNC_"))}
    return {**env, **extra}


def weightsync_run(*args: str, cwd: Path = REPO, timeout: float = 420, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightsync_run", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env(**env),
        timeout=timeout,
    )


def round_rows(stdout: str) -> list[list[str]]:
    """The launcher's table: one row per closed round (round, step, peers, samples, ...)."""
    return [line.split() for line in stdout.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d+\s+\d+\s", line)]


def run_example(tmp_path: Path, script: str, sync_every: int, *args: str) -> tuple[Path, int, list[list[str]]]:
    """``examples/<script> args`` as 2 local peers: rounds closed, and each peer left at the hub's
    last version with its weights. The peers' folder, that version and the round table."""
    out = tmp_path / "out"
    proc = weightsync_run("--local-peers", "2", "--sync-every", str(sync_every), "--out", str(out), "--",
                          sys.executable, f"examples/{script}", *args)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = round_rows(proc.stdout)
    assert rows and [int(r[0]) for r in rows] == list(range(len(rows)))
    assert all(r[2] == "2" for r in rows)  # both peers in every round
    (hub,) = HUB.findall(proc.stdout)
    assert hub[0] == "local" and int(hub[1]) == len(rows)
    for peer in PEERS:
        log = (out / f"{peer}.log").read_text()
        assert LEFT.findall(log) == [(peer, "local", hub[1], hub[2])], log[-3000:]
    return out, int(hub[1]), rows


def trained_steps(out: Path) -> int:
    """What the example says it trained (the same on every peer: their shares are equal)."""
    counts = {int(re.findall(r"after (\d+) steps", (out / f"{peer}.log").read_text())[0]) for peer in PEERS}
    assert len(counts) == 1, counts
    return counts.pop()


def assert_same(saved: list[dict[str, torch.Tensor]]) -> None:
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


@needs_data
def test_plain_loop_example(tmp_path: Path, small_sample_data: Path) -> None:
    out, version, rows = run_example(tmp_path, "plain_loop.py", 5, "--data", str(small_sample_data))
    # 400 reviews (conftest's small sample): 200 per peer, 7 steps of 32 per epoch (the last one of
    # 8), 3 epochs = 21 steps: syncs at 5, 10, 15 and 20, and the last one at exit (1 step since)
    assert version == 5 and [r[1] for r in rows] == ["5", "10", "15", "20", "21"]
    for peer in PEERS:
        assert (out / peer / "out" / "model.pt").is_file() and (out / peer / "out" / "metrics.json").is_file()
        log = (out / f"{peer}.log").read_text()
        assert f"rank {peer[-1]} of 2 takes 200 of them" in log and "epoch 2: 7 steps" in log  # its share


@needs_data
def test_hugging_face_trainer_example(tmp_path: Path, small_vocab_data: Path) -> None:
    # GPT-2's tokenizer cut to 1,025 tokens (conftest), on fewer reviews: as many steps as the full
    # one on the script's default 40 (19 a peer, was 20), a fraction of the compute (the output layer's).
    out, version, _ = run_example(tmp_path, "hf_trainer.py", 4, "--data", str(small_vocab_data), "--reviews", "20")
    assert version == math.ceil(trained_steps(out) / 4) >= 2  # the callback's syncs, and no others
    assert_same([safetensors.torch.load_file(str(out / p / "out" / "model" / "model.safetensors")) for p in PEERS])
    for peer in PEERS:
        assert (out / peer / "out" / "metrics.json").is_file()
        assert "Trainer's train_dataset of" in (out / f"{peer}.log").read_text()


@needs_data
def test_lightning_example(tmp_path: Path, small_sample_data: Path) -> None:
    out, version, _ = run_example(tmp_path, "lightning_module.py", 5, "--data", str(small_sample_data))
    assert version == math.ceil(trained_steps(out) / 5) >= 2
    assert_same([torch.load(out / p / "out" / "model.pt") for p in PEERS])
    for peer in PEERS:
        assert list((out / peer / "out" / "logs").rglob("metrics.csv")), "Lightning's own log"


NOTHING = "weightsync: found nothing to sync"

NO_MODEL = """
import sys, torch
print("sum", int(torch.arange(4).sum()))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_a_program_with_nothing_to_sync_runs_unchanged(tmp_path: Path, hub: Hub, code: int) -> None:
    script = tmp_path / "no_model.py"
    script.write_text(NO_MODEL)
    proc = weightsync_run("--hub", hub.url, "--run", "r", "--", sys.executable, str(script), str(code))
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "sum 6\n"
    assert proc.stderr.strip().splitlines()[-1].startswith(NOTHING), proc.stderr


def test_local_peers_with_nothing_to_sync(tmp_path: Path) -> None:
    script = tmp_path / "no_model.py"
    script.write_text(NO_MODEL)
    out = tmp_path / "out"
    proc = weightsync_run("--local-peers", "2", "--out", str(out), "--", sys.executable, str(script), "0")
    assert proc.returncode == 0, proc.stderr
    assert "no run 'local' on the hub" in proc.stderr
    for peer in PEERS:
        assert NOTHING in (out / f"{peer}.log").read_text()
    proc = weightsync_run("--local-peers", "2", "--out", str(out), "--", sys.executable, str(script), "3")
    assert proc.returncode == 1  # the launcher's code for a failed peer; its message gives the peer's
    assert "exited with code 3: sum 6" in proc.stderr


TINY_LOOP = """
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("trained")
"""


def test_python_dash_m_and_console_scripts_are_hooked(tmp_path: Path, hub: Hub) -> None:
    (tmp_path / "tinyloop.py").write_text(TINY_LOOP)
    proc = weightsync_run("--hub", hub.url, "--run", "dash-m", "--sync-every", "2", "--", sys.executable, "-m",
                          "tinyloop", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "trained\n", proc.stderr
    assert len(status(hub, "dash-m")["rounds"]) == 3  # 6 steps, every 2
    assert "left run 'dash-m' at version 3" in proc.stderr

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    console_script = bin_dir / "tiny-train"  # what pip writes for a [project.scripts] entry
    console_script.write_text(f"#!{sys.executable}\n{TINY_LOOP}")
    console_script.chmod(0o755)
    proc = weightsync_run("--hub", hub.url, "--run", "cli", "--sync-every", "3", "--", "tiny-train",
                          PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "trained\n", proc.stderr
    assert len(status(hub, "cli")["rounds"]) == 2


TRAINER_SUBCLASS = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

class MyTrainer(Trainer):
    pass

class Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return 32
    def __getitem__(self, i):
        ids = torch.arange(16) * (i + 1) % 64
        return {"input_ids": ids, "labels": ids}

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_layer=1, n_embd=16, n_head=2))
args = TrainingArguments(output_dir="trainer", per_device_train_batch_size=4, max_steps=6, save_strategy="no",
                         report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=100)
trainer = MyTrainer(model=model, args=args, train_dataset=Blocks())
print("callbacks", sorted(type(cb).__name__ for cb in trainer.callback_handler.callbacks))
trainer.train()
"""


def test_a_trainer_subclass_syncs_through_its_callback_only(tmp_path: Path, hub: Hub) -> None:
    (tmp_path / "train.py").write_text(TRAINER_SUBCLASS)
    proc = weightsync_run("--hub", hub.url, "--run", "sub", "--sync-every", "2", "--", sys.executable, "train.py",
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SyncCallback" in proc.stdout
    # 6 steps, every 2: three rounds; had the optimizer hook synced as well, there would be more
    rounds = status(hub, "sub")["rounds"]
    assert len(rounds) == 3 and [len(r["participants"]) for r in rounds] == [1, 1, 1]
    assert "left run 'sub' at version 3" in proc.stderr


TWO_MODELS = """
import torch
generator, critic = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
optimizer = torch.optim.Adam([*generator.parameters(), *critic.parameters()])
critic(generator(torch.randn(2, 4))).sum().backward()
optimizer.step()
print("not reached")
"""


def test_two_models_in_one_optimizer_are_refused_in_one_line(tmp_path: Path, hub: Hub) -> None:
    (tmp_path / "gan.py").write_text(TWO_MODELS)
    proc = weightsync_run("--hub", hub.url, "--run", "gan", "--", sys.executable, str(tmp_path / "gan.py"))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "weightsync: cannot tell which model to sync: the optimizer trains parameters of 2 models that share no "
        "root module (Linear, Linear): make them submodules of one torch.nn.Module, or sync with the SDK yourself "
        "(SyncClient)"
    )


LOADER_LOOP = """
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(48, 4)
for xb, yb in DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8):
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("trained")
"""


def test_round_samples_makes_a_samples_run_counted_by_the_dataloader(tmp_path: Path, hub: Hub) -> None:
    """--round-samples: the plain loop reports the DataLoader's batch sizes and syncs when the hub
    says a round is due; every sample trained is in some round, the last ones in the exit sync.
    (How many rounds 6 quick steps make depends on when the hub's answer lands: not asserted.)"""
    (tmp_path / "train.py").write_text(LOADER_LOOP)
    proc = weightsync_run("--hub", hub.url, "--run", "by-samples", "--round-samples", "16", "--", sys.executable,
                          "train.py", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "trained\n", proc.stderr[-3000:]
    run = status(hub, "by-samples")
    assert run["config"]["policy"] == "samples" and run["config"]["round_samples"] == 16
    samples = [r["samples"] for r in run["rounds"]]
    assert sum(samples) == 48 and all(s % 8 == 0 for s in samples), samples
    assert f"left run 'by-samples' at version {len(samples)}" in proc.stderr


# -- two machines: a hub, then one line per GPU VM (README's recipe) ----------------------------------

# The same tiny GPT-2 in both programs (one run syncs one model), trained for the same 6 steps.
TWO_VM_MODEL = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(int(sys.argv[1]))  # each VM its own init and data: the run's version 0 is the first peer's
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_layer=1, n_embd=16, n_head=2, bos_token_id=0,
                                  eos_token_id=0))
batches = [torch.randint(0, 64, (4, 16)) for _ in range(int(sys.argv[2]))]
"""
TWO_VM_PLAIN = (
    TWO_VM_MODEL
    + """
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for ids in batches:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained")
"""
)
# torch alone (it starts seconds sooner): a Linear model, one step per batch
SMALL_PLAIN = """
import sys, torch
torch.manual_seed(int(sys.argv[1]))
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(int(sys.argv[2])):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained")
"""
TWO_VM_TRAINER = (
    TWO_VM_MODEL
    + """
from transformers import Trainer, TrainingArguments
data = [{"input_ids": ids[i], "labels": ids[i]} for ids in batches for i in range(4)]
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=len(batches), save_strategy="no",
                         report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=100)
Trainer(model=model, args=args, train_dataset=data).train()
print("trained")
"""
)


def two_vms(tmp_path: Path, hub: Hub, first: tuple[str, int], second: tuple[str, int], *flags: str) -> list[Any]:
    """README's recipe on this machine: ``weightsync-run --hub URL --run two-vm --min-peers 2 ...
    -- python PROGRAM SEED STEPS`` for vm-a, then, once vm-a has joined (it waits at the
    rendezvous), for vm-b; each peer is (program, steps). Their (peer, version, weights) at exit."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for seed, (peer, (program, steps)) in enumerate([("vm-a", first), ("vm-b", second)]):
            if procs:
                wait_for(lambda: joined(hub, "vm-a"), "the first VM joined the run", timeout=120)
            script = tmp_path / f"{peer}.py"
            script.write_text(program)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "weightsync_run", "--hub", hub.url, "--run", "two-vm", "--peer", peer,
                 "--min-peers", "2", "--sync-every", "2", *flags, "--", sys.executable, str(script), str(seed),
                 str(steps)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=clean_env(),
            ))  # fmt: skip
        return [left_at(proc) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def joined(hub: Hub, peer: str) -> bool:
    response = httpx.get(f"{hub.url}/v1/runs/two-vm", timeout=10)
    return response.status_code == 200 and peer in {p["peer"] for p in response.json()["peers"]}


def left_at(proc: subprocess.Popen[str]) -> tuple[str, int, str]:
    """The peer's exit: code 0, and the version and weights it left the run with."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.endswith("trained\n"), err[-3000:]
    ((peer, run, version, digest),) = LEFT.findall(err)
    assert run == "two-vm", err
    return peer, int(version), digest


def hub_last(hub: Hub) -> tuple[int, str]:
    response = httpx.get(f"{hub.url}/v1/runs/two-vm/model", timeout=60)
    response.raise_for_status()
    return int(response.headers["X-Sync-Version"]), weights_sha256(safetensors.numpy.load(response.content))


def test_two_machines_a_plain_loop_and_a_trainer_end_on_the_hubs_last_version(tmp_path: Path, hub: Hub) -> None:
    """A plain loop starts first and waits at the rendezvous (``--min-peers 2``) until a Trainer
    joins; both train 6 steps, syncing every 2, in int8 with DiLoCo. Each program's last sync is
    marked final (the plain loop's falls due at its last step: made at exit, final, as the
    Trainer's), so both flush the codec's residual in one more round and leave on the same
    version, with the hub's last weights."""
    flags = ("--codec", "int8", "--outer", "diloco", "--outer-lr", "0.5")
    ends = two_vms(tmp_path, hub, (TWO_VM_PLAIN, 6), (TWO_VM_TRAINER, 6), *flags)
    version, digest = hub_last(hub)
    assert ends == [("vm-a", version, digest), ("vm-b", version, digest)]
    run = status(hub, "two-vm")
    assert run["config"]["min_peers"] == 2 and run["config"]["codec"] == "int8" and run["config"]["outer"] == "diloco"
    # three rounds of both peers (steps 2, 4, 6; the last one final), then the final flush round
    assert version == 4 and [sorted(r["participants"]) for r in run["rounds"]] == [["vm-a", "vm-b"]] * 4


def test_a_peer_that_finishes_first_leaves_without_holding_the_other_back(tmp_path: Path, hub: Hub) -> None:
    """``--min-peers 2``: vm-a trains 2 steps and leaves; vm-b's later rounds close without it."""
    ends = two_vms(tmp_path, hub, (SMALL_PLAIN, 2), (SMALL_PLAIN, 6))
    version, digest = hub_last(hub)
    assert ends[0][:2] == ("vm-a", 1) and ends[1] == ("vm-b", version, digest) and version == 3
    assert [sorted(r["participants"]) for r in status(hub, "two-vm")["rounds"]] == [
        ["vm-a", "vm-b"],
        ["vm-b"],
        ["vm-b"],
    ]


LR_PROBE = """
import torch

model = torch.nn.Linear(1, 1, bias=False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
moves = []
for step in range(4):
    model.weight.grad = torch.ones_like(model.weight)
    before = model.weight.item()  # at step 1 this predates the join, which loads the run's weights
    optimizer.step()
    moves.append(round(before - model.weight.item(), 6))
print("moves", moves, "lr", optimizer.param_groups[0]["lr"], flush=True)
"""


def test_a_plain_loop_steps_at_the_scaled_rate_and_keeps_its_own(tmp_path: Path) -> None:
    """--lr-scaling linear over 2 peers, ramped over 2 steps: plain SGD moves by the rate it used."""
    script = tmp_path / "probe.py"
    script.write_text(LR_PROBE)
    out = tmp_path / "out"
    args = ("--local-peers", "2", "--sync-every", "10", "--lr-scaling", "linear", "--lr-scaling-warmup", "2")
    proc = weightsync_run(*args, "--out", str(out), "--", sys.executable, str(script))
    assert proc.returncode == 0, proc.stderr
    for peer in PEERS:
        log = (out / f"{peer}.log").read_text()
        # steps 2-4 at 1.5x, 2x, 2x the rate; step 1 moved from weights the join then replaced
        assert "lr 0.1" in log and "0.15, 0.2, 0.2]" in log, log
