"""The training thread's host work per overlapped sync, against a plain copy of the synced bytes.

    python bench/hostwork.py                  # GPT-2 124M's tensors (498 MB fp32), fp32 and int8
    python bench/hostwork.py --quick          # the tests' tiny shapes, 2 syncs (the smoke test)

A real hub (``python -m syncserver serve`` on a free loopback port, its own temp data dir) and
one peer in this process (``min_peers=1``, a run per codec), holding a module of GPT-2's
parameter shapes (bench/round.py's schema, random values; no training). Per sync, on this
thread: ``sync_async`` (the snapshot; the encode runs beside the upload), a stand-in for the
steps trained meanwhile (an untimed add to every weight), a wait until the merged update is in
(``done()``: so that ``apply``'s figure is host work, not waiting for the hub) and ``--settle``
seconds more (the hub, on the same cores here, goes on writing the version after it answered:
0.3-0.5 s more for an int8 apply at load 2 without it), then ``apply``.
Then ``--syncs`` blocking ``sync`` calls, timed whole (hub and loopback included): the path
that must not get slower.

Against, on the same tensors: ``np.copyto`` of every tensor into buffers allocated (and written
once) beforehand, and an in-place add (``np.add(a, b, out=a)``). Every figure is the median of
``--syncs`` (after one untimed sync per codec). Target (issue 45): snapshot + apply <= 2x the copy.
Results: a markdown table on stdout and ``bench/results/hostwork-<date>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import record  # bench/record.py: this script's folder is first on sys.path
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO)]

import round as rb  # noqa: E402 (bench/round.py: the model's schema, a module holding it)

from syncclient import SyncClient  # noqa: E402 (after the path above)
from syncserver.process import ServerProcess  # noqa: E402

# -----------------------------------------------------------------------------
# settings
parser = argparse.ArgumentParser(description="Training-thread seconds per overlapped sync vs a plain copy.")
parser.add_argument("--model", choices=sorted(rb.MODELS), default="gpt2", help="tensor shapes (bench/round.py)")
parser.add_argument("--codecs", nargs="+", default=["fp32", "int8"], help="one run each")
parser.add_argument("--syncs", type=int, default=5, help="timed syncs per codec and mode (the median is reported)")
parser.add_argument("--settle", type=float, default=1.0, help="seconds between a result's arrival and apply")
parser.add_argument("--quick", action="store_true", help="--model tiny --syncs 2 --settle 0: the smoke test")
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")


def median_seconds(call: Callable[[], Any], times: int) -> float:
    """The median wall seconds of ``call()``, after one untimed call."""
    call()
    seconds = []
    for _ in range(times):
        t = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds)


def baselines(schema: dict[str, tuple[int, ...]], times: int) -> dict[str, float]:
    """Seconds of a plain copy of every tensor into kept buffers, and of an in-place add."""
    rng = np.random.default_rng(0)
    src = [rng.standard_normal(shape, dtype=np.float32) for shape in schema.values()]
    dst = [np.zeros_like(a) for a in src]  # allocated and written: no page faults in the timing
    return {
        "copy": median_seconds(lambda: [np.copyto(d, s) for d, s in zip(dst, src, strict=True)], times),
        "add": median_seconds(lambda: [np.add(d, s, out=d) for d, s in zip(dst, src, strict=True)], times),
    }


def measure(url: str, codec: str, schema: dict[str, tuple[int, ...]], syncs: int, settle: float) -> dict[str, float]:
    """Median seconds of ``sync_async``, ``apply`` and a blocking ``sync`` of one peer."""
    model = rb.lean_model(schema, seed=0)
    client = SyncClient(url, run=f"hostwork-{codec}", peer="p0", min_peers=1, codec=codec, retry_seconds=60)
    client.join(model)
    snapshot, apply, blocking = [], [], []
    try:
        for i in range(syncs + 1):  # the first: untimed (buffers, caches, the hub's first round)
            t = time.perf_counter()
            pending = client.sync_async(model, samples=1)
            started = time.perf_counter() - t
            with torch.no_grad():  # the steps trained while the sync travels
                for p in model.parameters():
                    p.add_(1e-4)
            while not pending.done():
                time.sleep(0.005)
            time.sleep(settle)  # the hub's work after answering: on its own machine in a real run
            t = time.perf_counter()
            pending.apply(model)
            if i:
                snapshot.append(started)
                apply.append(time.perf_counter() - t)
        for i in range(syncs + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-4)
            t = time.perf_counter()
            client.sync(model, samples=1)
            if i:
                blocking.append(time.perf_counter() - t)
    finally:
        client.leave()
    return {
        "snapshot": statistics.median(snapshot),
        "apply": statistics.median(apply),
        "host": statistics.median(s + a for s, a in zip(snapshot, apply, strict=True)),
        "blocking": statistics.median(blocking),
    }


def main() -> None:
    args = parser.parse_args()
    if args.quick:
        args.model, args.syncs, args.settle = "tiny", 2, 0.0
    started = datetime.datetime.now(datetime.UTC)
    schema = rb.model_schema(args.model)
    mb = 4 * sum(int(np.prod(s)) for s in schema.values()) / 1e6
    base = baselines(schema, args.syncs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hostwork-bench-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
        serve = [sys.executable, "-m", "syncserver", "serve", "--host=127.0.0.1", f"--data-dir={tmp}/hub"]
        hub = ServerProcess([*serve, "--log-level=warning"], log=Path(tmp) / "hub.log", env=env, cwd=REPO)
        try:
            url = hub.start()
            for codec in args.codecs:
                figures = measure(url, codec, schema, args.syncs, args.settle)
                rows.append({"codec": codec, **figures, "ratio": figures["host"] / base["copy"]})
        finally:
            hub.stop(timeout=30)
    load = os.getloadavg()
    print(
        f"\n{args.model} ({mb:.0f} MB float32, {len(schema)} tensors), 1 peer, median of {args.syncs} syncs; "
        f"np.copyto {base['copy']:.3f} s, in-place add {base['add']:.3f} s; "
        f"{os.cpu_count()} CPUs, load {load[0]:.2f}\n"
    )
    print("| codec | sync_async (snapshot) | apply | both | both / copy | blocking sync (whole) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['codec']} | {r['snapshot']:.3f} s | {r['apply']:.3f} s | {r['host']:.3f} s "
            f"| {r['ratio']:.2f}x | {r['blocking']:.3f} s |"
        )
    targets = [
        {"target": f"{r['codec']}: snapshot + apply / plain copy", "value": r["ratio"], "threshold": 2.0}
        | {"met": r["ratio"] <= 2.0}
        for r in rows
    ]
    print("\n" + "\n".join(record.targets_table(targets, "{:.2f}x")))
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    record.save(
        args.out / f"hostwork-{started:%Y-%m-%d}.json",
        started,
        settings=settings,
        megabytes=mb,
        baselines=base,
        load=load,
        rows=rows,
        targets=targets,
    )


if __name__ == "__main__":
    main()
