"""Issue 24, part 3: a round's close with K reducers sharing the merge, against the hub alone.

    python bench/reducers.py                                  # GPT-2 124M, 2 peers, fp32 and int8, K = 0 1 2 4
    python bench/reducers.py --peers 4 --codecs int8 --reducers 0 2
    python bench/reducers.py --model tiny --rounds 1          # seconds (the smoke test)

For each codec and K: a real hub (``python -m syncserver serve --reducers K``, K = 0: today's
in-process merge on ``SYNC_FOLD_THREADS`` threads) and N SDK peers in threads of this process,
each on a lean module with GPT-2's parameter names and shapes (bench/round.py's): no training,
each round a seeded perturbation, so every K gets the same updates. The peers sync one after
the other (each starts once the one before is acknowledged: racing peers are acknowledged in
an order that differs between hubs, and float32 sums in another order differ in their last bits);
**close** is the hub's own time from the close's start (right at the last acknowledgement) to
the round's commit, as the round record has it (``fold`` + ``merge``: the wait for a fold under
way, then the merge; with reducers, the leases' work, their HTTP and the outputs' fsync).
The first round of each hub writes into fresh files (no spares yet) and is left out: seconds
are the best (and median) of the rounds after it. Every K must end on the same model bits
(sha-256 of the hub's latest version), which the table checks.
Results: a markdown table on stdout and ``bench/results/reducers-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import round as rb  # noqa: E402 (model shapes, the lean model, the result file)

from syncclient import SyncClient  # noqa: E402
from syncserver.process import ServerProcess  # noqa: E402
from syncserver.reduce.plan import PART_MIN, imbalance, multi_part, pieces, plan  # noqa: E402
from syncwire import get_codec  # noqa: E402

parser = argparse.ArgumentParser(description="A round's close with K reducers against the hub alone.")
parser.add_argument("--model", choices=sorted(rb.MODELS), default="gpt2")
parser.add_argument("--peers", type=int, default=2)
parser.add_argument("--codecs", nargs="+", default=["fp32", "int8"])
parser.add_argument("--reducers", type=int, nargs="+", default=[0, 1, 2, 4], help="K values (0: the hub alone)")
parser.add_argument("--rounds", type=int, default=3, help="rounds per hub; the first is left out when there are more")
parser.add_argument("--out", type=Path, default=BENCH / "results")
parser.add_argument("--data-root", type=Path, default=None, help="where the hubs' data dirs go (default: temp dir)")


def perturb(model: Any, seed: int) -> None:
    """A peer's "training": a seeded change of every parameter (the same for every K)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


def one_hub(codec: str, k: int, args: argparse.Namespace, schema: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-reducers-{codec}-{k}-", dir=args.data_root))
    serve = ["-m", "syncserver", "serve", "--host", "127.0.0.1", "--data-dir", str(work / "data")]
    settings = ["--min-peers", str(args.peers), "--codec", codec, "--reducers", str(k), "--log-level", "warning"]
    server = ServerProcess([sys.executable, *serve, *settings], log=work / "hub.log", cwd=BENCH.parent)
    url = server.start()
    names = [f"p{i}" for i in range(args.peers)]
    clients = {n: SyncClient(url, run="bench", peer=n, timeout=600.0) for n in names}
    models = {n: rb.lean_model(schema, seed=0) for n in names}
    errors: list[BaseException] = []

    def each(fn: Any, one_by_one: bool = False) -> None:
        """``fn(name)`` for every peer in threads; ``one_by_one``: each next peer starts once the
        hub has acknowledged the one before (a fixed acknowledgement order, so that every K folds
        the same updates in the same order: racing peers would make the bits differ by order)."""

        def target(n: str) -> None:
            try:
                fn(n)
            except BaseException as exc:
                errors.append(exc)

        threads = []
        for i, n in enumerate(names):
            threads.append(threading.Thread(target=target, args=(n,)))
            threads[-1].start()
            while one_by_one and i < len(names) - 1 and not errors:
                submitted = httpx.get(f"{url}/v1/runs/bench", timeout=60).json()["open_round"]["submitted"]
                if n in submitted:
                    break
                time.sleep(0.02)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    try:
        each(lambda n: clients[n].join(models[n]))
        for r in range(args.rounds):

            def sync(n: str, r: int = r) -> None:
                perturb(models[n], 1000 * r + names.index(n))
                clients[n].sync(models[n], samples=8 + names.index(n))

            each(sync, one_by_one=True)
        state = httpx.get(f"{url}/v1/runs/bench", timeout=60).json()
        model = httpx.get(f"{url}/v1/runs/bench/model", timeout=600)
        model.raise_for_status()
        digest = hashlib.sha256(model.content).hexdigest()
        reducers = httpx.get(f"{url}/v1/reduce/reducers", timeout=60).json() if k else []
    finally:
        for c in clients.values():
            c.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    rounds = sorted(state["rounds"], key=lambda x: x["round"])
    closes = [x["timings"]["fold"] + x["timings"]["merge"] for x in rounds]
    timed = closes[1:] if len(closes) > 1 else closes
    row = {
        "codec": codec,
        "reducers": k,
        "peers": args.peers,
        "close": min(timed),
        "close_median": statistics.median(timed),
        "closes": closes,
        "model_sha256": digest,
        "leases": {r["name"]: {"leases": r["leases"], "seconds": r["seconds"]} for r in reducers},
    }
    print(f"{codec} K={k}: close {row['close']:.3f} s (median {row['close_median']:.3f}) of {closes}", flush=True)
    return row


def plans(schema: dict[str, tuple[int, ...]], codecs: list[str]) -> list[dict[str, Any]]:
    """How evenly the leases cut the model (from its shapes alone): the largest lease's update
    bytes over a K-th of them (1.00: even), for K = 2, 4, 8; on local disk (the hub's plan) and
    with S3's 5 MiB part floor (a bucket's, whose small leases join a neighbour)."""
    out = []
    for spec in codecs:
        codec = get_codec(spec)
        items = pieces(codec, codec, schema)
        for k in (2, 4, 8):
            local = plan(items, k, whole_tensors=multi_part(codec))
            s3 = plan(items, k, whole_tensors=multi_part(codec), min_writes=PART_MIN)
            out.append(
                {
                    "codec": spec,
                    "k": k,
                    "leases": len(local),
                    "imbalance": imbalance(local, k),
                    "leases_s3": len(s3),
                    "imbalance_s3": imbalance(s3, k),
                }
            )
    return out


def main() -> None:
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    schema = rb.model_schema(args.model)
    cuts = plans(schema, args.codecs)
    print("| codec | K | leases | largest / (all / K) | with 5 MiB parts: leases | largest / (all / K) |")
    print("|---|---|---|---|---|---|")
    for c in cuts:
        print(
            f"| {c['codec']} | {c['k']} | {c['leases']} | {c['imbalance']:.3f} | {c['leases_s3']} | "
            f"{c['imbalance_s3']:.3f} |",
            flush=True,
        )
    rows = [one_hub(codec, k, args, schema) for codec in args.codecs for k in args.reducers]
    lines = ["| codec | K | close (s), best | median | vs K=0 | same bits as K=0 |", "|---|---|---|---|---|---|"]
    for row in rows:
        base = next(r for r in rows if r["codec"] == row["codec"] and r["reducers"] == args.reducers[0])
        same = "yes" if row["model_sha256"] == base["model_sha256"] else "NO"
        ratio = row["close"] / base["close"] if base["close"] else float("nan")
        lines.append(
            f"| {row['codec']} | {row['reducers']} | {row['close']:.3f} | {row['close_median']:.3f} | "
            f"{ratio:.2f}x | {same} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    rb.write_result("reducers", args, started, schema, rows=rows, table=table, plans=cuts)
    if any("NO" in line for line in lines):
        raise SystemExit("a K ended on other bits than the hub alone")


if __name__ == "__main__":
    main()
