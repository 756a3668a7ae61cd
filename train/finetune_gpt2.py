"""Fine-tune GPT-2 on IMDB reviews with N peers that average their weights through a weightsync hub.

The reference job: a ``transformers.Trainer`` plus one ``SyncCallback``. Its defaults reproduce
the origin report's setup: pretrained ``gpt2``, IMDB text (20,000 train and 5,000 validation
reviews from the train split, the 25,000 test reviews), concatenated and cut into blocks of 20
tokens, Adam at 5e-4 (constant), 4 epochs, a global batch of 256 blocks split across the peers,
perplexity = exp(eval loss).

One peer of a run (start the hub first, on a machine every peer can reach)::

    python -m syncserver serve --host 0.0.0.0 --port 8000 --data-dir hub-data --min-peers 2
    python train/finetune_gpt2.py --hub http://HUB:8000 --run imdb-gpt2 --sync-every 1000   # on each peer

Everything on one machine: ``--local-peers K`` runs the rest of this command line as K peers
under the launcher of ``weightsync-run --local-peers`` (an embedded hub, one table row per round),
then writes ``results.json`` and a plot of validation perplexity per peer. This one trains a random-init
4-layer GPT-2 for 69 steps per peer, 7 rounds: about 7.5 CPU-minutes, so roughly 4 minutes on an
idle 2-core machine (add ``--serial-baseline`` for the serial curve, at twice the time)::

    python train/finetune_gpt2.py --local-peers 2 --model-config small \\
        --dataset ../shared/data/imdb --tokenizer ../shared/data/gpt2-tokenizer \\
        --train-samples 300 --val-samples 16 --test-samples 50 --epochs 1 --batch-size 64 \\
        --lr 1e-3 --sync-every 10 --eval-every 5

The launcher alone runs the same peers, without the final check and plot (each peer writes to
its own ``--out`` folder)::

    weightsync-run --local-peers 2 --out out/local --metric eval_ppl -- python train/finetune_gpt2.py \
        --sync-every 10 --model-config small ...

The serial baseline (one process, no hub; ``--sync-every 0`` means the same)::

    python train/finetune_gpt2.py --no-hub

No network? Point the flags at local files: ``--dataset DIR`` (a folder with ``train.parquet`` and
``test.parquet``), ``--tokenizer DIR``, and ``--model DIR`` or ``--model-config {tiny,small,gpt2}``
(random init). When every input is local the script sets the Hugging Face offline variables itself.

Data: every peer tokenizes the same reviews and cuts the same blocks, shuffles the blocks with
the shared ``--seed``, and trains on the slice ``rank`` of ``world_size`` equal slices (the remainder
is dropped so that every peer runs the same number of steps, hence the same rounds). Rank and
world size come from the hub, which assigns them by sorted peer name, so shards do not depend on
who joined first. The per-peer batch is ``--batch-size // world_size``: with N peers one round
covers as many samples as ``sync-every`` serial steps.

Peers of unequal speed: ``--round-samples S`` closes a round once the peers together trained S
blocks (the hub's ``samples`` policy; ``--policy async`` applies each update as it comes instead),
so a fast peer takes more steps per round than a slow one. Then the data is not split evenly in
time: every peer cycles through its shard and all stop once the run as a whole has trained
``--epochs`` of data (``epochs x train blocks`` samples, as the hub counts them), so the run sees
the samples a serial run would, sooner. Use a constant ``--lr-schedule`` there: the Trainer
cannot know how many steps a peer will take.

Validation is *not* sharded: every peer evaluates the same held-out reviews, right after every
sync and every ``--eval-every`` steps. At a sync all peers hold bit-identical weights, so their
curves touch exactly there; between syncs the gap between curves is the peers' drift and
nothing else (per-peer validation shards would add their own sampling noise on top). This costs
each peer a full validation pass per evaluation; shrink ``--val-samples`` on small machines.

Under a launcher (``weightsync-run --local-peers``, or this script's ``--local-peers``) the
``WEIGHTSYNC_*`` variables it sets are the defaults of ``--hub``, ``--run``, ``--peer``,
``--token`` and ``--output-dir``, and the peer checks that the hub gave it the rank and world
size the launcher announced.

Outputs (``--output-dir``): ``config.json``, ``results.json``, ``rounds.jsonl`` (one JSON line per
evaluation and sync, appended as training goes), ``val_ppl.png``, and the final model saved with
``save_pretrained`` (safetensors) in ``model/``. With ``--local-peers`` each peer writes those in
``peer-i/`` (its console output goes to ``peer-i.log``), the hub keeps its state in ``hub/``
(log in ``hub.log``), the serial baseline runs in ``serial/``, and the top-level ``results.json``
holds the launcher's rounds and checks that every peer's final weights are identical and equal to
the hub's last version.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from syncclient.peerlr import DEFAULT_PEER_LR, LR_SCALINGS  # the standard library only
from syncclient.schedule import SyncSchedule

OFFLINE_HINT = (
    "use local files instead, e.g. --dataset ../shared/data/imdb --tokenizer ../shared/data/gpt2-tokenizer "
    "--model-config small"
)
# Random-init model shapes for --model-config (vocab size comes from the tokenizer).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2},
    "small": {"n_layer": 4, "n_embd": 256, "n_head": 4},
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},  # the 124M GPT-2 shape
}


FINAL_KEYS = ("final_val_ppl", "final_test_ppl", "final_version", "steps", "syncs", "rank")


class Fail(Exception):
    """An error the user can fix; printed as one line, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        description="Fine-tune GPT-2 on IMDB with peers that average weights through a weightsync hub.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # --local-peers hands its own argv to the peers: every flag spelled out
    )
    g = p.add_argument_group("run", "which run to join and how often to sync")
    g.add_argument("--hub", default=env("WEIGHTSYNC_HUB"), help="hub base URL, e.g. http://HUB:8000 [$WEIGHTSYNC_HUB]")
    g.add_argument("--no-hub", action="store_true", help="train alone: the serial baseline")
    g.add_argument(
        "--sync-every",
        type=int,
        help="optimizer steps between syncs; 0 = serial baseline (default: 1000, or none with --round-samples)",
    )
    g.add_argument(
        "--sync-schedule",
        metavar="EVERY:UNTIL,...,EVERY",
        help="instead of --sync-every: an interval that changes over the run, e.g. 5:60,15 = every 5 "
        "optimizer steps until step 60, then every 15 (frequent early, sparse late)",
    )
    g.add_argument(
        "--round-samples",
        type=int,
        help="instead: a round closes once all peers together trained this many samples (blocks); peers of "
        "unequal speed then each send what they have, and train until the run has seen --epochs of data",
    )
    g.add_argument(
        "--policy",
        choices=["barrier", "samples", "async"],
        help="when rounds close (default: samples with --round-samples, else barrier); async: no rounds, "
        "each update is applied as it arrives (needs --round-samples: the samples of a whole outer step)",
    )
    g.add_argument("--max-staleness", type=int, help="async: refuse an update whose base is more versions old")
    g.add_argument("--run", default=env("WEIGHTSYNC_RUN", "imdb-gpt2"), help="run name on the hub [$WEIGHTSYNC_RUN]")
    g.add_argument(
        "--peer",
        default=env("WEIGHTSYNC_PEER"),
        help="this peer's name (default: host-pid); ranks follow sorted names [$WEIGHTSYNC_PEER]",
    )
    g.add_argument("--token", help="the run's bearer token (default: $WEIGHTSYNC_TOKEN, else $SYNC_TOKEN)")
    g.add_argument(
        "--codec",
        type=codec_spec,
        metavar="SPEC",
        help="wire codec of a new run, with parameters: fp32, bf16, int8, int4, topk, e.g. int8:block=128 or "
        "topk:chunk=16,k=2,bits=2 (default: the run's)",
    )
    g.add_argument("--outer", choices=["avg", "diloco"], help="outer optimizer (default: the run's)")
    g.add_argument("--min-peers", type=int, help="rendezvous size when creating the run (peers it waits for to start)")

    g = p.add_argument_group("local", "run the hub and K peers on this machine")
    g.add_argument("--local-peers", type=int, default=0, metavar="K", help="embedded hub + K peer processes")
    g.add_argument(
        "--serial-baseline", action="store_true", help="with --local-peers: also train serially, for the plot"
    )
    g.add_argument("--threads", type=int, help="torch threads per process (default: $OMP_NUM_THREADS, else cores)")

    g = p.add_argument_group("data", "IMDB, tokenized, concatenated and cut into blocks")
    g.add_argument("--dataset", default="imdb", help="Hub id, or a folder with train.parquet and test.parquet")
    g.add_argument("--tokenizer", default="gpt2", help="Hub id or folder")
    g.add_argument("--block-size", type=int, default=20, help="tokens per training sample")
    g.add_argument("--train-samples", type=int, default=20_000, help="training reviews (train split)")
    g.add_argument("--val-samples", type=int, default=5_000, help="validation reviews (train split, held out)")
    g.add_argument("--test-samples", type=int, default=25_000, help="test reviews (test split)")

    g = p.add_argument_group("model")
    g.add_argument("--model", default="gpt2", help="pretrained Hub id or folder (unless --model-config)")
    g.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), help="random init of this shape instead")

    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=float, default=5e-4, help="Adam learning rate")
    g.add_argument("--lr-schedule", default="constant", choices=["constant", "linear", "cosine"], help="no warm-up")
    g.add_argument("--epochs", type=float, default=4, help="passes over each peer's shard")
    g.add_argument("--max-steps", type=int, default=0, help="optimizer steps per peer; >0 overrides --epochs")
    g.add_argument("--batch-size", type=int, default=256, help="global batch in blocks, split across peers")
    g.add_argument("--seed", type=int, default=1234, help="shared by all peers: data order, shards, init")
    g.add_argument(
        "--lr-scaling",
        choices=LR_SCALINGS,
        default=DEFAULT_PEER_LR.scaling,
        help="each peer's learning rate with N peers: --lr x 1, x sqrt(N) or x N (--lr stays serial's at the global "
        "batch; syncclient.peerlr, bench/RESULTS.md issue 27)",
    )
    g.add_argument(
        "--lr-scaling-warmup",
        type=int,
        help="optimizer steps over which that factor ramps in from 1 (default: one round, --sync-every steps)",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--output-dir",
        default=env("WEIGHTSYNC_PEER_DIR", "out/finetune_gpt2"),
        help="everything this run writes [$WEIGHTSYNC_PEER_DIR]",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        help="also evaluate every N steps, between syncs (default: sync-every // 4; 0 = only at syncs)",
    )
    return p


def codec_spec(spec: str) -> str:
    """A ``--codec`` value as the hub spells it; argparse's usage error for one that does not exist."""
    from syncwire import get_codec  # numpy only; keeps --help free of the SDK's imports

    try:
        return get_codec(spec).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        return launch(args, argv) if args.local_peers else train_peer(args)
    except Fail as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def schedule(args: argparse.Namespace) -> SyncSchedule | None:
    """``--sync-schedule`` parsed (the flag stays text, for config.json); ``Fail`` when it is bad."""
    try:
        return SyncSchedule.parse(args.sync_schedule) if args.sync_schedule else None
    except ValueError as exc:
        raise Fail(f"--sync-schedule: {exc}") from None


def check_args(args: argparse.Namespace) -> None:
    # Not an argparse default: --help would print it.
    args.token = args.token or os.environ.get("WEIGHTSYNC_TOKEN") or os.environ.get("SYNC_TOKEN")
    if (args.round_samples or 0) < 0 or (args.max_staleness or 0) < 0:
        raise Fail("--round-samples and --max-staleness must be >= 0")
    if args.sync_schedule is not None:  # a schedule stands for --sync-every: its first interval
        if args.sync_every is not None:
            raise Fail("--sync-schedule and --sync-every exclude each other: give one")
        args.sync_every = schedule(args).first  # type: ignore[union-attr]
    if args.no_hub or args.sync_every == 0:  # the serial baseline: no hub, no rounds
        args.sync_every, args.sync_schedule, args.round_samples, args.policy = 0, None, None, None
    else:
        args.policy = args.policy or ("samples" if args.round_samples else "barrier")
        if args.policy != "barrier" and not args.round_samples:
            raise Fail(f"--policy {args.policy} needs --round-samples S (the samples of a round)")
        if args.policy == "barrier" and args.round_samples:
            raise Fail("--round-samples goes with --policy samples or async")
        if args.policy == "samples" and args.sync_every:
            raise Fail("a samples run syncs whenever its round is due: drop --sync-every")
        if args.sync_every is None and args.policy != "samples":
            args.sync_every = 1000
    args.sync_every = args.sync_every or 0
    args.hub_mode = args.policy is not None
    if args.local_peers < 0 or args.sync_every < 0 or (args.eval_every or 0) < 0 or (args.lr_scaling_warmup or 0) < 0:
        raise Fail("--local-peers, --sync-every, --eval-every and --lr-scaling-warmup must be >= 0")
    if args.local_peers and args.hub:
        raise Fail("--local-peers runs its own hub: drop --hub")
    if args.local_peers and not args.hub_mode:
        raise Fail("--local-peers needs --sync-every > 0 or --round-samples (use --serial-baseline for the serial run)")
    if args.serial_baseline and not args.local_peers:
        raise Fail("--serial-baseline goes with --local-peers (for a serial run alone use --no-hub)")
    if args.hub_mode and not args.hub and not args.local_peers:
        raise Fail("give --hub URL to join a run, --local-peers K to run K peers here, or --no-hub (serial)")
    if args.hub and not args.hub_mode:
        raise Fail("--hub needs --sync-every > 0 or --round-samples")
    if args.eval_every is None:
        args.eval_every = max(1, args.sync_every // 4) if args.sync_every else (0 if args.hub_mode else 250)
    for name in ("block_size", "batch_size", "train_samples", "val_samples", "test_samples"):
        if getattr(args, name) < 1:
            raise Fail(f"--{name.replace('_', '-')} must be >= 1")


# ---------------------------------------------------------------------------------------------
# One peer (or the serial baseline): setup -> data -> model -> join -> shard -> train -> save
# ---------------------------------------------------------------------------------------------


def train_peer(args: argparse.Namespace) -> int:
    t0 = time.time()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # One process per peer here (it shards the data by the hub's rank). SyncCallback serves a
        # torchrun group in any other Trainer script: docs/concepts/groups.md.
        raise Fail(
            "train/finetune_gpt2.py runs one process per peer, not under torchrun "
            f"(WORLD_SIZE={os.environ['WORLD_SIZE']}); use SyncCallback in your own torchrun script"
        )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    hub_mode = args.hub_mode

    # Offline switches are read when huggingface_hub is imported, so they go before the imports.
    local_inputs = [Path(args.dataset).is_dir(), Path(args.tokenizer).is_dir()]
    local_inputs.append(args.model_config is not None or Path(args.model).is_dir())
    if all(local_inputs):
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            os.environ.setdefault(var, "1")
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 0)  # a launcher sets OMP_NUM_THREADS
    if threads:
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # the tokenizer's thread pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # Huge pages for torch's big CPU buffers (the 50,257-wide logits): ~10% less CPU per step here,
    # most of it page-fault time in the kernel.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

    # -- data: the same blocks on every peer; sharded after join ---------------------------------
    # Cheapest first, so that a wrong --dataset or --tokenizer fails in seconds: the reviews need
    # only `datasets` (~0.8 CPU-s to import on a 2-core VM), the tokenizer `transformers` (which
    # imports torch: ~2 more), the model and Trainer the rest (~4.5 in all).
    import datasets

    datasets.logging.set_verbosity_error()  # keep stderr for what matters
    datasets.disable_progress_bars()
    train_texts, val_texts, test_texts = load_texts(args, datasets)

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    except Exception as exc:
        raise Fail(unreachable("tokenizer", args.tokenizer, exc)) from None

    import torch
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        PrinterCallback,
        ProgressCallback,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.set_seed(args.seed)

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"input_ids": tokenizer(batch["text"], return_attention_mask=False)["input_ids"]}

    def group_texts(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        # The HF causal-LM recipe: concatenate 1,000 reviews at a time, cut into blocks, drop the tail.
        ids = [t for seq in batch["input_ids"] for t in seq]
        n = len(ids) // args.block_size * args.block_size
        blocks = [ids[i : i + args.block_size] for i in range(0, n, args.block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    def to_blocks(texts: Any) -> Any:
        tokens = texts.map(tokenize, batched=True, remove_columns=texts.column_names)
        return tokens.map(group_texts, batched=True, batch_size=1000)

    train_blocks, val_blocks, test_blocks = (to_blocks(t) for t in (train_texts, val_texts, test_texts))

    # -- model ------------------------------------------------------------------------------------
    model: Any
    if args.model_config:
        shape = MODEL_CONFIGS[args.model_config]
        config = GPT2Config(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **shape,
        )
        model = GPT2LMHeadModel(config)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model)
        except Exception as exc:
            raise Fail(unreachable("model", args.model, exc)) from None
    n_params = sum(p.numel() for p in model.parameters())

    # -- join the run: learn rank and world size, load the global version 0 ------------------------
    client = callback = None
    rank, world_size, version = 0, 1, None
    if hub_mode:
        from syncclient import SyncClient, SyncError  # the SDK is needed only with a hub
        from syncclient.callbacks import SyncCallback

        client = SyncClient(
            args.hub,
            run=args.run,
            peer=args.peer,
            token=args.token,
            codec=args.codec,
            outer=args.outer,
            min_peers=args.min_peers,
            policy=args.policy,
            round_samples=args.round_samples,
            max_staleness=args.max_staleness,
        )
        note(f"joining run {args.run!r} at {args.hub} ...")
        try:
            info = client.join(model)
        except SyncError as exc:
            raise Fail(f"cannot join run {args.run!r} at {args.hub}: {exc}") from None
        rank, world_size, version = info.rank, info.world_size, info.version
        announced = (os.environ.get("WEIGHTSYNC_RANK"), os.environ.get("WEIGHTSYNC_WORLD_SIZE"))
        if announced[0] is not None and announced != (str(rank), str(world_size)):
            # The launcher's rank is what its other peers shard by: a different one overlaps shards.
            client.leave()
            raise Fail(
                f"the hub made this peer rank {rank} of {world_size}, the launcher said "
                f"WEIGHTSYNC_RANK={announced[0]} of WEIGHTSYNC_WORLD_SIZE={announced[1]}"
            )
        note(
            f"joined as {info.peer!r}: rank {rank} of {world_size}, version {version}, "
            f"codec {info.codec}, outer {info.outer}"
        )

    try:
        # Shard the training blocks: same permutation everywhere, equal slices, remainder dropped.
        per_peer = len(train_blocks) // world_size
        shard = train_blocks.shuffle(seed=args.seed).select(range(rank * per_peer, (rank + 1) * per_peer))
        batch = args.batch_size // world_size
        if batch < 1:
            raise Fail(f"--batch-size {args.batch_size} is smaller than the {world_size} peers")
        if per_peer < batch:
            raise Fail(f"only {per_peer} training blocks per peer for a batch of {batch}: raise --train-samples")

        # Peers of unequal speed (samples and async runs) do not split the data evenly in time: a
        # fast peer cycles through its shard more often, and every peer stops once the run as a
        # whole has trained --epochs of data (the hub counts it: SyncResult.run_samples).
        policy = client.policy if client is not None else None
        budget = round(args.epochs * len(train_blocks)) if policy in ("samples", "async") else None
        epochs = args.epochs * world_size if budget else args.epochs
        # A peer that (re)joins a barrier run at version v > 0 (restarted after a crash) finds the
        # run v rounds of --sync-every steps (or of --sync-schedule's) in: it trains only the steps
        # the others have left, so that it ends in the run's last round instead of training on alone after it.
        max_steps, plan = args.max_steps, schedule(args)
        if policy == "barrier" and version:
            total = args.max_steps or math.ceil(epochs * math.ceil(per_peer / batch))
            done = plan.step_of_sync(version) if plan else version * args.sync_every
            plan = plan.from_step(done) if plan else None  # this Trainer counts its steps from 0 there
            max_steps = total - done
            if max_steps < 1:
                client.leave()
                raise Fail(f"run {args.run!r} is at version {version}, past the {total} steps of this command line")
            note(f"the run is {done} steps in: {max_steps} of {total} steps left")

        cfg = dict(vars(args))
        cfg.update(
            run_policy=policy,
            sample_budget=budget,
            rank=rank,
            world_size=world_size,
            per_peer_batch=batch,
            train_blocks=len(train_blocks),
            shard_blocks=len(shard),
            val_blocks=len(val_blocks),
            test_blocks=len(test_blocks),
            n_params=n_params,
            torch=torch.__version__,
            transformers=transformers.__version__,
            device="cuda" if torch.cuda.is_available() else "cpu",
            threads=torch.get_num_threads(),
        )
        cfg.pop("token", None)  # a secret: never written to disk
        note("config " + json.dumps(cfg))
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

        # -- train ------------------------------------------------------------------------------------
        log_path = out / "rounds.jsonl"
        log_path.write_text("")
        record = RoundLog(log_path, t0, version)

        training_args = TrainingArguments(
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
            logging_strategy="steps",
            logging_steps=max(1, min(50, args.eval_every or 50)),
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            seed=args.seed,
            prediction_loss_only=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        # In this order: perplexity joins the eval metrics before SyncCallback takes them (to the
        # hub, with the next update: the launcher's table shows it), and RoundLog sees a sync
        # in the log event where SyncCallback made it.
        callbacks: list[Any] = [perplexity_callback(), record.callback()]
        if hub_mode:
            stop = budget_callback()

            # The client has joined already, so the callback does not join again; it syncs every N
            # steps, or when the round is due.
            def on_sync(result: Any) -> None:
                record.on_sync(result, round_participants(client, result.version - 1))
                if budget is not None and result.run_samples >= budget:
                    stop.reached = True

            callback = SyncCallback(
                client=client,
                sync_every=plan or args.sync_every or None,
                on_sync=on_sync,
                lr_scaling=args.lr_scaling,
                lr_scaling_warmup=args.lr_scaling_warmup,
            )
            callbacks[1:1] = [callback, stop]
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=shard,
            eval_dataset=val_blocks,
            data_collator=default_data_collator,
            callbacks=callbacks,
        )
        for noisy in (PrinterCallback, ProgressCallback):  # they print every log dict; we print a table
            trainer.remove_callback(noisy)
        record.print_header()
        trainer.evaluate()  # step 0: the version everybody starts from
        trainer.train()
    except BaseException:
        if client is not None:  # tell the hub now, so that the other peers stop waiting for us
            client.leave()
        raise

    # -- final: test perplexity, save, fingerprints -------------------------------------------------
    test_loss = trainer.evaluate(eval_dataset=test_blocks, metric_key_prefix="test")["test_loss"]
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    digest = weights_digest(synced_arrays(model))
    if client is not None:
        version = client.version  # the callback left the run after its final sync

    evals = [r for r in record.rows if r["event"] in ("eval", "round") and r.get("val_ppl") is not None]
    results = {
        "config": cfg,
        "rank": rank,
        "world_size": world_size,
        "steps": trainer.state.global_step,
        "syncs": callback.syncs if callback else 0,
        "final_version": version,
        "final_val_ppl": evals[-1]["val_ppl"] if evals else None,
        "final_test_ppl": math.exp(test_loss),
        "weights_sha256": digest,
        "wall_seconds": round(time.time() - t0, 2),
        "evals": [{k: r[k] for k in ("step", "version", "val_ppl")} for r in evals],
        "rounds": [r for r in record.rows if r["event"] == "round"],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot({args.peer or ("serial" if not hub_mode else f"rank {rank}"): results}, out / "val_ppl.png", args)
    print(
        f"final: validation perplexity {results['final_val_ppl']:.2f}, test perplexity "
        f"{results['final_test_ppl']:.2f}, {results['steps']} steps, {results['wall_seconds']:.0f} s"
        + (f", at version {version}" if client else ""),
        flush=True,
    )
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
            datasets.Dataset(pq.read_table(source / name, columns=["text"]))
            for name in ("train.parquet", "test.parquet")
        )
    else:
        try:
            raw = datasets.load_dataset(args.dataset)
        except Exception as exc:
            raise Fail(unreachable("dataset", args.dataset, exc)) from None
        train, test = raw["train"].select_columns(["text"]), raw["test"].select_columns(["text"])
    if args.train_samples + args.val_samples > len(train):
        raise Fail(
            f"--train-samples {args.train_samples} + --val-samples {args.val_samples} > "
            f"{len(train)} reviews in the train split"
        )
    train = train.shuffle(seed=args.seed)
    val = train.select(range(args.val_samples))
    train = train.select(range(args.val_samples, args.val_samples + args.train_samples))
    test = test.shuffle(seed=args.seed).select(range(min(args.test_samples, len(test))))
    return train, val, test


def perplexity_callback() -> Any:
    """A TrainerCallback that adds ``eval_ppl`` = exp(``eval_loss``) to the evaluation metrics."""
    from transformers import TrainerCallback  # imported by now; see train_peer

    class Perplexity(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # type: ignore[no-untyped-def]
            if metrics and "eval_loss" in metrics:
                metrics["eval_ppl"] = math.exp(metrics["eval_loss"])

    return Perplexity()


def budget_callback() -> Any:
    """A TrainerCallback that stops training once ``reached`` is set (the run's sample budget);
    after SyncCallback, so that the sync that reached it is logged first."""
    from transformers import TrainerCallback  # imported by now; see train_peer

    class Budget(TrainerCallback):
        reached = False

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if self.reached:
                control.should_training_stop = True
            return control

    return Budget()


class RoundLog:
    """Appends evaluations and syncs to rounds.jsonl and prints a row each.

    It also asks for an evaluation right after every sync: the SyncCallback syncs inside the
    Trainer's log event, and the Trainer evaluates after logging, so that evaluation sees the
    merged weights.
    """

    def __init__(self, path: Path, t0: float, version: int | None) -> None:
        self.path, self.t0 = path, t0
        self.rows: list[dict[str, Any]] = []
        self.synced: Any = None  # the SyncResult not yet written with its evaluation
        self.participants: int | None = None
        self.version = version  # the global version the weights are at (None: serial)

    def callback(self) -> Any:
        from transformers import TrainerCallback  # imported by now; see train_peer

        log = self

        class Callback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
                if logs and "loss" in logs:
                    log.write({"event": "train", "step": state.global_step, "loss": logs["loss"]})
                if log.synced is not None:  # a sync just happened: evaluate the merged weights
                    control.should_evaluate = True
                return control

            def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # type: ignore[no-untyped-def]
                if metrics and "eval_loss" in metrics:
                    log.evaluated(state.global_step, metrics["eval_loss"])

        return Callback()

    def on_sync(self, result: Any, participants: int | None) -> None:
        self.synced, self.participants = result, participants
        self.version = result.version

    def evaluated(self, step: int, loss: float) -> None:
        row: dict[str, Any] = {"event": "eval", "step": step, "version": self.version}
        if self.synced is not None:
            r, self.synced = self.synced, None
            row.update(
                event="round",
                participants=self.participants,
                bytes_up=r.bytes_up,
                bytes_down=r.bytes_down,
                sync_seconds=round(r.seconds, 3),
                caught_up=r.caught_up,
            )
        row.update(val_loss=loss, val_ppl=math.exp(loss), elapsed=round(time.time() - self.t0, 2))
        self.write(row)
        mb = {k: None if row.get(k) is None else row[k] / 1e6 for k in ("bytes_up", "bytes_down")}
        print(
            f"{step:>7} {_fmt(row['version'], 'd', 7)} {row['val_ppl']:>10.2f} "
            f"{_fmt(row.get('participants'), 'd', 5)} {_fmt(mb['bytes_up'], '.2f', 9)} "
            f"{_fmt(mb['bytes_down'], '.2f', 9)} {_fmt(row.get('sync_seconds'), '.2f', 7)} "
            f"{row['elapsed']:>8.0f}",
            flush=True,
        )

    def print_header(self) -> None:
        print(
            f"{'step':>7} {'version':>7} {'val ppl':>10} {'peers':>5} {'MB up':>9} {'MB down':>9} "
            f"{'sync s':>7} {'elapsed':>8}",
            flush=True,
        )

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def round_participants(client: Any, round_: int) -> int | None:
    """How many peers' updates closed round ``round_`` (from the hub's run status)."""
    try:
        rounds = client.status().get("rounds", [])
    except Exception:  # a status hiccup must not stop training
        return None
    return next((len(r["participants"]) for r in rounds if r.get("round") == round_), None)


def _fmt(value: Any, spec: str, width: int) -> str:
    return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"


def synced_arrays(model: Any) -> dict[str, Any]:
    """The tensors a hub holds for this model, as float32 numpy arrays: every parameter once (a
    tied weight under its first name) and the persistent floating-point buffers."""
    import torch

    persistent = set(model.state_dict(keep_vars=True))
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if b.is_floating_point() and n in persistent})
    return {n: t.detach().to("cpu", torch.float32).numpy() for n, t in tensors.items()}


def weights_digest(arrays: dict[str, Any]) -> str:
    """sha256 over named float32 arrays in name order; equal digests mean bit-identical weights."""
    import numpy as np

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name], dtype="<f4")
        h.update(f"{name}|{list(a.shape)}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def hub_digest(url: str, run: str, token: str | None) -> tuple[int, str]:
    """Download the run's latest version from the hub; return (version, weights digest)."""
    import safetensors.numpy

    request = urllib.request.Request(f"{url}/v1/runs/{run}/model")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=120) as r:
        version = int(r.headers.get("X-Sync-Version", -1))
        arrays = safetensors.numpy.load(r.read())
    return version, weights_digest(arrays)


def unreachable(what: str, name: str, exc: Exception) -> str:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
    return f"cannot load {what} {name!r} ({type(exc).__name__}: {reason}); no Hub access? {OFFLINE_HINT}"


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# --local-peers K: this command line as K peers under syncserver/local.py's launcher, then results, a plot
# ---------------------------------------------------------------------------------------------

# What only the launching process reads (flag -> how many values follow it). The peers get
# the rest of the command line; their hub, run, name, token and folder come from WEIGHTSYNC_*.
LAUNCH_ONLY = {"--local-peers": 1, "--serial-baseline": 0, "--output-dir": 1, "--token": 1}


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    from syncserver.local import LaunchError, LocalRun, hub_settings_for

    t0 = time.time()
    k = args.local_peers
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "hub", ignore_errors=True)  # a fresh run, not the previous one's state
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cfg = dict(vars(args), cores=cores)
    cfg.pop("token", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    note("config " + json.dumps(cfg))
    try:
        settings = hub_settings_for(out, k, args.token)
    except LaunchError as exc:
        raise Fail(str(exc)) from None
    command = [sys.executable, str(Path(__file__).resolve()), *peer_argv(argv)]
    try:
        with LocalRun(command, peers=k, out=out, settings=settings, run=args.run, metric="eval_ppl") as local:
            rounds = local.wait()
            peers_wall = time.time() - t0
            hub_version, hub_sha = hub_digest(local.hub_url, args.run, local.token)
            peers = local.peers
    except LaunchError as exc:
        raise Fail(str(exc)) from None
    except KeyboardInterrupt:
        note("interrupted: stopped the hub and the peers")
        return 130
    serial = None
    if args.serial_baseline:
        note(f"serial baseline: one process, {cores} thread(s), in {out}/serial ...")
        (out / "serial").mkdir(exist_ok=True)
        cmd = [*command, "--no-hub", "--output-dir", str(out / "serial"), "--threads", str(args.threads or cores)]
        log = out / "serial" / "log.txt"
        with log.open("wb") as f:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise Fail(f"the serial baseline exited with code {code} (log: {log})")
        serial = json.loads((out / "serial" / "results.json").read_text())

    # -- results ----------------------------------------------------------------------------------
    per_peer = {p: json.loads((out / p / "results.json").read_text()) for p in peers}
    digests = {p: r["weights_sha256"] for p, r in per_peer.items()}
    identical = len(set(digests.values())) == 1
    equal_hub = set(digests.values()) == {hub_sha}
    results = {
        "config": cfg,
        "rounds": rounds,
        "final": {p: {key: r[key] for key in FINAL_KEYS} for p, r in per_peer.items()},
        "weights_identical": identical,
        "weights_equal_hub": equal_hub,
        "weights_sha256": digests,
        "hub_version": hub_version,
        "hub_weights_sha256": hub_sha,
        "wall_seconds": round(peers_wall, 2),
        "serial": None
        if serial is None
        else {key: serial[key] for key in ("final_val_ppl", "final_test_ppl", "steps", "wall_seconds")},
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    series = dict(per_peer)
    if serial is not None:
        series["serial"] = serial
    plot(series, out / "val_ppl.png", args)

    vals = ", ".join(f"{p} {r['final_val_ppl']:.2f}" for p, r in per_peer.items())
    tests = ", ".join(f"{p} {r['final_test_ppl']:.2f}" for p, r in per_peer.items())
    print(f"final validation perplexity: {vals}" + (f"; serial {serial['final_val_ppl']:.2f}" if serial else ""))
    print(f"test perplexity: {tests}" + (f"; serial {serial['final_test_ppl']:.2f}" if serial else ""))
    print(
        f"final weights identical across peers: {'yes' if identical else 'NO'}; "
        f"equal to the hub's version {hub_version}: {'yes' if equal_hub else 'NO'}"
    )
    print(
        f"wall time {peers_wall:.0f} s"
        + (f" (serial {serial['wall_seconds']:.0f} s)" if serial else "")
        + f"; results in {out / 'results.json'}, plot {out / 'val_ppl.png'}"
    )
    return 0 if identical and equal_hub else 1


def peer_argv(argv: list[str]) -> list[str]:
    """``argv`` without the flags in LAUNCH_ONLY (``--flag value`` or ``--flag=value``)."""
    kept: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name, eq, _ = arg.partition("=")
        if name in LAUNCH_ONLY:
            skip = 0 if eq else LAUNCH_ONLY[name]
        else:
            kept.append(arg)
    return kept


def plot(series: dict[str, dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    """Validation perplexity vs step, one line per peer (and the serial baseline), syncs marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    sync_steps: set[int] = set()
    for name, res in series.items():
        evals = res["evals"]
        serial = res["world_size"] == 1 and not res["rounds"]
        ax.plot(
            [e["step"] for e in evals],
            [e["val_ppl"] for e in evals],
            "--" if serial else "-",
            marker="" if serial else ".",
            color="black" if serial else None,
            alpha=0.8,
            label=name,
        )
        sync_steps.update(r["step"] for r in res["rounds"])
    for s in sorted(sync_steps):
        ax.axvline(s, color="grey", lw=0.5, alpha=0.4)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step (per peer)")
    ax.set_ylabel("validation perplexity")
    peers = sum(1 for res in series.values() if res["rounds"])
    every = f"every {args.sync_every} steps" if args.sync_every else f"every {args.round_samples} samples"
    every = f"on the schedule {args.sync_schedule}" if args.sync_schedule else every
    title = f"GPT-2 on IMDB: {peers} peer(s), sync {every} (grey)" if peers else "GPT-2 on IMDB"
    if "serial" in series and peers:
        title += " vs serial"
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    code = main()
    # Exiting, the interpreter's collector walks every object torch, transformers and datasets
    # made: 1.2-1.4 s of CPU a process on a 2-core VM (a launcher and each local peer pay it).
    # The OS takes the memory back anyway, the SDK's exit handlers (atexit) still run, and
    # every file the job writes is closed by now: skip the walk.
    gc.freeze()
    sys.exit(code)
