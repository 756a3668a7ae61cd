"""``weightsync-run`` on training scripts from well-known public repositories, kept verbatim.

Each script (``tests/public/<name>/``: the files, the repository's LICENSE and a SOURCE.md that
says where they come from) runs as 2 local peers exactly as its own README launches it: from its
folder (a copy in ``tmp_path``, with the data the test writes there or beside it), ``python
SCRIPT ...``, on tiny settings. Each test checks the promise of issue 48: the launch exits 0,
every model file each peer saved is identical across the peers and is the hub's version at the
save (the last one for a save after the last step), and the peers' first losses differ (each
trained on its own draws of one shared dataset, from its own seed).

- nanoGPT (karpathy/nanoGPT): ``exec``s ``configurator.py`` and reads ``data/<dataset>/`` from its
  working folder, seeds ``torch.manual_seed(1337)`` and draws batches with ``torch.randint``;
  saves ``out/ckpt.pt`` at each eval, before that iteration's step.
- run_clm.py (huggingface/transformers examples): a ``Trainer``; saves with ``save_model()``
  after ``train()``.
- word_language_model (pytorch/examples): steps the weights by hand after ``backward()``
  (``p.data.add_(p.grad, alpha=-lr)``, no optimizer) and saves with ``torch.save(model, f)``.
"""

from __future__ import annotations

import pickle
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import safetensors.torch
import torch

from syncwire.digest import weights_sha256
from tests.conftest import REPO, SHARED_DATA, needs_data
from tests.test_zero_code import HUB, LEFT, PEERS, hub_version, round_rows, weightsync_run

PUBLIC = REPO / "tests" / "public"
SYNC_EVERY = 3
#: the Hugging Face libraries offline, their caches in the test's folder
HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def reviews(count: int, skip: int = 0) -> list[str]:
    """IMDB reviews from the offline sample, one line each (their ``<br />`` markup made spaces)."""
    texts = pq.read_table(SHARED_DATA / "imdb" / "sample.parquet", columns=["text"]).column("text").to_pylist()
    return [t.replace("<br />", " ") for t in texts[skip : skip + count]]


def script_folder(tmp_path: Path, name: str) -> Path:
    """A copy of ``tests/public/<name>``: the script's own folder, where the run starts."""
    return Path(shutil.copytree(PUBLIC / name, tmp_path / name))


Run = tuple[Path, int, list[list[str]]]
"""The launcher's folder (``peer-k/``, ``peer-k.log``, ``hub/``), the hub's last version, its rounds."""


def run_public(folder: Path, out: Path, *command: str, **env: str) -> Run:
    """``weightsync-run --local-peers 2 --sync-every 3 -- python COMMAND`` from ``folder``: it exits 0,
    rounds closed with both peers, and each peer left the run at the hub's last version with its
    weights (the sha-256 each printed as it left, the launcher's, and that of the version the hub
    stored are one)."""
    proc = weightsync_run("--local-peers", "2", "--sync-every", str(SYNC_EVERY), "--out", str(out), "--",
                          sys.executable, *command, cwd=folder, timeout=300, **env)  # fmt: skip
    logs = "".join(f"\n--- {p}.log\n" + (out / f"{p}.log").read_text()[-3000:] for p in PEERS
                   if (out / f"{p}.log").exists())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    hub = HUB.findall(proc.stdout)
    assert len(hub) == 1, proc.stdout[-3000:] + proc.stderr[-3000:] + logs  # the hub's last version: there is one
    (run, last, digest) = hub[0]
    rows = round_rows(proc.stdout)
    assert run == "local" and int(last) == len(rows) >= 2 and all(r[2] == "2" for r in rows), proc.stdout
    version = hub_version(out / "hub", "local", int(last))
    assert weights_sha256({k: v.numpy() for k, v in version.items()}) == digest
    for peer in PEERS:
        assert LEFT.findall((out / f"{peer}.log").read_text()) == [(peer, "local", last, digest)], logs
    return out, int(last), rows


def saved_by_each_peer(out: Path, relative: str) -> list[Path]:
    """The file each peer's script wrote at ``relative`` to its working folder: what a peer writes
    lands in its own folder of the launch, ``OUT/peer-k/`` (docs/launcher.md)."""
    paths = [out / peer / relative for peer in PEERS]
    for path in paths:
        assert path.is_file(), f"no {relative} in {path.parents[len(Path(relative).parts) - 1]}"
    return paths


def assert_holds(saved: dict[str, torch.Tensor], version: dict[str, torch.Tensor]) -> None:
    """``saved`` holds the hub's ``version``: every tensor the run syncs, bit for bit. A saved state
    may name more (a tied weight's second name, such as nanoGPT's ``lm_head.weight``, travels once)."""
    assert version.keys() <= saved.keys(), sorted(version.keys() - saved.keys())
    differ = [k for k in version if not torch.equal(saved[k].float(), version[k])]
    assert not differ, {k: float((saved[k].float() - version[k]).abs().max()) for k in differ[:5]}


def assert_identical_and_hub(
    out: Path, relative: str, load: Callable[[Path], dict[str, torch.Tensor]], version: int
) -> None:
    """Each peer's ``relative`` is identical across the peers, and holds the hub's ``version``."""
    states = [load(path) for path in saved_by_each_peer(out, relative)]
    first, second = states
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), (
        f"the peers' {relative} differ"
    )
    assert_holds(first, hub_version(out / "hub", "local", version))


def assert_first_losses_differ(out: Path, pattern: str) -> list[str]:
    """Each peer's first logged loss (``pattern``'s groups, first match in its log): they differ,
    so the peers did not train the same steps on the same draws from the same weights."""
    firsts = []
    for peer in PEERS:
        match = re.search(pattern, (out / f"{peer}.log").read_text(), re.M)
        assert match, f"no loss in {peer}.log"
        firsts.append(" ".join(match.groups()))
    assert firsts[0] != firsts[1], f"both peers' first loss is {firsts[0]}: the same batches from the same weights"
    return firsts


# -- karpathy/nanoGPT ----------------------------------------------------------------------------


def write_char_dataset(folder: Path, text: str) -> int:
    """``folder/{train,val}.bin`` (uint16 character ids, 90/10) and ``meta.pkl``, as nanoGPT's
    data/shakespeare_char/prepare.py writes them. The vocabulary's size."""
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    split = int(len(ids) * 0.9)
    folder.mkdir(parents=True)
    ids[:split].tofile(folder / "train.bin")
    ids[split:].tofile(folder / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    return len(chars)


@needs_data
def test_nanogpt_shakespeare_char(tmp_path: Path) -> None:
    """README's ``python train.py config/train_shakespeare_char.py`` with its CPU flags, made tiny:
    13 steps (the loop runs ``iter_num`` 0 to ``max_iters``), syncing after steps 3, 6, 9 and 12,
    and at exit after step 13. It saves ``out/ckpt.pt`` at each eval (iterations 6 and 12), before
    that iteration's step: the last one holds the 12 steps before iteration 12, so the hub's
    version of the round after step 12, not its last (``--always_save_checkpoint=True``: the
    config saves only when the val loss improves)."""
    folder = script_folder(tmp_path, "nanogpt")
    write_char_dataset(folder / "data" / "shakespeare_char", "\n".join(reviews(20)))
    out, last, rows = run_public(folder, tmp_path / "ws", "train.py", "config/train_shakespeare_char.py",
                                 "--device=cpu", "--compile=False", "--dtype=float32", "--eval_iters=2",
                                 "--log_interval=1", "--block_size=32", "--batch_size=4", "--n_layer=1", "--n_head=2",
                                 "--n_embd=32", "--max_iters=12", "--lr_decay_iters=12", "--warmup_iters=2",
                                 "--dropout=0.0", "--eval_interval=6", "--always_save_checkpoint=True",
                                 "--out_dir=out")  # fmt: skip
    assert [int(r[1]) for r in rows] == [3, 6, 9, 12, 13]
    at_save = next(int(r[0]) + 1 for r in rows if r[1] == "12")  # the version of the round after step 12
    assert at_save == last - 1

    def model_of_checkpoint(path: Path) -> dict[str, torch.Tensor]:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        assert checkpoint["iter_num"] == 12
        return checkpoint["model"]

    assert_identical_and_hub(out, "out/ckpt.pt", model_of_checkpoint, at_save)
    assert_first_losses_differ(out, r"^iter 0: loss (\S+),")


# -- huggingface/transformers: examples/pytorch/language-modeling/run_clm.py ---------------------


@needs_data
def test_transformers_run_clm(tmp_path: Path, small_vocab_data: Path) -> None:
    """The example's ``python run_clm.py --model_type gpt2 --config_overrides ... --tokenizer_name
    ... --train_file ... --do_train --output_dir ...``: a GPT-2 of one layer trained from scratch,
    6 steps of 4 blocks of 32 tokens (syncs after steps 3 and 6), on a text file of reviews, with
    GPT-2's tokenizer cut to 1,025 tokens (conftest). It saves ``save_model()`` after ``train()``:
    ``out/model.safetensors`` holds the hub's last version."""
    folder = script_folder(tmp_path, "run_clm")
    (folder / "train.txt").write_text("\n".join(reviews(12)) + "\n")
    overrides = "n_layer=1,n_head=2,n_embd=32,n_positions=64,vocab_size=1025,bos_token_id=1024,eos_token_id=1024"
    out, last, _ = run_public(folder, tmp_path / "ws", "run_clm.py", "--model_type", "gpt2", "--config_overrides",
                              overrides, "--tokenizer_name", str(small_vocab_data / "gpt2-tokenizer"),
                              "--train_file", "train.txt", "--do_train", "--block_size", "32",
                              "--per_device_train_batch_size", "4", "--max_steps", "6", "--output_dir", "out",
                              "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
                              "--disable_tqdm", "true", HF_HOME=str(tmp_path / "hf"), **HF_OFFLINE)  # fmt: skip
    assert last == 2
    assert_identical_and_hub(out, "out/model.safetensors", lambda p: safetensors.torch.load_file(str(p)), last)
    assert_first_losses_differ(out, r"'loss': '?([\d.]+)")


# -- pytorch/examples: word_language_model --------------------------------------------------------


def model_of_pickle(folder: Path) -> Callable[[Path], dict[str, torch.Tensor]]:
    """The state of a module saved whole (``torch.save(model, f)``), its class found in ``folder``."""

    def load(path: Path) -> dict[str, torch.Tensor]:
        sys.path.insert(0, str(folder))
        try:
            return torch.load(path, map_location="cpu", weights_only=False).state_dict()
        finally:
            sys.path.remove(str(folder))
            sys.modules.pop("model", None)  # nanoGPT's model.py has the same name

    return load


@needs_data
def test_pytorch_examples_word_language_model(tmp_path: Path) -> None:
    """README's ``python main.py --epochs 6`` made tiny: a 1-layer LSTM, one epoch over a corpus of
    2 reviews (10 steps of 4 x 8 words, syncing every 3), stepped
    by hand (no ``--use-optimizer``: ``p.data.add_(p.grad, alpha=-lr)`` after ``backward()``).
    It saves ``torch.save(model, f)`` at the end of the epoch, after its last step, to ``--save``
    (``model.pt``, relative to its working folder), then loads it back for the test loss."""
    folder = script_folder(tmp_path, "word_language_model")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, (count, skip) in {"train.txt": (2, 0), "valid.txt": (1, 2), "test.txt": (1, 3)}.items():
        (corpus / name).write_text("\n".join(reviews(count, skip)) + "\n")
    out, last, _ = run_public(folder, tmp_path / "ws", "main.py", "--data", str(corpus), "--emsize", "16",
                                 "--nhid", "16", "--nlayers", "1", "--epochs", "1", "--bptt", "8", "--batch_size",
                                 "4", "--dropout", "0.0", "--log-interval", "1")  # fmt: skip
    assert_identical_and_hub(out, "model.pt", model_of_pickle(folder), last)
    # --log-interval 1 prints from batch 1 on (batch 0 is never printed): the first line's loss
    # is the first two steps' sum; its ppl (exp of it, 2 decimals) tells peers apart
    assert_first_losses_differ(out, r"\|\s+loss\s+(\S+)\s+\|\s+ppl\s+(\S+)")
