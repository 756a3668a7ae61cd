"""A warm start that exists offline: ``python bench/pretrain.py [--model-config tiny] [--steps N]``.

Users fine-tune a *pretrained* GPT-2; the Hugging Face Hub is out of reach here, so this
pretrains a small one on IMDB reviews that the quality grid (``bench/quality.py``) never
trains, validates or tests on, and saves it with ``save_pretrained``. Then
``train/finetune_gpt2.py --model <that folder>`` fine-tunes from it exactly as from ``gpt2``.

Disjoint by construction: the reviews the fine-tune uses are picked by the job's own
``load_texts`` (the train split shuffled by the seed, validation held out of it, the test
split shuffled by the seed) for every seed of the grid; their texts are removed from both
IMDB splits, and the pretraining reviews are drawn from what is left. The count of overlaps
(zero) is written to ``meta.json``.

Cached and deterministic: the output folder is named by a hash of every input (the settings
and the fine-tune's selection), one thread, fixed seeds; a second call with
the same settings returns the folder at once. Minutes, not hours, on 2 cores: the ``tiny``
config (3.4M parameters) at 600 steps of 64 blocks of 20 tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
CACHE = REPO / "bench" / "results" / "pretrained"


def finetune_module() -> ModuleType:
    """The reference job as a module: its ``load_texts`` and ``MODEL_CONFIGS`` are the ones the grid uses."""
    spec = importlib.util.spec_from_file_location("finetune_gpt2", REPO / "train" / "finetune_gpt2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--dataset", default=str(DATA / "imdb"), help="folder with train.parquet and test.parquet")
    p.add_argument("--tokenizer", default=str(DATA / "gpt2-tokenizer"))
    p.add_argument("--model-config", default="tiny", help="a MODEL_CONFIGS shape of train/finetune_gpt2.py")
    p.add_argument("--reviews", type=int, default=4000, help="pretraining reviews (disjoint from the fine-tune's)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64, help="blocks per step")
    p.add_argument("--block-size", type=int, default=20, help="tokens per block (the fine-tune's)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak, cosine to 10%% after 5%% warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude-seeds", default="1,2,3", help="fine-tune seeds whose reviews are left out")
    p.add_argument("--exclude-train", type=int, default=400, help="the fine-tune's --train-samples")
    p.add_argument("--exclude-val", type=int, default=40, help="the fine-tune's --val-samples")
    p.add_argument("--exclude-test", type=int, default=40, help="the fine-tune's --test-samples")
    p.add_argument("--out", type=Path, help="output folder (default: a cache folder named by the settings)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: bit-for-bit repeatable)")
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda[:i]: the model in float32 there, its steps under bf16 autocast"
    )
    args = p.parse_args(argv)
    for name in ("reviews", "steps", "batch_size", "block_size", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.seeds = [int(s) for s in args.exclude_seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--exclude-seeds must be comma-separated integers, got {args.exclude_seeds!r}")
    return args


def pretrain(args: argparse.Namespace) -> Path:
    """Pretrain (or find the cached run) and return the ``save_pretrained`` folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages for the logits: see finetune_gpt2.py
    import datasets
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    job = finetune_module()
    if args.model_config not in job.MODEL_CONFIGS:
        raise SystemExit(f"error: --model-config must be one of {sorted(job.MODEL_CONFIGS)}")

    # The fine-tune's reviews, for every seed of the grid: left out of pretraining.
    used: set[str] = set()
    for seed in args.seeds:
        pick = argparse.Namespace(
            dataset=args.dataset,
            train_samples=args.exclude_train,
            val_samples=args.exclude_val,
            test_samples=args.exclude_test,
            seed=seed,
        )
        for texts in job.load_texts(pick, datasets):
            used.update(texts["text"])
    import pyarrow.parquet as pq

    pool = [
        t
        for split in ("train", "test")
        for t in pq.read_table(Path(args.dataset) / f"{split}.parquet", columns=["text"])["text"].to_pylist()
    ]
    rng = random.Random(args.seed)
    rng.shuffle(pool)
    texts = [t for t in pool if t not in used][: args.reviews]
    if len(texts) < args.reviews:
        raise SystemExit(f"error: only {len(texts)} reviews outside the fine-tune's, asked for {args.reviews}")

    settings = {k: v for k, v in vars(args).items() if k not in ("out", "seeds")}
    settings.pop("dataset"), settings.pop("tokenizer")
    if settings["device"] == "cpu":  # the key of every CPU cache folder made before --device existed
        settings.pop("device")
    key = hashlib.sha256(
        json.dumps(settings, sort_keys=True).encode() + hashlib.sha256("\n".join(sorted(used)).encode()).digest()
    ).hexdigest()[:12]
    out = args.out or CACHE / f"{args.model_config}-{key}"
    if (out / "meta.json").is_file():
        print(f"pretrained model (cached): {out}", flush=True)
        return out

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = [t for seq in tokenizer(texts, return_attention_mask=False)["input_ids"] for t in seq]
    n = len(ids) // args.block_size
    blocks = torch.tensor(ids[: n * args.block_size]).view(n, args.block_size)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **job.MODEL_CONFIGS[args.model_config],
    )
    device = torch.device(args.device)
    model = GPT2LMHeadModel(config).to(device)
    blocks = blocks.to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, args.steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(n, generator=gen)
    t0, losses, at = time.perf_counter(), [], 0
    model.train()
    for step in range(args.steps):
        if at + args.batch_size > n:
            order, at = torch.randperm(n, generator=gen), 0
        batch = blocks[order[at : at + args.batch_size].to(device)]
        at += args.batch_size
        with autocast:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            recent = sum(losses[-50:]) / len(losses[-50:])
            seconds = time.perf_counter() - t0
            print(
                f"step {step + 1}/{args.steps}: loss {recent:.3f} (ppl {math.exp(recent):.1f}), {seconds:.0f} s",
                flush=True,
            )

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted run's leftovers
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {
        "settings": settings,
        "blocks": n,
        "epochs": round(args.steps * args.batch_size / n, 3),
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "seconds": round(time.perf_counter() - t0, 1),
        "excluded_reviews": len(used),
        "overlap_with_finetune": sum(t in used for t in texts),
        "n_params": sum(p.numel() for p in model.parameters()),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    tmp.rename(out)
    print(f"pretrained model: {out} ({meta['seconds']} s)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    pretrain(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
