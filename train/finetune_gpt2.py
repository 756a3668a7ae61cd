"""Fine-tune GPT-2 on IMDB reviews with N peers that average their weights through a weightsync hub.

The reference job: a ``transformers.Trainer`` plus one ``SyncCallback``. Its defaults are the origin
report's setup: pretrained ``gpt2``; IMDB (20,000 train and 5,000 validation reviews from the train
split, the 25,000 test reviews) concatenated and cut into blocks of 20 tokens; Adam at 5e-4 (constant),
4 epochs, a global batch of 256 blocks split across the peers; perplexity = exp(eval loss).

One peer of a run (start the hub first, on a machine every peer can reach)::

    python -m syncserver serve --host 0.0.0.0 --port 8000 --data-dir hub-data --min-peers 2
    python train/finetune_gpt2.py --hub http://HUB:8000 --run imdb-gpt2 --sync-every 1000   # on each peer

Everything on one machine: ``--local-peers K`` runs the rest of the command line as K peers under
:func:`syncserver.local.launch` (an embedded hub, a row per round, the check that every peer ended
bit-identical to the hub's last version, ``results.json``, ``eval_ppl.png``). This one trains a
random-init 4-layer GPT-2 for 69 steps per peer, 7 rounds: about 7.5 CPU-minutes, 4 minutes on an idle
2-core machine (``--serial-baseline`` adds the serial curve, at twice the time)::

    python train/finetune_gpt2.py --local-peers 2 --model-config small \\
        --dataset ../shared/data/imdb --tokenizer ../shared/data/gpt2-tokenizer \\
        --train-samples 300 --val-samples 16 --test-samples 50 --epochs 1 --batch-size 64 \\
        --lr 1e-3 --sync-every 10 --eval-every 5

The serial baseline is ``--no-hub`` (or ``--sync-every 0``). Offline: ``--dataset DIR`` (``train.parquet``,
``test.parquet``), ``--tokenizer DIR``, ``--model DIR`` or ``--model-config``; the HF offline variables are
then set, and the tokenized reviews are cached in ``--cache-dir`` (a restarted peer skips them). Validation
is not sharded: after each sync all peers hold bit-identical weights, so rank 0 alone evaluates them (the
others at the end, for their ``final_val_ppl``); every peer also evaluates every ``--eval-every`` steps.
``--no-eval`` evaluates nothing while training; ``--save-every N`` keeps the weights with their time and
``--score DIR`` evaluates such checkpoints, or a hub's kept versions, afterwards (``bench/ttq.py``).

Outputs in ``--output-dir`` (a launcher's ``WEIGHTSYNC_*`` variables are the defaults of ``--hub``,
``--run``, ``--peer``, ``--token``, ``--output-dir``): ``config.json``, ``rounds.jsonl`` (a line per
evaluation and sync, as training goes), ``results.json``, ``model/``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from syncclient.hooks.settings import flag_name  # the standard library only, as these
from syncclient.peerlr import DEFAULT_PEER_LR, LR_SCALINGS
from syncclient.preemption import METADATA_URL, MODES
from syncclient.schedule import SyncSchedule
from syncwire.runsettings import paired_interval, settle

STARTED = time.monotonic()  # the start-up line's zero (bench/restart.py times from the process's start)
MARKS: list[tuple[str, float]] = []  # each phase of the start-up and its end

OFFLINE_HINT = "use local files instead, e.g. --dataset ../shared/data/imdb --tokenizer ../shared/data/gpt2-tokenizer "
OFFLINE_HINT += "--model-config small"
MODEL_CONFIGS: dict[str, dict[str, Any]] = {  # random-init shapes for --model-config (vocab: the tokenizer's)
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2},
    "small": {"n_layer": 4, "n_embd": 256, "n_head": 4},
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},  # the 124M GPT-2 shape
}


class Fail(Exception):
    """An error the user can fix; printed as one line, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        description="Fine-tune GPT-2 on IMDB with peers that average weights through a weightsync hub.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # --local-peers hands its own argv to the peers: every flag spelled out
    )
    how = "every --sync-every optimizer steps, on a --sync-schedule, or (samples and async policies) whenever the "
    how += "peers together trained --round-samples: peers of unequal speed then train until the run saw --epochs"
    add = p.add_argument_group("run", f"which run to join and how often to sync: {how}").add_argument
    add("--hub", default=env("WEIGHTSYNC_HUB"), help="hub base URL, e.g. http://HUB:8000 [$WEIGHTSYNC_HUB]")
    add("--no-hub", action="store_true", help="train alone: the serial baseline")
    add(
        "--sync-every",
        type=every_arg,
        metavar="N|auto",
        help="optimizer steps between syncs; auto: the hub picks each interval; 0 = serial baseline (default: 1000)",
    )
    add("--utilization", type=float, help="with --sync-every auto: the share of time computing the hub keeps (0.95)")
    add("--sync-schedule", metavar="SPEC", help="5:60,15 = every 5 steps until step 60, then every 15 (sparse late)")
    add("--round-samples", type=int, help="a round closes once all peers together trained this many blocks")
    add("--policy", choices=["barrier", "samples", "async"], help="default: samples with --round-samples, else barrier")
    add("--max-staleness", type=int, help="async: refuse an update whose base is more versions old")
    add("--run", default=env("WEIGHTSYNC_RUN", "imdb-gpt2"), help="run name on the hub [$WEIGHTSYNC_RUN]")
    add("--peer", default=env("WEIGHTSYNC_PEER"), help="this peer's name (default: host-pid) [$WEIGHTSYNC_PEER]")
    add("--token", help="the run's bearer token (default: $WEIGHTSYNC_TOKEN, else $SYNC_TOKEN)")
    add("--codec", type=codec_spec, metavar="SPEC", help="a new run's codec: fp32, bf16, int8, int4, topk[:k=2,...]")
    add("--outer", choices=["avg", "diloco"], help="outer optimizer (default: the run's)")
    add("--min-peers", type=int, help="rendezvous size when creating the run (peers it waits for to start)")
    notice = "a spot VM's notice (auto: the cloud's) or SIGTERM: hand in the steps since the last sync, leave, exit 143"
    add("--preemption", choices=MODES, help=f"{notice} [$WEIGHTSYNC_PREEMPTION; default auto]")
    add("--metadata-url", help=f"the cloud's metadata server [$WEIGHTSYNC_METADATA_URL; default {METADATA_URL}]")
    add = p.add_argument_group("local", "run the hub and K peers on this machine").add_argument
    add("--local-peers", type=int, default=0, metavar="K", help="embedded hub + K peer processes")
    add("--serial-baseline", action="store_true", help="with --local-peers: also train serially, for the plot")
    add("--threads", type=int, help="torch threads per process (default: $OMP_NUM_THREADS, else cores)")
    add = p.add_argument_group("data", "IMDB, tokenized, concatenated and cut into blocks").add_argument
    add("--dataset", default="imdb", help="Hub id, or a folder with train.parquet and test.parquet")
    add("--tokenizer", default="gpt2", help="Hub id or folder")
    add("--block-size", type=int, default=20, help="tokens per training sample")
    add("--train-samples", type=int, default=20_000, help="training reviews (train split)")
    add("--val-samples", type=int, default=5_000, help="validation reviews (train split, held out)")
    add("--test-samples", type=int, default=25_000, help="test reviews (test split)")
    cache = env("WEIGHTSYNC_CACHE_DIR") or str(Path(env("XDG_CACHE_HOME") or Path.home() / ".cache") / "weightsync")
    add("--cache-dir", default=cache, help="tokenized data of local files; '' = none [$WEIGHTSYNC_CACHE_DIR]")
    add = p.add_argument_group("model").add_argument
    add("--model", default="gpt2", help="pretrained Hub id or folder (unless --model-config)")
    add("--model-config", choices=sorted(MODEL_CONFIGS), help="random init of this shape instead")
    add = p.add_argument_group("optimization").add_argument
    add("--lr", type=float, default=5e-4, help="Adam learning rate (serial's, at the global batch)")
    add("--lr-schedule", default="constant", choices=["constant", "linear", "cosine"], help="no warm-up")
    add("--epochs", type=float, default=4, help="passes over each peer's shard")
    add("--max-steps", type=int, default=0, help="optimizer steps per peer; >0 overrides --epochs")
    add("--batch-size", type=int, default=256, help="global batch in blocks, split across peers")
    add("--seed", type=int, default=1234, help="shared by all peers: data order, shards, init")
    add("--lr-scaling", choices=LR_SCALINGS, default=DEFAULT_PEER_LR.scaling, help="each peer's --lr x 1, sqrt(N) or N")
    add("--lr-scaling-warmup", type=int, help="steps over which that factor ramps in from 1 (default: one round)")
    add = p.add_argument_group("output").add_argument
    add("--output-dir", default=env("WEIGHTSYNC_PEER_DIR", "out/finetune_gpt2"), help="[$WEIGHTSYNC_PEER_DIR]")
    add("--eval-every", type=int, help="also evaluate every N steps (default: sync-every // 4; 0 = only at syncs)")
    add("--eval", action=argparse.BooleanOptionalAction, default=True, help="--no-eval: none while training")
    add("--save-every", type=int, default=0, help="N > 0: the weights every N steps, to OUTPUT/checkpoints")
    add("--score", metavar="DIR", help="evaluate every DIR/*.safetensors (checkpoints, hub versions), then exit")
    return p


def every_arg(text: str) -> int | str:
    """``--sync-every``: a number of steps, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps or auto, got {text!r}") from None


def codec_spec(spec: str) -> str:
    """A ``--codec`` value as the hub spells it; argparse's usage error for one that does not exist."""
    from syncwire import get_codec  # numpy only; keeps --help free of the SDK's imports

    try:
        return get_codec(spec).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def schedule(args: argparse.Namespace) -> SyncSchedule | None:
    """``--sync-schedule`` parsed (the flag stays text, for config.json); ``Fail`` when it is bad."""
    try:
        return SyncSchedule.parse(args.sync_schedule) if args.sync_schedule else None
    except ValueError as exc:
        raise Fail(f"--sync-schedule: {exc}") from None


def check_args(args: argparse.Namespace) -> None:
    """What argparse cannot check, and the defaults that follow from other flags."""
    args.token = args.token or os.environ.get("WEIGHTSYNC_TOKEN") or os.environ.get("SYNC_TOKEN")  # not in --help
    if args.sync_schedule is not None and (args.sync_every is not None or args.utilization is not None):
        raise Fail("--sync-schedule and --sync-every (or --utilization) exclude each other: give one")
    if args.sync_schedule is not None:  # a schedule stands for --sync-every: its first interval
        args.sync_every = schedule(args).first  # type: ignore[union-attr]
    if args.score or args.no_hub or args.sync_every == 0:  # the serial baseline: no hub, no rounds
        args.sync_every, args.sync_schedule, args.round_samples, args.policy = 0, None, None, None
        args.utilization = None
    else:
        run = {"policy": args.policy or "barrier", "round_samples": args.round_samples or None}  # 0: none
        try:  # the run settings' rules (a sample target alone means policy samples), in this script's flags
            args.policy = settle(run, ["policy"] if args.policy else [], say=flag_name)["policy"]
        except ValueError as exc:
            raise Fail(str(exc)) from None
        try:  # --utilization alone means auto; auto targets 0.95 unless told
            samples = args.policy == "samples"
            args.sync_every, args.utilization = paired_interval(args.sync_every, args.utilization, samples=samples,
                                                                say=flag_name)  # fmt: skip
        except ValueError as exc:
            raise Fail(str(exc)) from None
        if args.sync_every is None and args.policy != "samples":
            args.sync_every = 1000
    if (args.round_samples or 0) < 0 or (args.max_staleness or 0) < 0:
        raise Fail("--round-samples and --max-staleness must be >= 0")
    args.sync_every, args.hub_mode, k = args.sync_every or 0, args.policy is not None, args.local_peers
    if args.policy == "samples" and args.sync_every:
        raise Fail("a samples run syncs whenever its round is due: drop --sync-every (--utilization sizes its rounds)")
    args.auto = args.sync_every == "auto"
    if args.utilization is not None and not (0 < args.utilization < 1):
        raise Fail(f"--utilization must be > 0 and < 1, got {args.utilization}")
    steps = 1 if args.auto else args.sync_every
    if min(k, steps, args.eval_every or 0, args.lr_scaling_warmup or 0, args.save_every) < 0:
        raise Fail("--local-peers, --sync-every, --eval-every, --save-every and --lr-scaling-warmup must be >= 0")
    if k and args.hub:
        raise Fail("--local-peers runs its own hub: drop --hub")
    if k and not args.hub_mode:
        raise Fail("--local-peers needs --sync-every > 0 or --round-samples (use --serial-baseline for the serial run)")
    if args.serial_baseline and not k:
        raise Fail("--serial-baseline goes with --local-peers (for a serial run alone use --no-hub)")
    if args.hub_mode and not args.hub and not k:
        raise Fail("give --hub URL to join a run, --local-peers K to run K peers here, or --no-hub (serial)")
    if args.hub and not args.hub_mode:
        raise Fail("--hub needs --sync-every > 0 or --round-samples")
    for name in ("block_size", "batch_size", "train_samples", "val_samples", "test_samples"):
        if getattr(args, name) < 1:
            raise Fail(f"{flag_name(name)} must be >= 1")
    if args.eval_every is None:
        every = 0 if args.auto else args.sync_every  # auto: an evaluation after each sync, none between
        args.eval_every = max(1, every // 4) if every else (0 if args.hub_mode else 250)
    args.eval_every = args.eval_every if args.eval else 0


def peer_argv(argv: list[str]) -> list[str]:
    """A local peer's command line: ``argv`` without what only the launching process reads (the
    peers' hub, run, name, token and folder come from the launcher's ``WEIGHTSYNC_*``)."""
    launcher = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--local-peers", "--output-dir", "--token"):
        launcher.add_argument(flag)
    launcher.add_argument("--serial-baseline", action="store_true")
    return launcher.parse_known_args(argv)[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        if not args.local_peers:
            return train(args)
        from syncserver.local import LaunchError, launch

        command = [sys.executable, str(Path(__file__).resolve()), *peer_argv(argv)]
        serial = [*command, "--no-hub"] if args.serial_baseline else None
        where = {"peers": args.local_peers, "out": Path(args.output_dir), "run": args.run, "token": args.token}
        try:
            return launch(command, metric="eval_ppl", serial=serial, curve=curve, **where)
        except LaunchError as exc:
            note(f"error: {exc}")
            return exc.exit_code
    except Fail as exc:
        note(f"error: {exc}")
        return 1


def train(args: argparse.Namespace) -> int:
    """One peer of a run, or the serial baseline: setup -> data -> model -> join -> shard -> train -> save."""
    t0 = time.time()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # it shards by the hub's rank: one process per peer
        torchrun = f"one process per peer, not under torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']})"
        raise Fail(f"train/finetune_gpt2.py runs {torchrun}; use SyncCallback in your own torchrun script")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    local = [Path(name).is_dir() for name in (args.dataset, args.tokenizer, args.model)]
    if local[0] and local[1] and (args.model_config or local[2]):  # read at huggingface_hub's import: before it
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            os.environ.setdefault(var, "1")
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 0)  # a launcher sets OMP_NUM_THREADS
    if threads:
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # the tokenizer's thread pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # Huge pages for torch's big CPU buffers (the 50,257-wide logits): ~10% less CPU per step here.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

    # -- data: the same blocks on every peer, sharded after join. Cheapest first, so a wrong --dataset or
    # --tokenizer fails in seconds: `datasets` costs ~0.8 CPU-s to import on a 2-core VM, `transformers`
    # (with torch) ~2 more, the model and Trainer the rest (~4.5 in all).
    gc.disable()  # until set up: the collector walking the imports' objects was 0.47 of 2.85 CPU-s importing
    import datasets

    datasets.logging.set_verbosity_error()  # keep stderr for what matters
    datasets.disable_progress_bars()
    mark("datasets")
    cache = cache_file(args)  # a restarted peer reads its blocks back: no parquet, no tokenizing
    cached = read_blocks(cache) if cache else None
    texts = None if cached else load_texts(args, datasets)
    mark("texts")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tokenizer = fetch("tokenizer", args.tokenizer, transformers.AutoTokenizer.from_pretrained)
    mark("tokenizer")
    import torch
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback, TrainingArguments

    mark("torch")

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.set_seed(args.seed)

    if cached is None:
        cached = tuple(to_blocks(tokenizer, t["text"], args.block_size) for t in texts)  # type: ignore[union-attr]
        if cache:
            write_blocks(cache, cached)
    train_blocks, val_blocks, test_blocks = (as_dataset(b, datasets) for b in cached)
    mark("tokenized")

    # -- model -----------------------------------------------------------------------------------------------
    if args.model_config:
        shape = MODEL_CONFIGS[args.model_config] | {"bos_token_id": tokenizer.bos_token_id}
        config = transformers.GPT2Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **shape)
        model: Any = transformers.GPT2LMHeadModel(config)
    else:
        model = fetch("model", args.model, transformers.AutoModelForCausalLM.from_pretrained)
    mark("model")
    if args.score:
        return score(Path(args.score), model, val_blocks, out)

    # -- join the run: rank, world size, and the global version 0 loaded into the model -------------------
    client: Any = None
    rank, world_size, version = 0, 1, None
    if args.hub_mode:
        from syncclient import SyncClient, SyncError  # the SDK is needed only with a hub
        from syncclient.callbacks import SyncCallback

        names = ("codec", "outer", "min_peers", "policy", "round_samples", "max_staleness", "utilization")
        wanted = {k: vars(args)[k] for k in names} | ({"sync_every": "auto"} if args.auto else {})
        machine = {"preemption": args.preemption, "metadata_url": args.metadata_url}
        client = SyncClient(args.hub, run=args.run, peer=args.peer, token=args.token, **wanted, **machine)
        note(f"joining run {args.run!r} at {args.hub} ...")
        try:
            info = client.join(model)
        except SyncError as exc:
            raise Fail(f"cannot join run {args.run!r} at {args.hub}: {exc}") from None
        rank, world_size, version = info.rank, info.world_size, info.version
        announced = (os.environ.get("WEIGHTSYNC_RANK"), os.environ.get("WEIGHTSYNC_WORLD_SIZE"))
        if announced[0] is not None and announced != (str(rank), str(world_size)):
            client.leave()  # the launcher's rank is what its other peers shard by: another one overlaps shards
            said = f"WEIGHTSYNC_RANK={announced[0]} of WEIGHTSYNC_WORLD_SIZE={announced[1]}"
            raise Fail(f"the hub made this peer rank {rank} of {world_size}, the launcher said {said}")
        mark("joined")
        joined = f"joined as {info.peer!r}: rank {rank} of {world_size}, version {version}"
        note(f"{joined}, codec {info.codec}, outer {info.outer}")
    note("start-up " + ", ".join(f"{k} {t:.2f}" for k, t in MARKS) + f", cpu {time.process_time():.2f} s")
    gc.freeze()  # what setting up made stays out of every later collection
    gc.enable()

    try:
        # -- shard: one permutation everywhere, equal slices by the hub's rank, the remainder dropped (every
        # peer runs the same steps, hence rounds). With N peers a round covers --sync-every serial steps' samples.
        per_peer, batch = len(train_blocks) // world_size, args.batch_size // world_size
        shard = train_blocks.shuffle(seed=args.seed).select(range(rank * per_peer, (rank + 1) * per_peer))
        if batch < 1:
            raise Fail(f"--batch-size {args.batch_size} is smaller than the {world_size} peers")
        if per_peer < batch:
            raise Fail(f"only {per_peer} training blocks per peer for a batch of {batch}: raise --train-samples")
        # Samples and async runs (peers of unequal speed): a fast peer cycles through its shard more often, and
        # every peer stops once the run as a whole trained --epochs of data (SyncResult.run_samples; use a
        # constant --lr-schedule there: the Trainer cannot know how many steps a peer will take).
        policy = client.policy if client is not None else None
        budget = round(args.epochs * len(train_blocks)) if policy in ("samples", "async") else None
        epochs = args.epochs * world_size if budget else args.epochs
        # A peer (re)joining a barrier run at version v > 0 (restarted after a crash) trains only the steps the
        # others have left after v rounds, so that it ends in the run's last round, not alone after it.
        max_steps, plan = args.max_steps, schedule(args)
        if policy == "barrier" and version:
            total = args.max_steps or math.ceil(epochs * math.ceil(per_peer / batch))
            if args.auto:  # the intervals were the hub's: the steps the last round's updates were made at
                made = [u["metrics"].get("step", 0) for u in client.status()["updates"] if u["round"] == version - 1]
                done = int(max(made, default=client.run_samples // args.batch_size))
            else:
                done = plan.step_of_sync(version) if plan else version * args.sync_every
            plan = plan.from_step(done) if plan else None  # this Trainer counts its steps from 0 there
            max_steps = total - done
            if max_steps < 1:
                client.leave()
                raise Fail(f"run {args.run!r} is at version {version}, past the {total} steps of this command line")
            note(f"the run is {done} steps in: {max_steps} of {total} steps left")

        # -- the whole config, logged once and saved with the results (never the token: a secret) -------
        cfg = {k: v for k, v in vars(args).items() if k != "token"}
        cfg |= dict(run_policy=policy, sample_budget=budget, rank=rank, world_size=world_size, per_peer_batch=batch)
        cfg |= dict(train_blocks=len(train_blocks), shard_blocks=len(shard), val_blocks=len(val_blocks))
        cfg |= dict(test_blocks=len(test_blocks), n_params=sum(p.numel() for p in model.parameters()))
        cfg |= dict(torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads())
        cfg |= dict(device="cuda" if torch.cuda.is_available() else "cpu")
        note("config " + json.dumps(cfg))
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

        # -- train: the Trainer's loop, with SyncCallback between our two callbacks -----------------------
        class Perplexity(TrainerCallback):  # before SyncCallback: eval_ppl rides with the next update
            def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # type: ignore[no-untyped-def]
                if metrics and "eval_loss" in metrics:
                    metrics["eval_ppl"] = math.exp(metrics["eval_loss"])

        judge = args.eval and rank == 0  # after a sync every peer holds the same bits: one evaluates them

        class RoundLog(TrainerCallback):
            """After SyncCallback (which syncs in on_log): rank 0's evaluation right after each sync (the
            Trainer evaluates after logging: the merged weights), each evaluation and sync to rounds.jsonl
            and the console (the other ranks' rounds without perplexity), and the stop once the run trained
            its sample budget."""

            def __init__(self) -> None:
                self.rows: list[dict[str, Any]] = []
                self.version, self.synced, self.stop = version, None, False  # synced: (result, participants)
                (out / "rounds.jsonl").write_text("")

            def on_sync(self, result: Any) -> None:  # SyncCallback's on_sync
                try:  # how many peers' updates closed the round; a status hiccup must not stop training
                    closed = [r for r in client.status().get("rounds", []) if r.get("round") == result.version - 1]
                    self.synced = result, len(closed[0]["participants"]) if closed else None
                except Exception:
                    self.synced = result, None
                self.version, self.stop = result.version, budget is not None and result.run_samples >= budget

            def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
                if logs and "loss" in logs:
                    self.write({"event": "train", "step": state.global_step, "loss": logs["loss"]})
                if self.synced is not None:
                    control.should_evaluate = judge  # also where --eval-every falls on a sync step
                    if not judge:
                        self.report(state.global_step, None)
                control.should_training_stop |= self.stop
                return control

            def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # type: ignore[no-untyped-def]
                if metrics and "eval_loss" in metrics:  # not the test set's, at the end
                    self.report(state.global_step, metrics["eval_loss"])

            def report(self, step: int, loss: float | None) -> None:
                """An evaluation (``loss``) or a sync or both, as a row of rounds.jsonl and the console."""
                row: dict[str, Any] = {"event": "eval", "step": step, "version": self.version}
                if self.synced is not None:
                    (r, peers), self.synced = self.synced, None
                    row |= {"event": "round", "participants": peers, "bytes_up": r.bytes_up, "bytes_down": r.bytes_down}
                    row |= {"sync_seconds": round(r.seconds, 3), "caught_up": r.caught_up}
                if loss is not None:
                    row |= {"val_loss": loss, "val_ppl": math.exp(loss)}
                row["elapsed"] = round(time.time() - t0, 2)
                self.write(row)
                mb = {k: row[k] / 1e6 for k in ("bytes_up", "bytes_down") if k in row}
                cells = [step, self.version, row.get("val_ppl"), row.get("participants")]
                cells += [mb.get("bytes_up"), mb.get("bytes_down"), row.get("sync_seconds"), row["elapsed"]]
                row_cells = zip(cells, SPECS, WIDTHS, strict=True)
                print(
                    " ".join(f"{'-':>{w}}" if v is None else f"{v:>{w}{spec}}" for v, spec, w in row_cells), flush=True
                )

            def write(self, row: dict[str, Any]) -> None:
                self.rows.append(row)
                with (out / "rounds.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")

        class Checkpoints(TrainerCallback):
            """--save-every: the weights as the hub keeps its versions (safetensors, the synced names) with
            their step and time, for ``--score`` to evaluate after the run, off its clock (bench/ttq.py)."""

            def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
                if state.global_step % save_every == 0 or state.global_step == state.max_steps:
                    meta = {"step": str(state.global_step), "time": f"{time.time():.3f}"}
                    (out / "checkpoints").mkdir(exist_ok=True)
                    save_file(ModelView(model).export(), out / f"checkpoints/{state.global_step:08d}.safetensors", meta)

        from safetensors.numpy import save_file

        from syncclient.weights import ModelView

        log, save_every = RoundLog(), args.save_every
        callbacks: list[Any] = [Perplexity(), log, *([Checkpoints()] if save_every else [])]
        if client is not None:  # joined already: it syncs every N steps (or when the round is due), then leaves
            lr = {"lr_scaling": args.lr_scaling, "lr_scaling_warmup": args.lr_scaling_warmup}
            sync = SyncCallback(client=client, sync_every=plan or args.sync_every or None, on_sync=log.on_sync, **lr)
            callbacks.insert(1, sync)
        training = TrainingArguments(
            output_dir=str(out / "trainer"),
            per_device_train_batch_size=batch,
            per_device_eval_batch_size=max(batch, 64),
            learning_rate=args.lr,
            weight_decay=0.0,  # AdamW without decay is the report's Adam
            optim="adamw_torch",
            lr_scheduler_type=args.lr_schedule,
            num_train_epochs=epochs,
            max_steps=max_steps if max_steps > 0 else -1,
            eval_strategy="steps" if args.eval_every else "no",
            eval_steps=args.eval_every or None,
            logging_steps=max(1, min(50, args.eval_every or 50)),
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            seed=args.seed,
            prediction_loss_only=True,
            disable_tqdm=True,
        )
        data = {"train_dataset": shard, "eval_dataset": val_blocks, "data_collator": transformers.default_data_collator}
        trainer = Trainer(model=model, args=training, callbacks=callbacks, **data)
        for noisy in (PrinterCallback, ProgressCallback):  # they print every log dict; we print a table
            trainer.remove_callback(noisy)
        print(" ".join(f"{h:>{w}}" for h, w in zip(HEADER, WIDTHS, strict=True)), flush=True)
        if judge:
            trainer.evaluate()  # step 0: the version everybody starts from
        trainer.train()
        if args.eval and rank:
            trainer.evaluate()  # the final version, which rank 0 evaluated after the last sync: every peer's figure
    except BaseException:
        if client is not None:  # tell the hub now, so that the other peers stop waiting for us
            client.leave()
        raise

    # -- final: test perplexity, the model, the results, the weights' digest ------------------------------
    from syncwire.digest import left_line, weights_sha256

    test_loss = trainer.evaluate(eval_dataset=test_blocks, metric_key_prefix="test")["test_loss"]
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    digest = weights_sha256(ModelView(model).export())
    evals = [r for r in log.rows if "val_ppl" in r]
    version = client.version if client is not None else None  # SyncCallback left after its final sync
    results = dict(config=cfg, rank=rank, world_size=world_size, steps=trainer.state.global_step)
    results |= dict(syncs=sync.syncs if client is not None else 0, final_version=version)
    results |= dict(final_val_ppl=evals[-1]["val_ppl"] if evals else None, final_test_ppl=math.exp(test_loss))
    results |= dict(weights_sha256=digest, wall_seconds=round(time.time() - t0, 2))
    results |= dict(evals=[{k: r[k] for k in ("step", "version", "val_ppl")} for r in evals])
    results |= dict(rounds=[r for r in log.rows if r["event"] == "round"])
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    val = "-" if results["final_val_ppl"] is None else f"{results['final_val_ppl']:.2f}"
    ppl = f"validation perplexity {val}, test perplexity {results['final_test_ppl']:.2f}"
    at = f", at version {version}" if client is not None else ""
    print(f"final: {ppl}, {results['steps']} steps, {results['wall_seconds']:.0f} s{at}", flush=True)
    if client is not None:  # what the launcher checks against the hub's last version
        print(left_line(client.peer, client.run, client.version, digest), file=sys.stderr, flush=True)
    return 0


def score(folder: Path, model: Any, val: Any, out: Path) -> int:
    """The evaluator: each checkpoint in ``folder`` (``--save-every``'s, or a hub's kept versions: the
    same names) on this command line's validation reviews, to ``out/scores.jsonl`` with its metadata.
    Apart from training, so that scoring costs neither serial nor the peers time (bench/ttq.py). The
    Trainer's evaluation, as training's: its eval_loss divides by every label of a block, not the 19 of
    20 a causal LM predicts (transformers 5.24), so a plain mean of ``model(...).loss`` reads 5% higher."""
    import torch
    import transformers
    from safetensors import safe_open

    from syncclient.weights import ModelView

    settings = transformers.TrainingArguments(str(out / "trainer"), use_cpu=not torch.cuda.is_available(),
                                              per_device_eval_batch_size=64, prediction_loss_only=True,
                                              report_to=[], disable_tqdm=True)  # fmt: skip
    collate = transformers.default_data_collator
    trainer = transformers.Trainer(model=model, args=settings, eval_dataset=val, data_collator=collate)
    trainer.remove_callback(transformers.PrinterCallback)  # it prints each metrics dict
    view = ModelView(model)
    with (out / "scores.jsonl").open("w") as f:
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "np") as st:
                view.load({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 (not a dict)
                meta = st.metadata() or {}
            loss = trainer.evaluate()["eval_loss"]
            f.write(json.dumps({"file": path.name, **meta, "val_loss": loss, "val_ppl": math.exp(loss)}) + "\n")
    return 0


def load_texts(args: argparse.Namespace, datasets: Any) -> tuple[Any, Any, Any]:
    """Train, validation, test reviews (text only). Validation is held out of the train split."""
    source = Path(args.dataset)
    if source.is_dir():
        import pyarrow.parquet as pq

        missing = [f for f in ("train.parquet", "test.parquet") if not (source / f).is_file()]
        if missing:
            raise Fail(f"--dataset {source} has no {' or '.join(missing)}")
        # Read straight into memory: no datasets cache files, so concurrent peers never race on them.
        train, test = (
            datasets.Dataset(pq.read_table(source / f"{s}.parquet", columns=["text"])) for s in ("train", "test")
        )
    else:
        raw = fetch("dataset", args.dataset, datasets.load_dataset)
        train, test = raw["train"].select_columns(["text"]), raw["test"].select_columns(["text"])
    if args.train_samples + args.val_samples > len(train):
        given = f"--train-samples {args.train_samples} + --val-samples {args.val_samples}"
        raise Fail(f"{given} > {len(train)} reviews in the train split")
    train, n = train.shuffle(seed=args.seed), args.train_samples
    val, train = train.select(range(args.val_samples)), train.select(range(args.val_samples, n + args.val_samples))
    test = test.shuffle(seed=args.seed).select(range(min(args.test_samples, len(test))))
    return train, val, test


def cache_file(args: argparse.Namespace) -> Path | None:
    """Where this command line's tokenized blocks are cached: a file named by a hash of all that makes
    the tokens (the parquet files' path, size and mtime, the tokenizer files' contents and library,
    the settings that pick and cut the reviews). None without ``--cache-dir`` or local files (a Hub
    id's data can change under its name). The default, ``~/.cache/weightsync``, is per user and
    machine, survives the process (what a restart needs: a supervisor gives it a new output folder)
    and keeps clear of a data folder that is shared or read-only."""
    data, tok = Path(args.dataset), Path(args.tokenizer)
    files = [(data / f).resolve() for f in ("train.parquet", "test.parquet")]
    if not (args.cache_dir and tok.is_dir() and all(f.is_file() for f in files)):
        return None
    from importlib.metadata import version

    key = hashlib.sha256(f"blocks-v1 tokenizers {version('tokenizers')}".encode())
    for f in files:
        key.update(f"{f} {f.stat().st_size} {f.stat().st_mtime_ns}".encode())
    for f in sorted(p for p in tok.iterdir() if p.is_file()):
        key.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    settings = ("block_size", "train_samples", "val_samples", "test_samples", "seed")
    key.update(json.dumps([getattr(args, k) for k in settings]).encode())
    return Path(args.cache_dir) / f"blocks-{key.hexdigest()[:32]}.npz"


def read_blocks(path: Path) -> tuple[Any, ...] | None:
    """The cached (train, validation, test) blocks, or None: not there, or unreadable (a line says so,
    and the caller writes it anew). Read without pickle; the zip's CRCs catch a damaged file."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as f:
            blocks = tuple(f[k] for k in ("train", "val", "test"))
    except FileNotFoundError:
        return None
    except Exception as exc:
        why = (str(exc).splitlines() or [""])[0][:160]
        note(f"data cache {path} is unreadable ({type(exc).__name__}: {why}): tokenizing again")
        return None
    return blocks


def write_blocks(path: Path, blocks: tuple[Any, ...]) -> None:
    """``blocks`` to ``path`` whole or not at all: a file of this process's, renamed over it (two peers
    writing the same key write the same bytes; a kill mid-write leaves only the temporary file). A
    cache that cannot be written costs a line and the next start's tokenizing, not the run."""
    import numpy as np

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            np.savez(f, **dict(zip(("train", "val", "test"), blocks, strict=True)))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        note(f"cannot write the data cache in {path.parent} ({type(exc).__name__}: {exc.strerror}): not cached")


def to_blocks(tokenizer: Any, texts: list[str], size: int) -> Any:
    """The HF causal-LM recipe: concatenate 1,000 reviews at a time, cut into ``size``-token blocks,
    drop each thousand's tail. An int32 array, a block a row."""
    import numpy as np

    rows = [np.zeros((0, size), np.int32)]
    for i in range(0, len(texts), 1000):
        ids = tokenizer(texts[i : i + 1000], return_attention_mask=False)["input_ids"]
        flat = np.fromiter((t for seq in ids for t in seq), np.int32)
        rows.append(flat[: len(flat) // size * size].reshape(-1, size))
    return np.concatenate(rows)


def as_dataset(blocks: Any, datasets: Any) -> Any:
    """A block array as the Trainer's dataset: ``input_ids`` and ``labels``, one Arrow column twice."""
    import pyarrow as pa

    ids = pa.FixedSizeListArray.from_arrays(pa.array(blocks.reshape(-1)), blocks.shape[1])
    return datasets.Dataset(pa.table({"input_ids": ids, "labels": ids}))


def fetch(what: str, name: str, load: Any) -> Any:
    """``load(name)``; a one-line Fail that says what to give instead when it cannot."""
    try:
        return load(name)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise Fail(
            f"cannot load {what} {name!r} ({type(exc).__name__}: {reason}); no Hub access? {OFFLINE_HINT}"
        ) from None


# A peer's console: a row per evaluation (after a sync, the sync's figures too; "-" where none).
HEADER = ("step", "version", "val ppl", "peers", "MB up", "MB down", "sync s", "elapsed")
SPECS, WIDTHS = ("d", "d", ".2f", "d", ".2f", ".2f", ".2f", ".0f"), (7, 7, 10, 5, 9, 9, 7, 8)


def curve(folder: Path) -> list[tuple[int, float]]:
    """A process's validation perplexity per step (from its results.json): its curve in the launcher's plot."""
    return [(e["step"], e["val_ppl"]) for e in json.loads((folder / "results.json").read_text())["evals"]]


def mark(phase: str) -> None:
    MARKS.append((phase, time.monotonic() - STARTED))


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    code = main()
    # Exiting, the collector walks every object torch, transformers and datasets made: 1.2-1.4 s of CPU a
    # process on a 2-core VM. The OS takes the memory back anyway, atexit handlers still run, files are closed.
    gc.freeze()
    sys.exit(code)
