"""Overlap: how long a sync stalls training, blocking (``sync``) against overlapped (``sync_async``).

    python bench/overlap.py                          # 2 peers, GPT-2 4 layers x 256, both modes
    python bench/overlap.py --sync-every 10 --syncs 8 --codec bf16

For each mode: a real hub process (``python -m syncserver serve`` on a free loopback port, its
own temp data dir) and ``--peers`` peer processes (``--threads`` torch threads each), each
training a randomly initialised GPT-2 (``--layers``, ``--width``, ``--vocab``, ``--context``)
with AdamW on its own random tokens, the same seeds in both modes, and syncing every
``--sync-every`` steps, ``--syncs`` times, then training ``--sync-every`` more steps (so the
last overlapped sync can land) and making one final blocking sync (not counted) after which
every peer must hold the hub's last version bit for bit (checked by sha-256).

Measured on each peer's training thread, per sync (mean over syncs and peers):

- **stall**: wall time of the sync work on the training thread. Blocking: the whole
  ``sync()``. Overlap: ``sync_async()`` (the snapshot; the encode runs beside the upload)
  + ``apply()`` (the correction, and any wait for a result still out when the next sync is due).
- **slowdown**: what a sync costs the steps around it: the sum, over the steps trained while
  it is in flight and the first step after it landed, of (step time - the median time of the
  other steps). Overlap: the background thread's digest, upload and decode, and the hub's
  merge, compete with training for the cores. Blocking: only the step after the sync (cold
  caches, the hub still writing the version).
- **wall**: the training loop's wall time (join and the final sync excluded).

Results: a markdown table on stdout and ``bench/results/overlap-<date>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import record  # bench/record.py: this script's folder is first on sys.path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO)]

from syncserver.process import ServerProcess  # noqa: E402 (after the path above)

# -----------------------------------------------------------------------------
# settings
parser = argparse.ArgumentParser(description="Training stall per sync, blocking vs overlapped.")
parser.add_argument("--peers", type=int, default=2, help="peer processes")
parser.add_argument("--modes", nargs="+", choices=["blocking", "overlap"], default=["blocking", "overlap"])
parser.add_argument("--layers", type=int, default=4, help="GPT-2 layers")
parser.add_argument("--width", type=int, default=256, help="GPT-2 width (n_embd); 4 heads")
parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (50257 is GPT-2's: 3x the step time)")
parser.add_argument("--context", type=int, default=128, help="tokens per sequence (and n_positions)")
parser.add_argument("--batch", type=int, default=4, help="sequences per step")
parser.add_argument("--sync-every", type=int, default=5, help="optimizer steps between syncs")
parser.add_argument("--syncs", type=int, default=6, help="measured syncs per peer")
parser.add_argument("--codec", default="fp32", help="the run's codec")
parser.add_argument("--threads", type=int, default=1, help="torch threads per peer")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")
# internal: one peer process
parser.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)


#: what a peer process is told (the rest is the driver's)
PEER_SETTINGS = (
    "peers",
    "layers",
    "width",
    "vocab",
    "context",
    "batch",
    "sync_every",
    "syncs",
    "codec",
    "threads",
    "seed",
)


def weights_digest(model: Any) -> str:
    from syncclient.weights import ModelView

    h = hashlib.sha256()
    for name, array in sorted(ModelView(model).export().items()):
        h.update(name.encode())
        h.update(array.tobytes())
    return h.hexdigest()


# -----------------------------------------------------------------------------
# one peer: train, sync, time every step
def peer(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from syncclient import PendingSync, SyncClient

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the same init everywhere (join makes it so anyway)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.width,
        n_head=4,
        vocab_size=args.vocab,
        n_positions=args.context,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    client = SyncClient(
        args.url,
        run=f"overlap-{args.mode}",
        peer=f"peer{args.peer}",
        min_peers=args.peers,
        codec=args.codec,
        round_timeout=600,
        timeout=120,
        retry_seconds=120,
    )
    client.join(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(1000 + args.peer)
    n, overlap = args.sync_every, args.mode == "overlap"
    total = n * (args.syncs + 1)  # the last n steps let the last overlapped sync land
    stall: dict[int, float] = {}  # round -> seconds of sync work on this thread
    results: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    pending: PendingSync | None = None
    landed = False  # a sync landed since the last step began

    def land(block: bool) -> None:
        nonlocal pending, landed
        if pending is None or not (block or pending.done()):
            return
        t = time.perf_counter()
        result = pending.apply(model)
        stall[pending.round] = stall.get(pending.round, 0.0) + time.perf_counter() - t
        results.append({**result.__dict__, "round": pending.round})
        pending, landed = None, True

    started = time.perf_counter()
    for step in range(1, total + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.context), generator=gen)
        in_flight, after, landed = pending is not None, landed, False
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        land(block=False)
        if step % n == 0 and step <= n * args.syncs:
            land(block=True)  # the previous round, if still out
            round_ = client.version
            metrics = {"loss": loss.item(), "step": float(step)}
            t = time.perf_counter()
            if overlap:
                pending = client.sync_async(model, samples=args.batch * n, metrics=metrics)
            else:
                result = client.sync(model, samples=args.batch * n, metrics=metrics)
                results.append({**result.__dict__, "round": round_})
                landed = True
            stall[round_] = stall.get(round_, 0.0) + time.perf_counter() - t
        steps.append(
            {"step": step, "train": t1 - t0, "sync": time.perf_counter() - t1, "in_flight": in_flight, "after": after}
        )
    land(block=True)
    wall = time.perf_counter() - started
    t = time.perf_counter()
    final = client.sync(model, samples=args.batch * n)  # all peers identical again
    final_seconds = time.perf_counter() - t
    digest = weights_digest(model)
    client.leave()
    return {
        "peer": args.peer,
        "stall": [stall[r] for r in sorted(stall)],
        "results": results,
        "steps": steps,
        "wall": wall,
        "final_version": final.version,
        "final_seconds": final_seconds,
        "digest": digest,
        "params": sum(p.numel() for p in model.parameters()),
    }


# -----------------------------------------------------------------------------
# the driver: a hub and the peers per mode, then the table
def run_mode(args: argparse.Namespace, mode: str, tmp: Path) -> dict[str, Any]:
    data = tmp / f"hub-{mode}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    serve = [
        sys.executable,
        "-m",
        "syncserver",
        "serve",
        "--host=127.0.0.1",
        f"--data-dir={data}",
        "--log-level=warning",
    ]
    hub = ServerProcess(serve, log=tmp / f"hub-{mode}.log", env=env, cwd=REPO)
    try:
        import httpx

        url = hub.start()
        shared = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in PEER_SETTINGS]
        procs = []
        for i in range(args.peers):
            cmd = [sys.executable, __file__, *shared, "--peer", str(i), "--url", url, "--mode", mode]
            procs.append(subprocess.Popen([*cmd, "--result", str(tmp / f"{mode}-{i}.json")], cwd=REPO, env=env))
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"a {mode} peer failed (exit {p.returncode})")
        peers = [json.loads((tmp / f"{mode}-{i}.json").read_text()) for i in range(args.peers)]
        r = httpx.get(f"{url}/v1/runs/overlap-{mode}/model")
        r.raise_for_status()
    finally:
        hub.stop(timeout=30)
    import safetensors.numpy

    hub_weights = safetensors.numpy.load(r.content)
    h = hashlib.sha256()
    for name in sorted(hub_weights):  # the tied lm_head is not on the wire: export skips it too
        h.update(name.encode())
        h.update(hub_weights[name].tobytes())
    if {p["digest"] for p in peers} != {h.hexdigest()}:
        raise AssertionError(f"{mode}: peers and hub disagree after the final sync")
    return summarise(mode, peers)


def summarise(mode: str, peers: list[dict[str, Any]]) -> dict[str, Any]:
    stalls = [s for p in peers for s in p["stall"]]
    slowdowns, medians = [], []
    for p in peers:
        steps = p["steps"][2:]  # the first steps warm up allocators and caches
        near = [s["in_flight"] or s["after"] for s in steps]
        base = statistics.median(s["train"] for s, busy in zip(steps, near, strict=True) if not busy)
        medians.append(base)
        extra = sum(s["train"] - base for s, busy in zip(steps, near, strict=True) if busy)
        slowdowns.append(extra / max(1, len(p["stall"])))
    return {
        "mode": mode,
        "syncs": len(stalls),
        "stall_mean": statistics.mean(stalls),
        "stall_min": min(stalls),
        "stall_max": max(stalls),
        "slowdown_per_sync": statistics.mean(slowdowns),
        "step_median": statistics.mean(medians),
        "wall": max(p["wall"] for p in peers),
        "client_stall_mean": statistics.mean(r["stall_seconds"] for p in peers for r in p["results"]),
        "sync_seconds_mean": statistics.mean(r["seconds"] for p in peers for r in p["results"]),
        "bytes_up": peers[0]["results"][0]["bytes_up"],
        "params": peers[0]["params"],
        "peers": peers,
    }


def main() -> None:
    args = parser.parse_args()
    if args.peer is not None:  # a peer process
        args.result.write_text(json.dumps(peer(args)))
        return
    started = datetime.datetime.now(datetime.UTC)
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        rows = [run_mode(args, mode, Path(tmp)) for mode in args.modes]
    settings = {k: v for k, v in vars(args).items() if k not in ("peer", "url", "mode", "result", "out")}
    print(
        f"\nGPT-2 {args.layers}x{args.width}, vocab {args.vocab} ({rows[0]['params'] / 1e6:.1f} M parameters, "
        f"{rows[0]['bytes_up'] / 1e6:.1f} MB per update, codec {args.codec}), {args.peers} peers x "
        f"{args.threads} thread(s), batch {args.batch}x{args.context}, sync every {args.sync_every} steps, "
        f"{args.syncs} syncs per peer; {os.cpu_count()} CPUs\n"
    )
    print(
        "| mode | stall per sync, mean (min-max) | slowdown of the steps around it | stall + slowdown "
        "| sync start to applied | median step | training wall |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['stall_mean']:.3f} s ({r['stall_min']:.3f}-{r['stall_max']:.3f}) "
            f"| {r['slowdown_per_sync']:.3f} s | {r['stall_mean'] + r['slowdown_per_sync']:.3f} s "
            f"| {r['sync_seconds_mean']:.3f} s | {r['step_median']:.3f} s | {r['wall']:.1f} s |"
        )
    by = {r["mode"]: r for r in rows}
    if {"blocking", "overlap"} <= by.keys():
        ratio = by["overlap"]["stall_mean"] / by["blocking"]["stall_mean"]
        with_slowdown = (by["overlap"]["stall_mean"] + by["overlap"]["slowdown_per_sync"]) / by["blocking"][
            "stall_mean"
        ]
        print(
            f"\noverlap stall / blocking stall: {ratio:.1%} (target <= 10%: {'met' if ratio <= 0.10 else 'missed'}); "
            f"stall + slowdown against the blocking one's: {with_slowdown:.1%}"
        )
    record.save(args.out / f"overlap-{started:%Y-%m-%d}.json", started, settings=settings, rows=rows)


if __name__ == "__main__":
    main()
