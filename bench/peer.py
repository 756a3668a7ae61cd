"""Where a peer's CPU goes in one sync, phase by phase, old way against new: ``python bench/peer.py``.

bench/wire.py times whole rounds over shaped links; on a 2-core machine the hub and every peer
share the CPU there, so a peer's own costs are hard to read off it. This times them alone, in
one peer process, on GPT-2 124M's tensors (bench/round.py's schema, random values):

- **encode**: ``UpdateState.encode`` of ``local - base`` (plus the error-feedback residual), on
  one thread (as before) and on the SDK's encode threads (``min(4, cores)``);
- **digest**: the sha-256 of the body (``Content-Digest``), which must precede the upload;
- **download + fold**: the encoded update served by a raw uvicorn app in a process of its own
  on loopback (no hub work), received as the SDK receives a result: with httpcore's 64 KiB reads
  and the fold after the body (as before), or with 1 MiB reads and the fold while it arrives
  (the SDK now). Wall seconds and the peer's CPU seconds (user + system, this process).

Each case runs ``--reps`` times, cases interleaved, each time after one untimed run of the same
case (steady state: see :func:`timed`); the table gives the best and the median.
Results: a markdown table on stdout and ``bench/results/peer-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import round as rb  # noqa: E402 (bench/round.py: the model's schema)

from syncclient import transport as transport_module  # noqa: E402
from syncclient import update as update_module  # noqa: E402
from syncclient.update import UpdateState  # noqa: E402
from syncwire import StreamReader, get_codec, iter_chunks  # noqa: E402

# -----------------------------------------------------------------------------
parser = argparse.ArgumentParser(description="A peer's CPU per sync phase, old way against new.")
parser.add_argument("--model", choices=sorted(rb.MODELS), default="gpt2")
parser.add_argument("--codecs", nargs="+", default=["fp32", "int8"])
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--out", type=Path, default=BENCH / "results")

SERVER = """
import sys

import uvicorn

body = open(sys.argv[1], "rb").read()


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    head = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    for i in range(0, len(body), 4 << 20):
        await send({"type": "http.response.body", "body": body[i : i + (4 << 20)], "more_body": True})
    await send({"type": "http.response.body", "body": b""})


uvicorn.run(app, host="127.0.0.1", port=0, loop="uvloop", http="httptools", log_level="info")
"""


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(work: Callable[[], object]) -> tuple[float, float]:
    """(wall s, CPU s of this process) of ``work()``, run once before untimed: the first run
    after another case pays page faults for memory the allocator gave back meanwhile (1.3 s
    for GPT-2's 500 MB here), which would be charged to whichever case runs first."""
    work()
    c, t = cpu(), time.perf_counter()
    work()
    return time.perf_counter() - t, cpu() - c


def _digest(parts: list, spec: str) -> str:
    """The body's digest, taken as the SDK takes it while the body goes out."""
    digest = transport_module.Digest()
    size = sum(len(chunk) for chunk in digest.watch(iter_chunks(parts, {"codec": spec})))
    return digest.value(size)


def serve(body: bytes, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A raw ASGI app serving ``body`` on a free loopback port, in a process of its own."""
    (folder / "body").write_bytes(body)
    (folder / "serve.py").write_text(SERVER)
    command = [sys.executable, str(folder / "serve.py"), str(folder / "body")]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, cwd=folder)
    assert proc.stderr is not None
    for line in proc.stderr:
        text = line.decode(errors="replace")
        if "running on http://" in text:
            return proc, text.split("running on ")[1].split()[0]
    raise RuntimeError("the body server did not start")


def measure(spec: str, base: dict[str, np.ndarray], local: dict[str, np.ndarray], reps: int) -> list[dict]:
    """Every phase of one codec's sync, ``reps`` times, interleaved: wall and CPU seconds."""
    import httpx

    codec = get_codec(spec)
    samples: dict[str, list[tuple[float, float]]] = {}
    state = UpdateState(codec, {n: b.copy() for n, b in base.items()})
    parts = state.encode(local).wait().parts
    body = b"".join(bytes(c) for c in iter_chunks(parts, {"codec": codec.spec}))
    one_thread = ThreadPoolExecutor(1)

    def download(client: httpx.Client, url: str, reader: StreamReader) -> None:
        with client.stream("GET", url) as r:
            for chunk in r.iter_bytes(1 << 20):
                reader.feed(chunk)

    def after(client: httpx.Client, url: str) -> None:  # as the SDK did: whole body, then fold
        reader = StreamReader()
        download(client, url, reader)
        state.fold(reader.tensors, reader.metadata.get("codec"))

    def streamed(client: httpx.Client, url: str) -> None:  # as the SDK does now
        fold = state.stream_fold()
        download(client, url, StreamReader(on_tensor=fold.take))
        fold.finish()

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = serve(body, Path(tmp))
        try:
            plain = httpx.Client(timeout=60)
            sdk = transport_module.Transport(url, run="bench", token=None, verify=True, timeout=60, retry_seconds=10)
            threads = update_module._pool()._max_workers
            for _ in range(reps):
                with mock.patch.object(update_module, "_pool", lambda: one_thread):
                    samples.setdefault("encode, 1 thread", []).append(timed(lambda: state.encode(local).wait()))
                samples.setdefault(f"encode, {threads} threads", []).append(timed(lambda: state.encode(local).wait()))
                digest = timed(lambda: _digest(parts, codec.spec))
                samples.setdefault("digest", []).append(digest)
                old = timed(lambda: after(plain, url))
                samples.setdefault("download + fold: 64 KiB reads, fold after", []).append(old)
                new = timed(lambda: streamed(sdk.http, url))
                samples.setdefault("download + fold: 1 MiB reads, fold while it arrives", []).append(new)
            plain.close()
            sdk.close()
        finally:
            proc.terminate()
            proc.wait()
    rows = []
    for case, runs in samples.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        row = {"codec": spec, "case": case, "wall_best": min(walls), "wall_median": statistics.median(walls)}
        rows.append(row | {"cpu_best": min(cpus), "cpu_median": statistics.median(cpus), "runs": runs})
        print(f"{spec} {case}: wall {min(walls):.2f}s, cpu {min(cpus):.2f}s", flush=True)
    return rows


def main() -> None:
    args = parser.parse_args()
    schema = rb.model_schema(args.model)
    rng = np.random.default_rng(0)
    base = {n: rng.standard_normal(s, dtype=np.float32) for n, s in schema.items()}
    local = {n: b + np.float32(1e-3) * rng.standard_normal(b.shape, dtype=np.float32) for n, b in base.items()}
    rows = [row for spec in args.codecs for row in measure(spec, base, local, args.reps)]
    table = ["| codec | phase | wall s best (median) | peer CPU s best (median) |", "|---|---|---|---|"]
    table += [
        f"| {r['codec']} | {r['case']} | {r['wall_best']:.2f} ({r['wall_median']:.2f}) "
        f"| {r['cpu_best']:.2f} ({r['cpu_median']:.2f}) |"
        for r in rows
    ]
    print("\n".join(table))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"peer-{datetime.date.today()}.json"
    machine = f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    out.write_text(json.dumps({"command": sys.argv, "machine": machine, "rows": rows, "table": table}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
