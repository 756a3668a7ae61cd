"""Codec micro-benchmark on a GPT-2-sized model: ``python bench/codecs.py``.

Encodes and decodes every tensor of a GPT-2 small shaped state dict (124.4M random float32
values, std 0.02 like a fresh init) with each codec, one tensor at a time as peers and the
hub do, and prints a markdown table: throughput in MB of float32 per second (MB = 10^6
bytes, best of ``--repeat`` runs, one thread), wire bytes relative to fp32, and the RMS error
relative to the RMS of the values. Peak memory stays near 1.5 GB: the model (0.5 GB), its
encoded form and one decoded tensor.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import numpy as np

from syncwire import Codec, available_codecs, get_codec


def gpt2_shapes(layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of Hugging Face's ``gpt2`` (124,439,808 values)."""
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d)}
    for i in range(layers):
        p = f"h.{i}."
        shapes |= {
            p + "ln_1.weight": (d,),
            p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (d, 3 * d),
            p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d),
            p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,),
            p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (d, 4 * d),
            p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (4 * d, d),
            p + "mlp.c_proj.bias": (d,),
        }
    return shapes | {"ln_f.weight": (d,), "ln_f.bias": (d,)}


def bench(codec: Codec, model: dict[str, np.ndarray], repeat: int) -> dict[str, float]:
    """Best-of-``repeat`` encode and decode seconds for the whole model, bytes, RMS error."""
    encode_s = decode_s = float("inf")
    encoded: dict[str, dict[str, np.ndarray]] = {}
    for _ in range(repeat):
        encoded = {}
        start = time.perf_counter()
        for name, x in model.items():
            encoded[name] = codec.encode(x)
        encode_s = min(encode_s, time.perf_counter() - start)
        start = time.perf_counter()
        for name, x in model.items():
            codec.decode(encoded[name], x.shape)
        decode_s = min(decode_s, time.perf_counter() - start)
    err2 = ref2 = 0.0
    for name, x in model.items():  # outside the timings
        diff = codec.decode(encoded[name], x.shape) - x
        err2 += float(np.dot(diff.reshape(-1), diff.reshape(-1)))
        ref2 += float(np.dot(x.reshape(-1), x.reshape(-1)))
    wire = sum(p.nbytes for parts in encoded.values() for p in parts.values())
    return {"encode_s": encode_s, "decode_s": decode_s, "wire": wire, "rms": (err2 / ref2) ** 0.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--codecs",
        nargs="+",
        default=["fp32", "bf16", "int8", "int4", "topk"],
        metavar="SPEC",
        help="codec specs (topk's parameters hold commas: topk:chunk=1024,k=48)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per codec; the best one counts")
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (12 is GPT-2 small)")
    args = parser.parse_args()
    codecs = [get_codec(spec) for spec in args.codecs]

    rng = np.random.default_rng(0)
    model = {
        name: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        for name, shape in gpt2_shapes(args.layers).items()
    }
    nbytes = sum(x.nbytes for x in model.values())
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{now}; {len(model)} tensors, {nbytes // 4:,} float32 values ({nbytes / 1e6:.0f} MB); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; numpy {np.__version__}; "
        f"best of {args.repeat}; codecs available: {', '.join(available_codecs())}\n"
    )

    def rate(seconds: float) -> str:
        mbs = nbytes / seconds / 1e6
        return f"{mbs:,.0f}" if mbs < 1e5 else "no copy"  # fp32's encode hands the array over

    print("| codec | encode MB/s | decode MB/s | bytes vs fp32 | rel. RMS error |")
    print("|---|---:|---:|---:|---:|")
    for codec in codecs:
        r = bench(codec, model, args.repeat)
        print(
            f"| `{codec.spec}` | {rate(r['encode_s'])} | {rate(r['decode_s'])} "
            f"| {r['wire'] / nbytes:.4f} | {r['rms']:.2e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
