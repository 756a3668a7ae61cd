"""Time to quality: ``python bench/ttq.py [--quality bench/results/quality.json]``.

The origin report's last table: how long a run takes to finish, and at what perplexity, serial
against 2 and 4 peers at each interval, on 100 Mbit/s and 1 Gbit/s links. Here, for the quality
grid's model (``bench/quality.py``: the ``tiny`` GPT-2 from ``bench/pretrain.py``):

- **measured**: the final validation perplexity of each configuration (the grid's first seed)
  and its ratio to the serial run of the same seed (mean over the configuration's seeds), and
  the seconds of one optimizer step at each per-peer batch (timed here: forward,
  backward and AdamW on one thread, as one core per machine; median of ``--steps`` steps after 3
  warm-up steps), and the bytes each way per peer (the codec's wire layout of the model);
- **computed**: a run's minutes = its steps x the step time at its per-peer batch + its rounds x a
  round's time, a round = (update bytes up + result bytes down) / link x ``--overhead`` (the
  round's measured time over its link limit, from ``bench/wire.py``'s link-shaped rounds; 1.0 is
  the link alone). Peers on separate machines train in parallel, so the steps of a run count once.

The tiny model's step is cheap beside its bytes (13.5 MB in fp32 at 100 Mbit/s is 1.1 s each way),
which is the regime where the interval and the codec decide the wall time; at GPU scale the step
times change, not the arithmetic (``--step-seconds B=S`` replaces a measured step time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LINKS = {"100 Mbit/s": 100e6 / 8, "1 Gbit/s": 1e9 / 8}  # bytes per second


def step_seconds(model_dir: Path, batches: list[int], steps: int, block: int) -> dict[int, float]:
    """Median seconds of one training step at each batch (one thread, as one core per peer)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    timings: dict[int, float] = {}
    for batch in batches:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, model.config.vocab_size, (batch, block), generator=torch.Generator().manual_seed(0))
        seconds = []
        for i in range(steps + 3):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 3:
                seconds.append(time.perf_counter() - t0)
        timings[batch] = statistics.median(seconds)
    return timings


def wire_bytes(model_dir: Path, codec: str) -> int:
    """Bytes of one update (or result) of this model in ``codec``: what a peer sends each way."""
    from safetensors import safe_open

    from syncwire import get_codec, layout_bytes, wire_layout

    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        schema = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    return layout_bytes(wire_layout(get_codec(codec), schema))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quality", type=Path, default=REPO / "bench" / "results" / "quality.json")
    p.add_argument("--overhead", type=float, default=1.0, help="a round's time over its link limit (bench/wire.py)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per batch")
    p.add_argument("--step-seconds", action="append", default=[], metavar="B=S", help="use S s for batch B")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ttq.json")
    args = p.parse_args(argv)
    if not args.quality.is_file():
        p.error(f"{args.quality} does not exist: run bench/quality.py first")
    if not args.overhead >= 1.0 or args.steps < 1:
        p.error("--overhead must be >= 1 and --steps >= 1")
    grid = json.loads(args.quality.read_text())
    common = grid["common"]
    model_dir = Path(common["model"])
    rows = [r for r in grid["rows"] if "error" not in r and not r["config"].get("scratch")]

    given = {}
    for item in args.step_seconds:
        batch, _, seconds = item.partition("=")
        try:
            given[int(batch)] = float(seconds)
        except ValueError:
            p.error(f"--step-seconds takes B=S (e.g. 16=0.12), got {item!r}")

    def batch_of(r: dict[str, Any]) -> int:
        c = r["config"]
        return int(c["flags"].get("batch-size", common["batch-size"])) // max(1, c["peers"])

    batches = sorted({batch_of(r) for r in rows} - set(given))
    measured = step_seconds(model_dir, batches, args.steps, 20) if batches else {}
    timing = measured | given

    # one line per configuration family: the mean over its seeds
    families: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        head, _, tail = r["config"]["name"].rpartition("-seed")
        families.setdefault(head if head and tail.isdigit() else r["config"]["name"], []).append(r)
    # each seed holds out its own validation reviews: ratios to the serial run of the same seed
    serial = {r["seed"]: r["val_ppl"] for r in families["serial"]}
    table = []
    for name, group in families.items():
        c = group[0]["config"]
        steps = int(c["flags"].get("max-steps", common["max-steps"]))
        compute = steps * timing[batch_of(group[0])]
        ppl = group[0]["val_ppl"]  # the grid's first seed
        ratio = statistics.mean(r["val_ppl"] / serial[r["seed"]] for r in group)
        line: dict[str, Any] = {"config": name, "peers": c["peers"] or 1, "interval": c["sync_every"] or None}
        line |= {"codec": c["codec"] if c["peers"] else "-", "outer": c["outer"] if c["peers"] else "-"}
        line |= {"seeds": len(group), "val_ppl": ppl, "vs_serial": ratio - 1, "compute_s": compute}
        rounds = math.ceil(steps / c["sync_every"]) if c["peers"] else 0
        # the last round's result is fp32; a lossy run adds the residual's round (fp32 result too)
        lossy = c["peers"] and c["codec"] != "fp32"
        for link, rate in LINKS.items():
            if not c["peers"]:
                line[link] = compute
                continue
            normal = 2 * wire_bytes(model_dir, c["codec"]) / rate * args.overhead
            final = (wire_bytes(model_dir, c["codec"]) + wire_bytes(model_dir, "fp32")) / rate * args.overhead
            line[link] = compute + (rounds - 1) * normal + final + (final if lossy else 0.0)
        table.append(line)

    print(
        f"step seconds (one thread, median of {args.steps}): "
        + ", ".join(f"batch {b}: {s:.4f}" for b, s in timing.items())
    )
    print(f"bytes each way per peer: fp32 {wire_bytes(model_dir, 'fp32') / 1e6:.1f} MB\n")
    print(
        "| config | peers | interval | codec | outer | seeds | val ppl | vs serial | compute s "
        "| min @100 Mbit/s | min @1 Gbit/s |"
    )
    print("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for t in table:
        print(
            f"| {t['config']} | {t['peers']} | {t['interval'] or '-'} | {t['codec']} | {t['outer']} | {t['seeds']} "
            f"| {t['val_ppl']:.2f} | {t['vs_serial'] * 100:+.2f}% | {t['compute_s']:.1f} "
            f"| {t['100 Mbit/s'] / 60:.2f} | {t['1 Gbit/s'] / 60:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "load": os.getloadavg(),
                "step_seconds": timing,
                "measured_batches": sorted(measured),
                "overhead": args.overhead,
                "rows": table,
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
