"""``weightsync-run``: unmodified programs made collaborative, as a user runs them.

The three examples (``examples/``: a Hugging Face ``Trainer``, a plain PyTorch loop, a Lightning
module; none imports weightsync) each run as 2 local peers beside a real embedded hub: rounds
close, every peer leaves at the hub's last version with the same weights (the sha-256 each peer
prints as it leaves, and the one the launcher prints of the hub's last version), and what each
script writes lands in its own peer folder. Then the edges: a program with nothing to sync keeps
its exit code, ``python -m`` and console scripts are hooked too (the two VMs of a peer that
finishes first), a Trainer subclass syncs through its callback only (not through the optimizer
hook as well: the Trainer of the two-machine run), and two models in one optimizer are refused
in one line.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.numpy
import safetensors.torch
import torch

from syncwire.digest import weights_sha256
from tests.conftest import REPO, Hub, needs_data
from tests.harness import HTTP, status, wait_for

LEFT = re.compile(r"^weightsync: (\S+) left run '(\S+)' at version (\d+); weights sha256 ([0-9a-f]{64})$", re.M)
PEERS = ("peer-0", "peer-1")
HUB = re.compile(r"^hub: run '(\S+)' ended at version (\d+); weights sha256 ([0-9a-f]{64})$", re.M)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "WEIGHTSYNC_"))}
    return {**env, **extra}


def launch(*args: str, cwd: Path = REPO, **env: str) -> subprocess.Popen[str]:
    """``weightsync-run ARGS``, started: a test that runs two of them runs them side by side."""
    return subprocess.Popen(
        [sys.executable, "-m", "weightsync_run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=clean_env(**env),
    )


def finish(proc: subprocess.Popen[str], timeout: float = 420) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def weightsync_run(*args: str, cwd: Path = REPO, timeout: float = 420, **env: str) -> subprocess.CompletedProcess[str]:
    return finish(launch(*args, cwd=cwd, **env), timeout)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One hub for the tests that join one (none kills it or reads its log), each on runs of its
    own names: a hub start is ~1 s of a test that is mostly its programs' starts."""
    tmp = tmp_path_factory.mktemp("zero-code")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    shared = Hub(tmp / "hub", [], env, tmp / "hub.log").start()
    yield shared
    shared.stop()


def round_rows(stdout: str) -> list[list[str]]:
    """The launcher's table: one row per closed round (round, step, peers, samples, ...)."""
    return [line.split() for line in stdout.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d+\s+\d+\s", line)]


def run_example(
    tmp_path: Path, script: str, sync_every: int, saved: str, *args: str
) -> tuple[Path, int, list[list[str]]]:
    """``examples/<script> args`` as 2 local peers: rounds closed, each peer left at the hub's
    last version with its weights, and the model each saved (``saved``, in its folder) is that
    version. The peers' folder, that version and the round table."""
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
        path = out / peer / saved
        load = safetensors.torch.load_file if path.suffix == ".safetensors" else torch.load
        assert_holds(load(path), hub_version(out / "hub", "local", int(hub[1])))
    return out, int(hub[1]), rows


def trained_steps(out: Path) -> int:
    """What the example says it trained (the same on every peer: their shares are equal)."""
    counts = {int(re.findall(r"after (\d+) steps", (out / f"{peer}.log").read_text())[0]) for peer in PEERS}
    assert len(counts) == 1, counts
    return counts.pop()


@needs_data
def test_plain_loop_example(tmp_path: Path, small_sample_data: Path) -> None:
    out, version, rows = run_example(tmp_path, "plain_loop.py", 5, "out/model.pt", "--data", str(small_sample_data))
    # 400 reviews (conftest's small sample): 200 per peer, 7 steps of 32 per epoch (the last one of
    # 8), 3 epochs = 21 steps: syncs at 5, 10, 15 and 20, and the last one at the save (1 step since)
    assert version == 5 and [r[1] for r in rows] == ["5", "10", "15", "20", "21"]
    for peer in PEERS:
        assert (out / peer / "out" / "model.pt").is_file() and (out / peer / "out" / "metrics.json").is_file()
        log = (out / f"{peer}.log").read_text()
        assert f"rank {peer[-1]} of 2 takes 200 of them" in log and "epoch 2: 7 steps" in log  # its share


@needs_data
def test_hugging_face_trainer_example(tmp_path: Path, small_vocab_data: Path) -> None:
    # GPT-2's tokenizer cut to 1,025 tokens (conftest), on fewer reviews: as many steps as the full
    # one on the script's default 40 (19 a peer, was 20), a fraction of the compute (the output layer's).
    out, version, _ = run_example(
        tmp_path, "hf_trainer.py", 4, "out/model/model.safetensors", "--data", str(small_vocab_data), "--reviews", "20"
    )
    assert version == math.ceil(trained_steps(out) / 4) >= 2  # the callback's syncs, and no others
    for peer in PEERS:
        assert (out / peer / "out" / "metrics.json").is_file()
        assert "Trainer's train_dataset of" in (out / f"{peer}.log").read_text()


@needs_data
def test_lightning_example(tmp_path: Path, small_sample_data: Path) -> None:
    out, version, _ = run_example(tmp_path, "lightning_module.py", 5, "out/model.pt", "--data", str(small_sample_data))
    assert version == math.ceil(trained_steps(out) / 5) >= 2
    for peer in PEERS:
        assert list((out / peer / "out" / "logs").rglob("metrics.csv")), "Lightning's own log"


NOTHING = "weightsync: found nothing to sync"

NO_MODEL = """
import sys, torch
print("sum", int(torch.arange(4).sum()))
if int(sys.argv[1]):  # 0: it runs to its end (where Python drops __main__.__file__)
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
    """Two launches side by side (each its own hub and peers): peers that exit 0, and peers that
    exit 3."""
    script = tmp_path / "no_model.py"
    script.write_text(NO_MODEL)
    procs = [launch("--local-peers", "2", "--out", str(tmp_path / f"out{code}"), "--", sys.executable, str(script),
                    str(code)) for code in (0, 3)]  # fmt: skip
    proc, failed = (finish(p) for p in procs)
    assert proc.returncode == 0, proc.stderr
    assert "no run 'local' on the hub" in proc.stderr
    for peer in PEERS:
        assert NOTHING in (tmp_path / "out0" / f"{peer}.log").read_text()
    assert failed.returncode == 1  # the launcher's code for a failed peer; its message gives the peer's
    assert "exited with code 3: sum 6" in failed.stderr


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

# Each program waits for its go file (argv[3]) before it trains, and so before it joins: both
# start at once, so that their imports overlap, and the test says when each may join.
GO = """
import os, time
while not os.path.exists(sys.argv[3]):
    time.sleep(0.01)
"""
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
    + GO
    + """
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for ids in batches:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.save_pretrained(f"saved-{sys.argv[1]}")
print("trained")
"""
)
# torch alone (it starts seconds sooner): a Linear model, one step per batch
SMALL_PLAIN = (
    """
import sys, torch
torch.manual_seed(int(sys.argv[1]))
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""
    + GO
    + """
for step in range(int(sys.argv[2])):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained")
"""
)
# One model in two programs: the plain loop's and the LightningModule's parameters have the same
# names (net.0.weight, ...); each saves it after its last step.
NET = """
import sys, torch
torch.manual_seed(int(sys.argv[1]))
steps = int(sys.argv[2])
data = [torch.randn(4, 8) for _ in range(steps)]
"""
SAVING_PLAIN = (
    NET
    + """
from safetensors.torch import save_model

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""
    + GO
    + """
for x in data:
    model.net(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
save_model(model, "saved-0.safetensors")
print("trained")
"""
)
SAVING_LIGHTNING = (
    NET
    + """
import lightning as L

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def training_step(self, x, i):
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

model = Net()
"""
    + GO
    + """
trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
torch.save(model.state_dict(), "saved-1.pt")
print("trained")
"""
)
# A Trainer subclass: the hook on Trainer.__init__ finds it as well, and it syncs through its
# callback only, not through the optimizer hook too (that would make more rounds than the test sees).
TWO_VM_TRAINER = (
    TWO_VM_MODEL
    + """
from transformers import Trainer, TrainingArguments

class MyTrainer(Trainer):
    pass

data = [{"input_ids": ids[i], "labels": ids[i]} for ids in batches for i in range(4)]
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=len(batches), save_strategy="no",
                         report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=100)
"""
    + GO
    + """
trainer = MyTrainer(model=model, args=args, train_dataset=data)
print("callbacks", sorted(type(cb).__name__ for cb in trainer.callback_handler.callbacks))
trainer.train()
trainer.save_model(f"saved-{sys.argv[1]}")
print("trained")
"""
)


VM = tuple[str, int, str]
"""How a VM runs: its program, its steps, and how the program is started: ``script`` (``python
vm_a.py``), ``-m`` (``python -m vm_a``, from its folder) or ``console`` (``vm-a``, a console script
on ``PATH``, as pip writes one for a ``[project.scripts]`` entry)."""


def two_vms(
    tmp_path: Path, hub: Hub, run: str, first: VM, second: VM, *flags: str, every: int = 2
) -> tuple[list[tuple[str, int, str]], list[str]]:
    """README's recipe on this machine: ``weightsync-run --hub URL --run RUN --min-peers 2
    --sync-every EVERY ... -- python PROGRAM SEED STEPS GO`` for vm-a and for vm-b; vm-b trains, and so joins, only
    once vm-a has joined (and waits at the rendezvous), as when vm-b's line is typed after
    vm-a's. Their (peer, version, weights) at exit, and their stdout."""
    procs: list[subprocess.Popen[str]] = []
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    try:
        for seed, (peer, (program, steps, how)) in enumerate([("vm-a", first), ("vm-b", second)]):
            if how == "console":
                script = bin_dir / peer
                script.write_text(f"#!{sys.executable}\n{program}")
                script.chmod(0o755)
                command = [peer]
            else:
                script = tmp_path / f"{peer.replace('-', '_')}.py"
                script.write_text(program)
                command = [sys.executable, "-m", script.stem] if how == "-m" else [sys.executable, str(script)]
            procs.append(launch("--hub", hub.url, "--run", run, "--peer", peer, "--min-peers", "2", "--sync-every",
                                str(every), *flags, "--", *command, str(seed), str(steps), str(tmp_path / f"{peer}.go"),
                                cwd=tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"))  # fmt: skip
        (tmp_path / "vm-a.go").touch()
        wait_for(lambda: joined(hub, run, "vm-a"), "the first VM joined the run", timeout=120)
        (tmp_path / "vm-b.go").touch()
        done = [finish(proc, timeout=300) for proc in procs]
        return [left_at(proc, run) for proc in done], [proc.stdout for proc in done]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def joined(hub: Hub, run: str, peer: str) -> bool:
    response = HTTP.get(f"{hub.url}/v1/runs/{run}", timeout=10)
    return response.status_code == 200 and peer in {p["peer"] for p in response.json()["peers"]}


def left_at(done: subprocess.CompletedProcess[str], run: str) -> tuple[str, int, str]:
    """The peer's exit: code 0, and the version and weights it left ``run`` with."""
    assert done.returncode == 0 and done.stdout.endswith("trained\n"), done.stderr[-3000:]
    ((peer, left, version, digest),) = LEFT.findall(done.stderr)
    assert left == run, done.stderr
    return peer, int(version), digest


def hub_last(hub: Hub, run: str) -> tuple[int, str]:
    response = HTTP.get(f"{hub.url}/v1/runs/{run}/model", timeout=60)
    response.raise_for_status()
    return int(response.headers["X-Sync-Version"]), weights_sha256(safetensors.numpy.load(response.content))


def test_two_machines_a_plain_loop_and_a_trainer_end_on_the_hubs_last_version(tmp_path: Path, hub: Hub) -> None:
    """A plain loop starts first and waits at the rendezvous (``--min-peers 2``) until a Trainer
    joins; both train 7 steps (not a multiple of 2), syncing every 2, in int8 with DiLoCo, then
    save their model (``save_pretrained``; the Trainer's ``save_model``). The plain loop's read
    at the save syncs its 7th step, final, as the Trainer's last sync is, and both flush the
    codec's residual in one more round: they leave on the same version, with the hub's last
    weights, and what each saved is that version. The Trainer is a subclass of ``Trainer``: it
    gets ``SyncCallback`` and syncs through it only (the test of that, merged into this run)."""
    flags = ("--codec", "int8", "--outer", "diloco", "--outer-lr", "0.5")
    ends, stdouts = two_vms(tmp_path, hub, "two-vm", (TWO_VM_PLAIN, 7, "script"), (TWO_VM_TRAINER, 7, "script"), *flags)
    version, digest = hub_last(hub, "two-vm")
    assert ends == [("vm-a", version, digest), ("vm-b", version, digest)]
    assert "SyncCallback" in stdouts[1]
    run = status(hub, "two-vm")
    assert run["config"]["min_peers"] == 2 and run["config"]["codec"] == "int8" and run["config"]["outer"] == "diloco"
    # four rounds of both peers (steps 2, 4, 6, 7), then the final flush round; had the
    # subclass's optimizer hook synced as well, there would be more
    assert version == 5 and [sorted(r["participants"]) for r in run["rounds"]] == [["vm-a", "vm-b"]] * 5
    for seed in (0, 1):
        saved = safetensors.torch.load_file(str(tmp_path / f"saved-{seed}" / "model.safetensors"))
        assert_holds(saved, hub_version(hub.data_dir, "two-vm", version))


def test_a_peer_that_finishes_first_leaves_without_holding_the_other_back(tmp_path: Path, hub: Hub) -> None:
    """``--min-peers 2``: vm-a trains 2 steps and leaves; vm-b's later rounds close without it.
    vm-a runs as ``python -m vm_a``, vm-b as a console script: both are hooked, and their output
    is the programs' own (the test of ``python -m`` and console scripts, merged into this run)."""
    ends, stdouts = two_vms(tmp_path, hub, "first-out", (SMALL_PLAIN, 2, "-m"), (SMALL_PLAIN, 6, "console"))
    assert stdouts == ["trained\n", "trained\n"]
    version, digest = hub_last(hub, "first-out")
    assert ends[0][:2] == ("vm-a", 1) and ends[1] == ("vm-b", version, digest) and version == 3
    assert [sorted(r["participants"]) for r in status(hub, "first-out")["rounds"]] == [
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


# -- what a script saves after its last step is the run's model -----------------------------------

# A plain loop of STEPS steps, each peer on data of its own, that saves a checkpoint mid-training
# (step 12: not a sync step) and, after its last step, its model in each way the issue names.
SAVES = """
import os, sys, torch
from safetensors.torch import save_file, save_model
torch.manual_seed(os.getpid())  # each peer its own data; the run's version 0 is the first peer's
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, int(sys.argv[1]) + 1):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 12:
        torch.save({"model": model.state_dict(), "step": step}, "checkpoint.pt")
torch.save(model.state_dict(), "model.pt")
save_file(model.state_dict(), "model.safetensors")
save_model(model, "saved_model.safetensors")
print("trained")
"""
SAVED = {"model.pt": torch.load, "model.safetensors": safetensors.torch.load_file,
         "saved_model.safetensors": safetensors.torch.load_file}  # fmt: skip


def hub_version(data_dir: Path, run: str, version: int) -> dict[str, torch.Tensor]:
    """Version ``version`` of ``run`` as the hub stored it (the hub keeps its last three)."""
    return safetensors.torch.load_file(str(data_dir / "runs" / run / "versions" / f"{version:08d}.safetensors"))


def assert_holds(saved: dict[str, torch.Tensor], version: dict[str, torch.Tensor]) -> None:
    assert saved.keys() == version.keys()
    differ = [k for k in saved if not torch.equal(saved[k], version[k])]
    assert not differ, {k: float((saved[k] - version[k]).abs().max()) for k in differ[:5]}


def test_a_plain_loop_saves_the_runs_model_whichever_way_it_saves(tmp_path: Path) -> None:
    """Two launches of 2 local peers, side by side: 40 steps (a multiple of 5) in fp32, and 37 in
    int8. Every file each peer saves after its last step, in each way, is identical across the
    peers and holds the hub's last version. The checkpoint at step 12 synced steps 11-12 in the
    round of steps 11-15 (int8: and the flush in the round of 16-20), so it cost no round: one a
    window of 5 steps, and int8's final flush."""
    (tmp_path / "train.py").write_text(SAVES)
    runs = {"fp32": "40", "int8": "37"}
    procs = {codec: launch("--local-peers", "2", "--sync-every", "5", "--codec", codec, "--out",
                           str(tmp_path / codec), "--", sys.executable, "train.py", steps, cwd=tmp_path)
             for codec, steps in runs.items()}  # fmt: skip
    for codec, proc in procs.items():
        done = finish(proc)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out = tmp_path / codec
        ((_, last, digest),) = HUB.findall(done.stdout)
        steps = [int(r[1]) for r in round_rows(done.stdout)]  # a flush's row has no step
        if codec == "fp32":
            assert steps == [5, 10, 12, 20, 25, 30, 35, 40] and last == "8"
        else:
            assert steps == [5, 10, 12, 25, 30, 35, 37] and last == "9"
        version = hub_version(out / "hub", "local", int(last))
        assert weights_sha256({k: v.numpy() for k, v in version.items()}) == digest
        for peer in PEERS:
            for name, load in SAVED.items():
                assert_holds(load(out / peer / name), version)
            assert LEFT.findall((out / f"{peer}.log").read_text()) == [(peer, "local", last, digest)]


def test_two_machines_a_plain_loop_and_a_lightning_run_save_the_hubs_last_version(tmp_path: Path, hub: Hub) -> None:
    """Two VMs started apart, DiLoCo in fp32, 40 steps each syncing every 5 (a multiple): a
    plain loop (``save_model``) and a Lightning run (``torch.save(model.state_dict())``). The
    plain loop's sync after step 40 is made right after it, before the program saves: both
    files hold the hub's last version, on which both peers left."""
    ends, _ = two_vms(tmp_path, hub, "two-vm-pl", (SAVING_PLAIN, 40, "script"), (SAVING_LIGHTNING, 40, "script"),
                      "--outer", "diloco", every=5)  # fmt: skip
    version, digest = hub_last(hub, "two-vm-pl")
    assert ends == [("vm-a", version, digest), ("vm-b", version, digest)] and version == 8
    last = hub_version(hub.data_dir, "two-vm-pl", version)
    assert_holds(safetensors.torch.load_file(str(tmp_path / "saved-0.safetensors")), last)
    assert_holds(torch.load(tmp_path / "saved-1.pt"), last)
