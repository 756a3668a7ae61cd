"""Choose the ``topk`` codec's parameters on real deltas: ``python bench/sparse.py``.

Trains a randomly initialised GPT-2 of ``--model-config`` shape (train/finetune_gpt2.py's
``tiny``/``small``) on IMDB with Adam for ``--rounds`` windows of ``--steps`` steps, and keeps
each window's delta (weights after - before), as a peer syncing every ``--steps`` steps would
send. Then, for each ``(chunk, k, bits)`` candidate, it encodes the deltas in order with error
feedback as the client does (``send = delta + residual``; ``residual = send - decode(send)``)
and prints a markdown table: bytes vs fp32, the relative error of one round
(``||delta - decode(delta)|| / ||delta||``, no feedback), and the error of everything sent so far
after the last round (``||sum deltas - sum decoded|| / ||sum deltas||``), which is what error
feedback keeps small and what the model ends up with.

    python bench/sparse.py --dataset ../shared/data/imdb --tokenizer ../shared/data/gpt2-tokenizer
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from syncwire import get_codec
from train.finetune_gpt2 import MODEL_CONFIGS

CANDIDATES = [
    "int8",
    "int4",
    "topk:chunk=1024,k=16,bits=2",
    "topk:chunk=1024,k=48,bits=2",
    "topk:chunk=1024,k=64,bits=2",
    "topk:chunk=1024,k=64,bits=3",
    "topk:chunk=256,k=16,bits=2,block=256",
    "topk:chunk=64,k=4,bits=2",
    "topk:chunk=64,k=6,bits=2",
    "topk:chunk=32,k=3,bits=2",
    "topk:chunk=16,k=1,bits=2",
    "topk:chunk=16,k=2,bits=2",
    "topk:chunk=16,k=2,bits=3",
    "topk:chunk=16,k=2",
    "topk:chunk=8,k=1,bits=2",
    "topk:chunk=8,k=1,bits=3",
    "topk:chunk=8,k=1",
    "topk:chunk=6,k=1,bits=2,block=1536",
    "topk:chunk=5,k=1,block=1000",
    "topk",
]


def real_deltas(args: argparse.Namespace) -> list[dict[str, np.ndarray]]:
    """``--rounds`` consecutive deltas of ``--steps`` Adam steps each, as float32 arrays."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    texts = pq.read_table(Path(args.dataset) / "train.parquet", columns=["text"]).column("text").to_pylist()
    ids = [t for text in texts[: args.reviews] for t in tokenizer(text)["input_ids"]]
    blocks = torch.tensor(ids[: len(ids) // args.block * args.block]).view(-1, args.block)
    config = GPT2Config(vocab_size=len(tokenizer), **MODEL_CONFIGS[args.model_config])
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = {n: p for n, p in model.named_parameters()}  # the tie: lm_head is wte, listed once
    deltas, step = [], 0
    for _ in range(args.rounds):
        before = {n: p.detach().numpy().copy() for n, p in params.items()}
        for _ in range(args.steps):
            batch = blocks[torch.randint(len(blocks), (args.batch,))]
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        deltas.append({n: p.detach().numpy() - before[n] for n, p in params.items()})
        print(f"round {len(deltas)}: step {step}, loss {loss.item():.3f}", file=sys.stderr)
    return deltas


def measure(spec: str, deltas: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Bytes vs fp32, mean one-round error, and the error of the sum after error feedback."""
    codec = get_codec(spec)
    residual = {n: np.zeros_like(x) for n, x in deltas[0].items()}
    true_sum = {n: np.zeros_like(x) for n, x in deltas[0].items()}
    got_sum = {n: np.zeros_like(x) for n, x in deltas[0].items()}
    one_err, wire, fp32 = [], 0, 0
    for delta in deltas:
        e2 = r2 = 0.0
        for n, x in delta.items():
            plain = codec.decode(codec.encode(x), x.shape)
            e2 += float(np.sum((x - plain) ** 2, dtype=np.float64))
            r2 += float(np.sum(x.astype(np.float64) ** 2))
            send = x + residual[n]
            parts = codec.encode(send)
            wire += sum(p.nbytes for p in parts.values())
            fp32 += x.nbytes
            decoded = codec.decode(parts, x.shape)
            residual[n] = send - decoded
            true_sum[n] += x
            got_sum[n] += decoded
        one_err.append((e2 / r2) ** 0.5)
    diff = sum(float(np.sum((true_sum[n] - got_sum[n]).astype(np.float64) ** 2)) for n in true_sum)
    ref = sum(float(np.sum(true_sum[n].astype(np.float64) ** 2)) for n in true_sum)
    return {"ratio": wire / fp32, "one": float(np.mean(one_err)), "sum": (diff / ref) ** 0.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="../shared/data/imdb", help="folder with train.parquet")
    parser.add_argument("--tokenizer", default="../shared/data/gpt2-tokenizer")
    parser.add_argument("--model-config", default="small", choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--rounds", type=int, default=4, help="deltas to take")
    parser.add_argument("--steps", type=int, default=10, help="Adam steps per delta (the sync interval)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per step")
    parser.add_argument("--block", type=int, default=64, help="tokens per block")
    parser.add_argument("--reviews", type=int, default=400, help="IMDB reviews to tokenize")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--codecs", nargs="+", default=CANDIDATES, metavar="SPEC", help="codec specs to compare")
    parser.add_argument("--cache", type=Path, help="keep the deltas in this .npz (and reuse it if it exists)")
    args = parser.parse_args()
    if args.cache is not None and args.cache.exists():
        with np.load(args.cache) as saved:
            deltas = [
                {n.split("/", 1)[1]: saved[n] for n in saved.files if n.startswith(f"{i}/")} for i in range(args.rounds)
            ]
    else:
        deltas = real_deltas(args)
        if args.cache is not None:
            np.savez(args.cache, **{f"{i}/{n}": x for i, d in enumerate(deltas) for n, x in d.items()})
    values = sum(x.size for x in deltas[0].values())
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{now}; GPT-2 {args.model_config} ({values:,} values), {args.rounds} deltas of {args.steps} AdamW steps "
        f"(lr {args.lr}, {args.batch}x{args.block} tokens); {platform.machine()}, {os.cpu_count()} CPUs\n"
    )
    print("| codec | values sent | bytes vs fp32 | one-round rel. error | sum after feedback, rel. error |")
    print("|---|---:|---:|---:|---:|")
    for spec in args.codecs:
        codec = get_codec(spec)
        sent = f"{codec.k / codec.chunk:.1%}" if hasattr(codec, "k") else "100%"
        r = measure(spec, deltas)
        print(f"| `{spec}` | {sent} | {r['ratio']:.4f} | {r['one']:.3f} | {r['sum']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
