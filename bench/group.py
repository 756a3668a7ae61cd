"""What a peer made of several ranks pays per sync: a 2-rank peer against a 1-rank one.

    python bench/group.py                          # GPT-2 124M shapes: 1 rank, 2 ranks DDP, 2 ranks FSDP
    python bench/group.py --model tiny --syncs 1 --warmup 0   # seconds (the smoke test)
    python bench/group.py --backend nccl           # on a machine with 2 GPUs

One peer, one real hub (``python -m syncserver serve`` on a loopback port, ``--min-peers 1``),
``torchrun --standalone --nproc-per-node P`` ranks each holding a lean module with GPT-2's parameter
names and shapes (bench/round.py's). Each sync: every rank adds the same small random delta, then
``SyncClient.sync`` (P = 1: a plain client; P > 1: ``group=WORLD``, so rank 0 talks to the hub and
the group gathers and scatters). Timed on every rank from a barrier to ``sync`` returning; a sync's
time is its slowest rank's. The extra time of a group is what its collectives add (DDP: a JSON
broadcast and a broadcast of every tensor; FSDP: a full-state-dict gather to rank 0 and a
broadcast-and-shard back), measured as the difference to the 1-rank peer in the same run, beside the
floor: the same tensors broadcast alone (``dist.broadcast`` each, as the scatter does).

After every sync all ranks must hold the hub's version bit for bit (sha-256 against the hub's file).
Results: a markdown table on stdout and ``bench/results/group-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(BENCH)]

from round import Server, git_state, lean_model, model_schema, version_digest  # noqa: E402

CASES = [("plain", 1), ("ddp", 2), ("fsdp", 2)]


# -----------------------------------------------------------------------------
# a rank (under torchrun)
def _full(model: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}


def _digest(tensors: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for t in tensors.values():
        h.update(t.detach().contiguous().numpy().reshape(-1).view("u1"))
    return h.hexdigest()


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from syncclient import SyncClient

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend)
    model = lean_model(model_schema(args.model), seed=7)  # the same on every rank, as under DDP
    group = dist.group.WORLD if args.mode != "plain" else None
    client = SyncClient(args.hub, run=args.job, peer="p", min_peers=1, timeout=600, group=group, codec="fp32")
    client.join(model)
    if args.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    times, floor = [], []
    for i in range(args.warmup + args.syncs):  # the warm-up syncs first, untimed
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p  # FSDP: this rank's shard
                local.add_(torch.randn(local.shape, generator=gen), alpha=1e-3)
        dist.barrier()
        start = time.perf_counter()
        result = client.sync(model, samples=1)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        digest = _digest(_full(model))
        if rank == 0:
            hub_version, hub_digest = version_digest(args.hub, Path(args.data_dir), args.job)
            assert hub_version == result.version and hub_digest == digest, "rank 0 differs from the hub"
        mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
        digests = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(digests, mine)
        assert all(torch.equal(d, mine) for d in digests), f"ranks differ after version {result.version}"
        if i >= args.warmup:
            times.append(float(took.item()))
    if args.mode == "ddp":  # the floor of the scatter: every tensor broadcast from rank 0
        for _ in range(args.syncs):
            dist.barrier()
            start = time.perf_counter()
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            floor.append(float(took.item()))
    client.leave()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"sync_s": times, "broadcast_s": floor}))
    dist.destroy_process_group()


# -----------------------------------------------------------------------------
# the driver
def run_case(mode: str, ranks: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = work / f"{mode}-{ranks}"
    server = Server(["-m", "syncserver", "serve", "--host", "127.0.0.1", "--data-dir", str(data)], work / "hub.log")
    out = work / f"{mode}-{ranks}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(BENCH)]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    command += [__file__, "--as-rank", "--hub", server.url, "--job", f"{mode}{ranks}", "--mode", mode]
    command += ["--model", args.model, "--syncs", str(args.syncs), "--warmup", str(args.warmup)]
    command += ["--backend", args.backend]
    command += ["--data-dir", str(data), "--out", str(out)]
    try:
        proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{mode} x{ranks} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    finally:
        server.stop()
    measured = json.loads(out.read_text())
    return {"mode": mode, "ranks": ranks, **measured}


def markdown(rows: list[dict[str, Any]]) -> str:
    base = statistics.median(rows[0]["sync_s"])
    lines = [
        "| peer | sync s (median) | vs 1 rank | extra s | broadcast alone s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        sync = statistics.median(r["sync_s"])
        floor = f"{statistics.median(r['broadcast_s']):.2f}" if r["broadcast_s"] else ""
        name = "1 rank" if r["ranks"] == 1 else f"{r['ranks']} ranks, {r['mode'].upper()}"
        lines.append(f"| {name} | {sync:.2f} | {sync / base:.2f}x | {sync - base:+.2f} | {floor} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["gpt2", "small", "tiny"], default="gpt2")
    p.add_argument("--syncs", type=int, default=5, help="timed syncs per case (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="untimed syncs per case first")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--modes", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    p.add_argument("--results", type=Path, default=BENCH / "results")
    p.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)  # run as one rank
    for flag in ("--hub", "--job", "--mode", "--data-dir", "--out"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_rank:
        return rank_main(args)
    if args.syncs < 1:
        p.error("--syncs must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-group-") as tmp:
        for mode, ranks in [c for c in CASES if c[0] == "plain" or c[0] in args.modes]:
            rows.append(run_case(mode, ranks, args, Path(tmp)))
            print(f"{mode} x{ranks}: {statistics.median(rows[-1]['sync_s']):.2f} s per sync", flush=True)
    table = markdown(rows)
    print(table)
    record = {
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        "machine": f"{platform.node()} {os.cpu_count()} cpus, {platform.processor() or platform.machine()}",
        "commit": git_state(),
        "model": args.model,
        "backend": args.backend,
        "rows": rows,
        "table": table,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"group-{record['date']}.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")


if __name__ == "__main__":
    main()
