"""train/finetune_gpt2.py end to end: an embedded hub and 2 peers, the serial baseline, errors.

The runs use a tiny random GPT-2 on a few dozen IMDB reviews from the offline data, with GPT-2's
tokenizer cut to 1,025 tokens (``small_vocab_data`` in conftest: the full vocabulary's output layer
was ~98% of the compute), so each takes seconds of CPU, most of it importing torch and transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import SHARED_DATA, needs_data

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "train" / "finetune_gpt2.py"
DATA = SHARED_DATA


def small(data: Path) -> list[str]:
    """Tiny and short: a 0.23M-parameter GPT-2 (3.4M with the full tokenizer: ``small_vocab_data``)."""
    return [
        "--model-config", "tiny",
        "--dataset", str(data / "imdb"),
        "--tokenizer", str(data / "gpt2-tokenizer"),
        "--train-samples", "60", "--val-samples", "6", "--test-samples", "6",
        "--batch-size", "16", "--max-steps", "12", "--lr", "3e-3", "--eval-every", "2",
    ]  # fmt: skip


def run_script(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO
    )


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("finetune_gpt2", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_data
def test_two_local_peers_end_identical_and_learn(tmp_path: Path, small_vocab_data: Path) -> None:
    """Under the launcher, with the serial baseline after the peers: its check, results and plot;
    the serial run's checkpoints scored afterwards (``--save-every``, ``--score``: bench/ttq.py's)."""
    out = tmp_path / "run"
    flags = ["--local-peers", "2", "--serial-baseline", "--sync-every", "4", "--threads", "1", "--save-every", "4"]
    proc = run_script(*flags, "--output-dir", str(out), *small(small_vocab_data))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    peers = {p: json.loads((out / p / "results.json").read_text()) for p in ("peer-0", "peer-1")}

    # Every peer's final weights are bit-identical, and equal to the hub's last version.
    assert results["weights_identical"] and results["weights_equal_hub"]
    assert {f["weights_sha256"] for f in results["final"].values()} == {results["hub_weights_sha256"]}
    assert {p["weights_sha256"] for p in peers.values()} == {results["hub_weights_sha256"]}
    assert results["hub_version"] == 3  # 12 steps, a sync every 4
    assert all(f["version"] == 3 for f in results["final"].values())
    assert all(p["final_version"] == 3 and p["steps"] == 12 for p in peers.values())
    assert {p["rank"] for p in peers.values()} == {0, 1}

    # One row per round, from the hub: each peer's validation perplexity rides with its update.
    rows = results["rounds"]
    assert [(r["round"], r["version"], r["step"]) for r in rows] == [(0, 1, 4), (1, 2, 8), (2, 3, 12)]
    assert all(r["participants"] == 2 and r["samples"] == 64 and r["bytes_up"] > 0 for r in rows)
    assert all(r["metrics"][p]["eval_ppl"] > 1 for r in rows for p in ("peer-0", "peer-1"))

    # After a sync both peers hold the same weights: rank 0 alone evaluates them (rank 1 only its
    # final ones, to the same figure); between syncs (--eval-every 2) both do, and they drift apart.
    evals = {r["rank"]: {e["step"]: e["val_ppl"] for e in r["evals"]} for r in peers.values()}
    assert list(evals[0]) == [0, 2, 4, 6, 8, 10, 12] and list(evals[1]) == [2, 6, 10, 12]
    assert evals[0][12] == evals[1][12] and evals[0][2] != evals[1][2]
    assert evals[0][12] < evals[0][0]  # it learned
    rank1 = next(p for p, r in peers.items() if r["rank"] == 1)
    rounds = [json.loads(line) for line in (out / rank1 / "rounds.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rounds if r["event"] == "round" and "val_ppl" not in r] == [4, 8, 12]

    # The table goes to stdout as rounds complete; the check and each process's last line follow.
    assert "identical across peers: yes" in proc.stdout and "equal to the hub's version 3: yes" in proc.stdout
    assert sum(1 for line in proc.stdout.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])) == 3
    assert "peer-1: final: validation perplexity" in proc.stdout and "serial: final: validation" in proc.stdout
    assert (out / "eval_ppl.png").stat().st_size > 10_000  # the peers' curves and the serial one
    for peer in ("peer-0", "peer-1", "serial"):
        assert (out / peer / "model" / "model.safetensors").exists()
        assert (out / peer / "model" / "config.json").exists() and (out / peer / "config.json").exists()
    assert results["wall_seconds"]["serial"] > 0

    # The serial baseline (the same command line, --no-hub): alone, it learns, and saves what a run
    # saves. (It was a test of its own, one more reference-job process: docs/TESTING.md, merged scenarios.)
    serial = json.loads((out / "serial" / "results.json").read_text())
    assert serial["world_size"] == 1 and serial["syncs"] == 0 and serial["steps"] == 12
    evals = serial["evals"]
    assert [e["step"] for e in evals] == [0, 2, 4, 6, 8, 10, 12]
    assert evals[-1]["val_ppl"] < evals[0]["val_ppl"]
    assert serial["final_test_ppl"] > 1
    config = json.loads((out / "serial" / "config.json").read_text())
    assert config["per_peer_batch"] == 16 and config["model_config"] == "tiny" and config["threads"] == 1
    rows = map(json.loads, (out / "serial" / "rounds.jsonl").read_text().splitlines())
    assert [r["step"] for r in rows if "val_ppl" in r] == [e["step"] for e in evals]  # written as it trains

    # The evaluator, after the run: the same validation reviews, each checkpoint with its step and time.
    proc = run_script("--score", str(out / "serial" / "checkpoints"), "--output-dir", str(tmp_path / "score"),
                      *small(small_vocab_data))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scores = [json.loads(line) for line in (tmp_path / "score" / "scores.jsonl").read_text().splitlines()]
    assert [int(s["step"]) for s in scores] == [4, 8, 12] and all(float(s["time"]) > 0 for s in scores)
    assert scores[-1]["val_ppl"] == pytest.approx(serial["final_val_ppl"], rel=1e-5)


def test_sync_every_0_is_the_serial_baseline_as_no_hub_is() -> None:
    """The serial baseline's two spellings (the run of it: the launcher's, in the test above)."""
    script = load_script()
    for flags in (["--sync-every", "0"], ["--no-hub", "--sync-every", "4"], ["--no-hub"]):
        args = script.build_parser().parse_args(flags)
        script.check_args(args)
        assert (args.sync_every, args.hub_mode, args.policy, args.round_samples) == (0, False, None, None), flags


@needs_data
def test_a_samples_run_trains_until_the_run_has_seen_its_epochs(tmp_path: Path, small_vocab_data: Path) -> None:
    """--round-samples: rounds close on the peers' summed samples, and every peer trains (cycling
    its shard) until the run as a whole has trained --epochs of data, then stops at one version."""
    out = tmp_path / "samples"
    flags = [f for f in small(small_vocab_data) if f not in ("--max-steps", "12")]
    flags[flags.index("--train-samples") + 1] = "20"
    proc = run_script("--local-peers", "2", "--round-samples", "64", "--epochs", "1", "--output-dir", str(out), *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["weights_identical"] and results["weights_equal_hub"]
    peers = [json.loads((out / p / "results.json").read_text()) for p in ("peer-0", "peer-1")]
    budget = peers[0]["config"]["sample_budget"]
    assert peers[0]["config"]["run_policy"] == "samples" and budget == peers[0]["config"]["train_blocks"]
    samples = [r["samples"] for r in results["rounds"]]
    # Stopped at the round that reached the budget: not one before, not one after. (How far that round
    # overshoots depends on how fast peers notice it is due, which a loaded machine stretches.)
    assert sum(samples[:-1]) < budget <= sum(samples)
    assert all(r["samples"] >= 64 for r in results["rounds"])  # each round closed on its target
    assert {p["final_version"] for p in peers} == {results["hub_version"]} == {len(results["rounds"])}
    assert {f["version"] for f in results["final"].values()} == {results["hub_version"]}


@pytest.mark.parametrize(
    "flags",
    [
        ["--dataset", str(DATA / "imdb"), "--tokenizer", "no-such-org/no-such-tokenizer"],
        ["--dataset", "no-such-org/no-such-dataset", "--tokenizer", str(DATA / "gpt2-tokenizer")],
    ],
    ids=["tokenizer", "dataset"],
)
@needs_data
def test_unreachable_hub_id_fails_in_one_line(flags: list[str], tmp_path: Path) -> None:
    """Before the model and the Trainer are imported: the reviews load first, then the tokenizer."""
    proc = run_script("--no-hub", "--output-dir", str(tmp_path), *flags, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: cannot load") and "no-such-org" in lines[0]
    assert "--dataset ../shared/data/imdb --tokenizer ../shared/data/gpt2-tokenizer" in lines[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "give --hub URL"),
        (["--local-peers", "2", "--hub", "http://x:1"], "drop --hub"),
        (["--local-peers", "2", "--no-hub"], "--sync-every > 0"),
        (["--serial-baseline", "--no-hub"], "goes with --local-peers"),
        (["--no-hub", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["--local-peers", "2", "--round-samples", "64", "--sync-every", "5"], "drop --sync-every"),
        (["--local-peers", "2", "--policy", "async"], "needs --round-samples"),
        (["--local-peers", "2", "--policy", "barrier", "--round-samples", "8"], "goes with --policy samples"),
        (["--local-peers", "2", "--round-samples", "-1"], "must be >= 0"),
        (["--no-hub", "--lr-scaling-warmup", "-1"], "--lr-scaling-warmup must be >= 0"),
        (["--local-peers", "2", "--sync-every", "auto", "--sync-schedule", "5:60,15"], "exclude each other"),
        (["--local-peers", "2", "--sync-every", "auto", "--utilization", "1.5"], "--utilization must be > 0 and < 1"),
        (["--local-peers", "2", "--sync-every", "10", "--utilization", "0.9"], "give --sync-every auto, not 10"),
    ],
)
def test_bad_flag_combinations_fail_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert load_script().main(flags) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_codec_takes_any_spec_with_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    parser = load_script().build_parser()
    assert parser.parse_args(["--codec", "topk:chunk=16,k=2,bits=2"]).codec == "topk:chunk=16,k=2,bits=2"
    assert parser.parse_args(["--codec", "topk:k=1,chunk=4"]).codec == "topk"  # the hub's spelling
    assert parser.parse_args(["--codec", "int8:block=64"]).codec == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--codec", "topk:k=9"])
    assert "k must be an integer in [1, 4]" in capsys.readouterr().err


def test_peers_get_the_command_line_without_the_launchers_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script()
    argv = ["--local-peers", "3", "--serial-baseline", "--model-config", "small", "--output-dir=o", "--lr", "0.001"]
    argv += ["--token", "t", "--threads", "2"]
    assert script.peer_argv(argv) == ["--model-config", "small", "--lr", "0.001", "--threads", "2"]
    # What the launcher sets is what the peer reads instead (the token stays out of `ps`).
    env = {"WEIGHTSYNC_HUB": "http://127.0.0.1:5", "WEIGHTSYNC_RUN": "r", "WEIGHTSYNC_PEER": "peer-2"}
    env.update(WEIGHTSYNC_TOKEN="t", WEIGHTSYNC_PEER_DIR="o/peer-2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = script.build_parser().parse_args(script.peer_argv(argv))
    script.check_args(child)
    assert (child.hub, child.run, child.peer, child.token, child.output_dir) == tuple(env.values())
    assert child.local_peers == 0 and not child.serial_baseline and child.lr == 0.001


def test_under_torchrun_the_reference_job_says_what_to_use_instead(tmp_path: Path) -> None:
    """It shards data by the hub's rank, one process per peer: several ranks would train one shard
    as several peers. A one-line error, before any data is loaded or a hub contacted."""
    env = {"WORLD_SIZE": "2", "RANK": "0"}
    proc = run_script("--hub", "http://127.0.0.1:9", "--output-dir", str(tmp_path), *small(DATA), env=env, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: train/finetune_gpt2.py runs one process per peer, not under torchrun (WORLD_SIZE=2); "
        "use SyncCallback in your own torchrun script"
    ]


@needs_data
def test_cached_blocks_are_the_fresh_ones_and_any_change_misses(
    tmp_path: Path, small_vocab_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tokenized-data cache (what lets a restarted peer skip the parquet and the tokenizer): a hit
    gives the very blocks a fresh tokenization gives, without pickle; whatever changes the tokens misses."""
    import datasets
    import numpy as np
    from transformers import AutoTokenizer

    script = load_script()
    flags = ["--no-hub", "--cache-dir", str(tmp_path / "cache"), *small(small_vocab_data)]
    args = script.build_parser().parse_args(flags)
    path = script.cache_file(args)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    texts = script.load_texts(args, datasets)
    fresh = tuple(script.to_blocks(tokenizer, t["text"], args.block_size) for t in texts)
    ids = [t for seq in tokenizer(list(texts[0]["text"]))["input_ids"] for t in seq]  # the recipe, by hand
    assert fresh[0].tolist() == [ids[i : i + 20] for i in range(0, len(ids) - 19, 20)]

    assert script.read_blocks(path) is None  # none yet: a miss, nothing said
    script.write_blocks(path, fresh)
    hit = script.read_blocks(path)
    assert hit is not None and [(a.dtype, a.tolist()) for a in hit] == [(np.int32, a.tolist()) for a in fresh]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    with np.load(path, allow_pickle=False) as f:  # plain arrays: nothing to unpickle
        assert sorted(f.files) == ["test", "train", "val"]
    assert capsys.readouterr().err == ""

    def key(*change: str, tokenizer: Path | None = None) -> Path | None:
        changed = [*flags, *change] + (["--tokenizer", str(tokenizer)] if tokenizer else [])
        return script.cache_file(script.build_parser().parse_args(changed))

    assert key() == path and key("--output-dir", "elsewhere", "--lr", "1") == path  # the tokens do not change
    for change in (["--block-size", "21"], ["--seed", "7"], ["--train-samples", "61"], ["--test-samples", "7"]):
        assert key(*change) not in (path, None), change
    other = tmp_path / "tokenizer"  # the same files but one merge fewer
    other.mkdir()
    for f in (small_vocab_data / "gpt2-tokenizer").iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    assert key(tokenizer=other) == path  # the tokenizer's contents count, not its folder
    merges = (other / "merges.txt").read_text().splitlines()
    (other / "merges.txt").write_text("\n".join(merges[:-1]) + "\n")
    assert key(tokenizer=other) not in (path, None)
    assert key("--cache-dir", "") is None and key("--dataset", "imdb") is None  # no cache; a Hub id's data can change


@needs_data
def test_a_damaged_cache_is_rebuilt_and_an_unwritable_one_costs_a_line(
    tmp_path: Path, small_vocab_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache file cut short (a disk full, a copy broken off) is said in one line and written anew
    by a real run; a cache folder that cannot be written is said in one line and the run goes on."""
    import numpy as np

    script = load_script()
    flags = ["--no-hub", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out")]
    flags += [*small(small_vocab_data), "--max-steps", "1", "--eval-every", "0"]
    path = script.cache_file(script.build_parser().parse_args(flags))
    path.parent.mkdir()
    blocks = (np.arange(40, dtype=np.int32).reshape(2, 20),) * 3
    script.write_blocks(path, blocks)
    path.write_bytes(path.read_bytes()[:-100])
    proc = run_script(*flags)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "data cache" in line]
    assert said == [f"data cache {path} is unreadable (BadZipFile: File is not a zip file): tokenizing again"]
    rebuilt = script.read_blocks(path)
    assert rebuilt is not None and json.loads((tmp_path / "out" / "config.json").read_text())["train_blocks"] == len(
        rebuilt[0]
    )

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    script.write_blocks(blocked / "blocks.npz", blocks)  # its folder would be a file
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cannot write the data cache in {blocked} (FileExistsError: File exists): not cached"]
