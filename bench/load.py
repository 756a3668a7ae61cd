"""Load test: many peers, one hub, many rounds. Does every round complete, does any request
fail, does the hub's memory stay bounded?

    python bench/load.py                                  # 64 peers x 20 rounds, 1M params, + baseline 8
    python bench/load.py --peers 64 --rounds 20 --procs 4 --baseline 8
    python bench/load.py --peers 16 --rounds 3 --params 65536 --baseline 0   # seconds

One hub process (``python -m syncserver serve`` on a free loopback port, its own temp data
dir, ``--log-level warning``) and ``--peers`` real ``SyncClient`` peers, as threads spread over
``--procs`` processes (threads share one GIL; a few processes share the 2 cores better). Each
peer holds a small MLP (``--params`` float32 parameters), perturbs it (its "training") and
calls ``sync()`` straight away, every round, so the hub sees all peers at once.

Measured:

- **round overhead**: per round, from the last peer's upload start (``sync()`` called) to the
  last peer holding the new version (``sync()`` returned): what the hub and the wire add to a
  round once everyone has finished training. p50 and p99 over the rounds (with 20 rounds the
  p99 is the worst round).
- **failures**: exceptions raised by ``join``/``sync``/``leave``, plus every retry the SDK
  logged (``hub trouble``: a 5xx, a timeout, a refused connection). Must be 0.
- **complete rounds**: every peer's ``sync()`` returned version r+1 without catching up, and
  the hub's round record lists every peer as a participant, none dropped.
- **hub RSS**: VmHWM of the hub process (its peak resident memory over the whole run), and
  VmRSS sampled after each round (to see that it does not grow with the rounds).

Prints a JSON summary; ``--out FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from syncserver.process import ServerProcess  # noqa: E402 (after the path above)


@dataclass
class LoadResult:
    peers: int
    rounds: int
    params: int
    procs: int
    complete_rounds: int
    failures: int
    failure_examples: list[str]
    overhead_seconds: list[float]  # per round
    overhead_p50: float
    overhead_p99: float
    wall_seconds: float
    hub_peak_rss_mb: float | None
    hub_rss_mb_by_round: list[float] = field(default_factory=list)
    hub_anon_mb_by_round: list[float] = field(default_factory=list)  # the heap part of it
    hub_round_seconds: list[float] = field(default_factory=list)  # hub: first update to close


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): an observed value, no interpolation."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def proc_status(pid: int) -> dict[str, float]:
    """VmHWM, VmRSS, RssAnon (heap) and RssFile (mapped files) of a process in MB (Linux)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


@contextlib.contextmanager
def hub_process(data_dir: Path, log_path: Path, *args: str) -> Iterator[tuple[str, int]]:
    """A real hub on a loopback port the OS picks: yields (url, pid)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    env["PYTHONPATH"] = str(REPO)
    serve = [sys.executable, "-m", "syncserver", "serve", "--data-dir", str(data_dir), "--log-level", "warning"]
    hub = ServerProcess([*serve, *args], log=log_path, env=env, cwd=REPO)
    try:
        url = hub.start()
        assert hub.proc is not None
        yield url, hub.proc.pid
    finally:
        hub.stop()


def mlp(params: int, seed: int) -> Any:
    """A two-layer MLP with about ``params`` float32 parameters."""
    import torch

    width = max(4, round(math.sqrt(params / 2)))
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))


class _TroubleCounter(logging.Handler):
    """Counts the SDK's retry warnings ("hub trouble ..."): each is a failed request."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def peer_group(url: str, run: str, ranks: list[int], world: int, rounds: int, params: int) -> dict[str, Any]:
    """Run some peers as threads in this process; return their timings and failures."""
    import torch

    from syncclient import SyncClient

    torch.set_num_threads(1)
    trouble = _TroubleCounter()
    logging.getLogger("syncclient").addHandler(trouble)
    logging.getLogger("syncclient").setLevel(logging.WARNING)
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def peer(rank: int) -> None:
        try:
            model = mlp(params, seed=rank)
            gen = torch.Generator().manual_seed(1000 + rank)
            client = SyncClient(url, run=run, peer=f"peer-{rank:03d}", min_peers=world, round_timeout=600,
                                timeout=120, retry_seconds=120)  # fmt: skip
            client.join(model)
            for r in range(rounds):
                with torch.no_grad():  # "training": a small step of its own
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
                started = time.time()
                result = client.sync(model, samples=100 + rank, metrics={"loss": 1.0 / (r + 1)})
                ended = time.time()
                with lock:
                    records.append({"rank": rank, "round": r, "start": started, "end": ended,
                                    "version": result.version, "caught_up": result.caught_up})  # fmt: skip
            client.leave()
        except Exception as exc:
            with lock:
                errors.append(f"peer {rank}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=peer, args=(rank,), daemon=True) for rank in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logging.getLogger("syncclient").removeHandler(trouble)
    return {"records": records, "errors": errors, "trouble": trouble.messages}


def run_load(
    url: str,
    *,
    peers: int,
    rounds: int,
    params: int = 1 << 20,
    procs: int = 1,
    hub_pid: int | None = None,
    run: str = "load",
) -> LoadResult:
    """Drive ``peers`` peers for ``rounds`` rounds against the hub at ``url``."""
    groups = [list(range(peers))[i::procs] for i in range(procs)]
    rss_by_round: list[float] = []
    anon_by_round: list[float] = []
    stop = threading.Event()
    started = time.monotonic()

    def watch_rss() -> None:
        # after each closed round, the hub's resident memory
        seen = 0
        while not stop.wait(0.2) and hub_pid is not None:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                version = httpx.get(f"{url}/v1/runs/{run}", timeout=5).json()["version"]
                while seen < version:
                    now = proc_status(hub_pid)
                    rss_by_round.append(now.get("VmRSS", math.nan))
                    anon_by_round.append(now.get("RssAnon", math.nan))
                    seen += 1

    watcher = threading.Thread(target=watch_rss, daemon=True)
    watcher.start()
    try:
        if procs == 1:
            outputs = [peer_group(url, run, groups[0], peers, rounds, params)]
        else:
            ctx = multiprocessing.get_context("spawn")  # no forked torch / httpx state
            with ctx.Pool(procs) as pool:
                outputs = pool.starmap(peer_group, [(url, run, g, peers, rounds, params) for g in groups])
    finally:
        stop.set()
        watcher.join(5)
    wall = time.monotonic() - started
    records = [rec for out in outputs for rec in out["records"]]
    problems = [e for out in outputs for e in out["errors"]] + [t for out in outputs for t in out["trouble"]]
    overhead, complete = [], 0
    for r in range(rounds):
        mine = [rec for rec in records if rec["round"] == r]
        if len(mine) == peers and all(rec["version"] == r + 1 and not rec["caught_up"] for rec in mine):
            complete += 1
        if mine:
            overhead.append(max(rec["end"] for rec in mine) - max(rec["start"] for rec in mine))
    status = httpx.get(f"{url}/v1/runs/{run}", timeout=10).json()
    hub_rounds = [rec for rec in status["rounds"] if rec["round"] < rounds]  # its last 50 rounds
    partial = sum(len(rec["participants"]) != peers or bool(rec["dropped"]) for rec in hub_rounds)
    return LoadResult(
        peers=peers,
        rounds=rounds,
        params=sum(math.prod(s) for s in _schema(params).values()),
        procs=procs,
        complete_rounds=complete - partial,
        failures=len(problems),
        failure_examples=problems[:5],
        overhead_seconds=[round(x, 4) for x in overhead],
        overhead_p50=round(percentile(overhead, 50), 4),
        overhead_p99=round(percentile(overhead, 99), 4),
        wall_seconds=round(wall, 2),
        hub_peak_rss_mb=round(proc_status(hub_pid)["VmHWM"], 1) if hub_pid else None,
        hub_rss_mb_by_round=[round(x, 1) for x in rss_by_round],
        hub_anon_mb_by_round=[round(x, 1) for x in anon_by_round],
        hub_round_seconds=[round(rec["closed"] - rec["opened"], 4) for rec in hub_rounds],
    )


def _schema(params: int) -> dict[str, tuple[int, ...]]:
    width = max(4, round(math.sqrt(params / 2)))
    return {"0.weight": (width, width), "0.bias": (width,), "2.weight": (width, width), "2.bias": (width,)}


def load_on_fresh_hub(peers: int, rounds: int, params: int, procs: int, work: Path) -> LoadResult:
    data = work / f"hub-{peers}"
    with hub_process(data, work / f"hub-{peers}.log") as (url, pid):
        return run_load(url, peers=peers, rounds=rounds, params=params, procs=procs, hub_pid=pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=64, help="peers on the hub")
    parser.add_argument("--rounds", type=int, default=20, help="sync rounds")
    parser.add_argument("--params", type=int, default=1 << 20, help="float32 parameters per model (~)")
    parser.add_argument("--procs", type=int, default=4, help="processes the peer threads are spread over")
    parser.add_argument("--baseline", type=int, default=8, help="also run this many peers (0: no baseline)")
    parser.add_argument("--out", type=Path, help="write the JSON summary here too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="weightsync-load-") as tmp:
        work = Path(tmp)
        results = {"main": asdict(load_on_fresh_hub(args.peers, args.rounds, args.params, args.procs, work))}
        if args.baseline:
            procs = min(args.procs, args.baseline)
            results["baseline"] = asdict(load_on_fresh_hub(args.baseline, args.rounds, args.params, procs, work))
            main_, base = results["main"], results["baseline"]
            results["ratio"] = {
                "overhead_p50": round(main_["overhead_p50"] / base["overhead_p50"], 2),
                "overhead_p99": round(main_["overhead_p99"] / base["overhead_p99"], 2),
                "hub_peak_rss": round(main_["hub_peak_rss_mb"] / base["hub_peak_rss_mb"], 2),
                "peers": round(args.peers / args.baseline, 2),
            }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
