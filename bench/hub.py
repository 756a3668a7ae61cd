"""The hub's own work on one model's bytes, no HTTP: receive an update, fold, merge, build a version.

    python bench/hub.py                         # GPT-2 124M, 2 peers, fp32 and int8
    python bench/hub.py --model tiny --reps 1   # the smoke test

Over shaped links (bench/wire.py) the uploads run at bare TCP's pace, and the time from the last
acknowledgement to the first result byte is the hub's alone: every peer waits while it merges,
folding the last update as it goes. This times the hub's code on GPT-2's tensors in a fresh store
on the data dir's disk, phase by phase:

- **receive**: one update's body through :func:`syncserver.storage.uploads.receive` (hash, NaN/Inf scan,
  write, fsync), fed in pieces of 256 KiB - 1 byte (asyncio's socket reads are at most 256 KiB;
  the odd size splits values across pieces and batches, as a network's reads do);
- **fold**: every update but the last read back (``pread``), decoded and folded into the mean, as
  the hub folds each update acknowledged before the round closes;
- **merge**: the close: the last update folded slice by slice as the merge goes, the result written
  and fsynced (``outer_step``, encode, the check that version v + result is finite);
- **version**: version v+1 built from v and the result (after the commit: off the peers' wait).

Seconds are wall time, the best (and median) of ``--reps``; ``cpu`` is the process's CPU time
over the same phase (the slice threads' included). Compare trees with ``PYTHONPATH``: the
numbers move with the page cache and the disk, so run both sides interleaved.
Results: a markdown table on stdout and ``bench/results/hub-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import round as rb  # noqa: E402 (model shapes, result files)

from syncserver.reduce.engine import Accumulator, MergeEngine, Outer, RoundMerge  # noqa: E402
from syncserver.settings import default_fold_threads  # noqa: E402
from syncserver.storage.store import Store, UpdateKey, VersionKey  # noqa: E402
from syncserver.storage.uploads import receive  # noqa: E402
from syncwire import get_codec, iter_chunks, wire_name  # noqa: E402
from syncwire.codecs import slices  # noqa: E402

parser = argparse.ArgumentParser(description="The hub's receive, fold, merge and version build on one model.")
parser.add_argument("--model", choices=sorted(rb.MODELS), default="gpt2")
parser.add_argument("--peers", type=int, default=2)
parser.add_argument("--codecs", nargs="+", default=["fp32", "int8"])
parser.add_argument("--reps", type=int, default=5, help="rounds timed per codec; seconds are the best")
parser.add_argument("--outer", choices=["avg", "diloco"], default="avg")
parser.add_argument("--data-root", type=Path, default=None, help="where the store goes (its disk counts)")
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")
parser.add_argument("--fold-threads", type=int, default=default_fold_threads(), help="as the hub's SYNC_FOLD_THREADS")


PIECE = (256 << 10) - 1  # odd: values split across pieces and the hub's 8 MiB batches, as reads do
PHASES = ("receive", "fold", "merge", "version")


def body(tensors: dict[str, dict[str, np.ndarray]], codec_spec: str) -> bytes:
    """A wire file as a peer uploads it: each tensor's encoded parts, in the codec's names."""
    items = [(wire_name(n, s), a, None) for n, parts in tensors.items() for s, a in parts.items()]
    return b"".join(bytes(chunk) for chunk in iter_chunks(items, metadata={"codec": codec_spec}))


def write_file(store: Store, key: Any, data: bytes) -> None:
    with store.write(key) as f:
        f.write(data)


def received(store: Store, data: bytes) -> None:
    """``data`` through the hub's upload path, in pieces as a socket gives them; then dropped."""

    async def pieces() -> Any:
        view = memoryview(data)
        for i in range(0, len(data), PIECE):
            yield bytes(view[i : i + PIECE])  # the server hands the app fresh bytes objects

    size, anything = len(data), lambda _: None  # the bench's bodies are right by construction
    upload = store.fresh_upload()
    got = asyncio.run(receive(pieces(), upload, max_bytes=size, content_length=size, check_header=anything))
    got.staged.discard()


def encoded(codec: Any, array: np.ndarray) -> dict[str, np.ndarray]:
    """``array`` encoded a slice at a time, as the SDK does, joined per part. Not the SDK's
    ``UpdateState.encode``: its reused buffers and encode threads, living in this process, made
    the timed receive 1.4-2.1 s instead of 0.9 s; the hub's process never holds a peer's state."""
    flat = array.reshape(-1)
    pieces = [codec.encode(flat[start:stop]) for start, stop, _ in slices(codec, array.shape)]
    return {s: np.concatenate([np.asarray(p[s]).reshape(-1) for p in pieces]) for s in pieces[0]}


def one_codec(spec: str, args: argparse.Namespace, schema: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    codec = get_codec(spec)
    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="bench-hub-", dir=args.data_root))
    store = Store(work)
    engine = MergeEngine(store, args.fold_threads)
    run = "close"
    model = {n: (rng.standard_normal(s, dtype=np.float32) * 0.02) for n, s in schema.items()}
    write_file(store, VersionKey(run, 0), body({n: {"": a} for n, a in model.items()}, "fp32"))
    del model
    timings: dict[str, list[float]] = {k: [] for p in PHASES for k in (p, p + "_cpu")}

    @contextlib.contextmanager
    def timed(phase: str) -> Iterator[None]:
        cpu, wall = time.process_time(), time.perf_counter()
        yield
        timings[phase].append(time.perf_counter() - wall)
        timings[phase + "_cpu"].append(time.process_time() - cpu)

    try:
        for v in range(args.reps):
            peers = [f"p{k}" for k in range(args.peers)]
            for k, peer in enumerate(peers):
                delta = {n: encoded(codec, rng.standard_normal(s, dtype=np.float32) * 1e-3) for n, s in schema.items()}
                data = body(delta, codec.spec)
                if k == 0:
                    with timed("receive"):
                        received(store, data)
                write_file(store, UpdateKey(run, v, peer), data)
                del delta, data
            acc = Accumulator(schema)
            keys = [(UpdateKey(run, v, peer), 1000.0 + k) for k, peer in enumerate(peers)]
            with timed("fold"):
                for key, weight in keys[:-1]:
                    engine.fold(acc, key, weight, codec)
            with timed("merge"):
                outer, total = Outer(args.outer, 0.7, 0.9), sum(w for _, w in keys)
                engine.merge(RoundMerge(run, v, acc, codec, outer, total=total, fraction=math.inf, unfolded=keys[-1:]))
            with timed("version"):
                engine.build_versions(run, v + 1, codec, schema)
            store.prune(run, v + 1, keep=1)  # as the hub does: the closed round's files go
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    row: dict[str, Any] = {"codec": spec, "peers": args.peers, "outer": args.outer}
    for phase, values in timings.items():
        row[phase] = min(values)
        row[phase + "_median"] = statistics.median(values)
    print(f"{spec}: " + ", ".join(f"{p} {row[p]:.3f} s ({row[p + '_median']:.3f})" for p in PHASES), flush=True)
    return row


def main() -> None:
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    schema = rb.model_schema(args.model)
    mb = sum(math.prod(s) * 4 for s in schema.values()) / 1e6
    print(f"model {args.model}: {mb:.1f} MB fp32, {args.peers} peers, {os.cpu_count()} cores", flush=True)
    rows = [one_codec(spec, args, schema) for spec in args.codecs]
    lines = [
        "| codec | " + " | ".join(f"{p} s (median) | {p} CPU s" for p in PHASES) + " |",
        "|---|" + "---|---|" * 4,
    ]
    for r in rows:
        cells = [f"{r[p]:.3f} ({r[p + '_median']:.3f}) | {r[p + '_cpu']:.2f}" for p in PHASES]
        lines.append(f"| {r['codec']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    rb.write_result("hub", args, started, schema, rows=rows, table=table)


if __name__ == "__main__":
    main()
