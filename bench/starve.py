"""Does one run starve the others? An honest run's round time, alone and while another run is hammered.

    python bench/starve.py                                  # 100,000 tensors, 4 clients, 2 x 4 rounds
    python bench/starve.py --tensors 20000 --rounds 2       # quicker
    python bench/starve.py --control                        # the clients poll /healthz instead

One real hub (``python -m syncserver serve`` on a port the OS picks, its own temp data dir) and
two runs on it:

- **the big run**: version 0 of ``--tensors`` small float32 tensors (100,000 of shape 8 x 4: a
  7 MB safetensors header, as a mixture-of-experts checkpoint may have), one peer;
- **the honest run**: 2 peers (threads of this process, real ``SyncClient``s) on a small MLP
  (``--honest-mb`` of fp32), syncing round after round.

The honest run's rounds are timed in phases, alternately **alone** and **attacked**: while 4
clients (``--clients``; threads of a process of their own) poll the big run as fast as the hub
answers, each cycling through what a peer of it may ask: ``HEAD`` of its update's resume point,
a ``PUT`` of an update whose body is empty (refused: 400), the run's status, and its start
state (ready: the whole schema). A round is timed from the instant both peers call ``sync()``
to the last one returning. Reported: the median round of each condition (and every round),
their ratio (the target is at most 1.5x), and the attackers' request rate and latency.
Results: a markdown table on stdout and ``bench/results/starve-<date>.json`` (``--out``).

``--control`` makes the same clients poll ``/healthz`` instead: the cost of the clients' own CPU
on a small machine, which no hub can avoid. The baseline is this script run against an older
hub: ``git worktree add /tmp/old <commit> && cp bench/starve.py /tmp/old/bench/ && python
/tmp/old/bench/starve.py`` (it imports the hub from the checkout it sits in).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import httpx  # noqa: E402 (after the path above)
import numpy as np  # noqa: E402

from syncwire import iter_chunks  # noqa: E402

# torch, the SDK and the hub's process helper (which imports the hub's app) are imported where
# they are used: the attack's process (spawned: it imports this module again) needs only httpx
if TYPE_CHECKING:
    import torch

    from syncclient import SyncClient

parser = argparse.ArgumentParser(description="An honest run's round time, alone and while another run is hammered.")
parser.add_argument("--tensors", type=int, default=100_000, help="tensors of the big run (shape 8 x 4 each)")
parser.add_argument("--clients", type=int, default=4, help="clients hammering the big run")
parser.add_argument("--rounds", type=int, default=4, help="timed honest rounds per phase")
parser.add_argument("--phases", type=int, default=2, help="alone/attacked pairs, interleaved")
parser.add_argument("--honest-mb", type=float, default=4.0, help="the honest model's fp32 size")
parser.add_argument(
    "--control",
    action="store_true",
    help="the clients poll /healthz instead of the big run: what the clients' own CPU costs the honest run",
)
parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON")
DIGEST = "sha-256=:" + base64.b64encode(bytes(32)).decode() + ":"
ROUND_LIMIT = 600.0  # seconds: a starved round gives up here rather than hang the benchmark


def big_run(url: str, tensors: int) -> float:
    """Create the big run and its version 0; return the seconds its upload took."""
    rng = np.random.default_rng(0)
    items = [(f"experts.{i}.w", rng.standard_normal((8, 4)).astype(np.float32), "F32") for i in range(tensors)]
    stop = threading.Event()

    def beat() -> None:  # as the SDK's heartbeat does: on a loaded machine the upload outlasted the lease (409)
        with httpx.Client(base_url=url, timeout=30) as http:
            while not stop.wait(2.0):
                http.post("/v1/runs/big/peers/big/heartbeat")

    with httpx.Client(base_url=url, timeout=600) as http:
        http.post("/v1/runs/big/peers", json={"peer": "big", "min_peers": 1}).raise_for_status()
        beating = threading.Thread(target=beat, daemon=True)
        beating.start()
        started = time.monotonic()
        try:
            http.put("/v1/runs/big/versions/0", params={"peer": "big"}, content=iter_chunks(items)).raise_for_status()
        finally:
            stop.set()
            beating.join()
        took = time.monotonic() - started
        assert http.get("/v1/runs/big/peers/big/start").json()["state"] == "ready"
    return took


def hammer(url: str, clients: int, control: bool, ready: Any, stop: Any, results: Any) -> None:
    """``clients`` threads polling the big run until ``stop`` is set (in a process of their own
    here; tests/test_cost.py runs it in a thread); ``ready`` is set once every thread has had an
    answer to each kind of request (the attack is under way). Puts latencies and statuses by kind."""
    kinds = ["head", "put", "status", "start"]
    latencies: dict[str, list[float]] = {k: [] for k in kinds}
    statuses: dict[str, dict[int, int]] = {k: {} for k in kinds}
    lock = threading.Lock()
    cycled = threading.Barrier(clients, action=ready.set)
    update = "/v1/runs/big/rounds/0/updates/big"
    headers = {"Content-Digest": DIGEST, "X-Sync-Samples": "1"}

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=ROUND_LIMIT) as http:
            n = i
            while not stop.is_set():
                kind = kinds[n % len(kinds)]
                n += 1
                started = time.monotonic()
                try:
                    if control:
                        r = http.get("/healthz")
                    elif kind == "head":
                        r = http.head(update, headers=headers)
                    elif kind == "put":
                        r = http.put(update, headers=headers, content=b"")
                    elif kind == "status":
                        r = http.get("/v1/runs/big")
                    else:
                        r = http.get("/v1/runs/big/peers/big/start", params={"wait": 0})
                    code = r.status_code
                except httpx.HTTPError:
                    code = -1
                with lock:
                    latencies[kind].append(time.monotonic() - started)
                    statuses[kind][code] = statuses[kind].get(code, 0) + 1
                if n == i + len(kinds):  # one of each kind answered: wait for the other threads
                    cycled.wait()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put({"latencies": latencies, "statuses": statuses})


def honest_model(megabytes: float) -> torch.nn.Module:
    import torch

    torch.manual_seed(0)
    width = 512
    layers = max(1, round(megabytes * 1e6 / 4 / (width * width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def one_round(clients: list[SyncClient], models: list[torch.nn.Module]) -> float:
    """Both peers "train" a step, then sync from the same instant: the seconds to the last done."""
    import torch

    start = threading.Barrier(len(clients) + 1)
    errors: list[BaseException] = []

    def peer(i: int) -> None:
        try:
            with torch.no_grad():
                for p in models[i].parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            start.wait()
            clients[i].sync(models[i], samples=1)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    start.wait()
    began = time.monotonic()
    for t in threads:
        t.join(ROUND_LIMIT)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"an honest round took over {ROUND_LIMIT:.0f} s")
    return time.monotonic() - began


def timed_rounds(clients: list[SyncClient], models: list[torch.nn.Module], rounds: int) -> list[float]:
    return [one_round(clients, models) for _ in range(rounds)]


def machine() -> str:
    cores = os.cpu_count()
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    return f"{cores}-core {platform.machine()}, {mem:.0f} GiB, Python {platform.python_version()}"


def main() -> None:
    from syncclient import SyncClient
    from syncserver.process import ServerProcess

    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    commit = head.stdout.strip() or "unknown"
    with tempfile.TemporaryDirectory(prefix="starve-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        serve = [sys.executable, "-m", "syncserver", "serve", "--data-dir", f"{tmp}/data", "--log-level", "warning"]
        server = ServerProcess(serve, log=Path(tmp) / "hub.log", env=env, cwd=REPO)
        url = server.start()
        try:
            upload_s = big_run(url, args.tensors)
            print(f"{commit}: big run of {args.tensors} tensors up in {upload_s:.1f} s; load {os.getloadavg()[0]:.2f}")
            models = [honest_model(args.honest_mb) for _ in range(2)]
            clients = [
                SyncClient(url, run="honest", peer=f"p{i}", min_peers=2, retry_seconds=ROUND_LIMIT) for i in range(2)
            ]
            joins = [threading.Thread(target=c.join, args=(m,)) for c, m in zip(clients, models, strict=True)]
            for t in joins:
                t.start()
            for t in joins:
                t.join()
            timed_rounds(clients, models, 1)  # warm-up
            alone: list[float] = []
            attacked: list[float] = []
            attack: dict[str, Any] = {"latencies": {}, "statuses": {}, "seconds": 0.0}
            for phase in range(args.phases):
                alone += timed_rounds(clients, models, args.rounds)
                print(f"phase {phase}: alone    {' '.join(f'{s:.2f}' for s in alone[-args.rounds :])}")
                ctx = mp.get_context("spawn")
                ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
                proc = ctx.Process(target=hammer, args=(url, args.clients, args.control, ready, stop, results))
                proc.start()
                # the attack is under way (its process started, every client answered) before the
                # first attacked round starts: the attack's start-up is not what is measured
                if not ready.wait(ROUND_LIMIT):
                    raise RuntimeError("the attack never got going")
                began = time.monotonic()
                attacked += timed_rounds(clients, models, args.rounds)
                stop.set()
                got = results.get(timeout=ROUND_LIMIT)
                proc.join()
                attack["seconds"] += time.monotonic() - began
                for kind, values in got["latencies"].items():
                    attack["latencies"].setdefault(kind, []).extend(values)
                for kind, counts in got["statuses"].items():
                    merged = attack["statuses"].setdefault(kind, {})
                    for code, n in counts.items():
                        merged[code] = merged.get(code, 0) + n
                print(f"phase {phase}: attacked {' '.join(f'{s:.2f}' for s in attacked[-args.rounds :])}")
            for c in clients:
                c.leave()
                c.close()
        finally:
            server.stop()
    ratio = statistics.median(attacked) / statistics.median(alone)
    requests = sum(len(v) for v in attack["latencies"].values())
    print()
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M} · {machine()} · load {os.getloadavg()[0]:.2f} · code {commit}")
    print(f"`python bench/starve.py {' '.join(sys.argv[1:])}`".replace("  ", " "))
    print()
    print("| honest round s, alone (median, best) | attacked (median, best) | attacked / alone | attack requests/s |")
    print("|---|---|---|---|")
    print(
        f"| {statistics.median(alone):.2f}, {min(alone):.2f} | {statistics.median(attacked):.2f}, {min(attacked):.2f} "
        f"| **{ratio:.2f}x** | {requests / attack['seconds']:.0f} |"
    )
    print()
    print("| attack request | count | statuses | median s | max s |")
    print("|---|---|---|---|---|")
    for kind, values in attack["latencies"].items():
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(attack["statuses"][kind].items()))
        if values:
            print(f"| {kind} | {len(values)} | {codes} | {statistics.median(values):.3f} | {max(values):.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"starve-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.write_text(
        json.dumps(
            {
                "commit": commit,
                "machine": machine(),
                "args": {k: str(v) for k, v in vars(args).items()},
                "big_run_upload_s": upload_s,
                "alone": alone,
                "attacked": attacked,
                "ratio": ratio,
                "attack": {
                    "seconds": attack["seconds"],
                    "statuses": attack["statuses"],
                    "latency_median": {k: statistics.median(v) for k, v in attack["latencies"].items() if v},
                    "latency_max": {k: max(v) for k, v in attack["latencies"].items() if v},
                },
            },
            indent=1,
        )
    )
    print(f"\n{out}")


if __name__ == "__main__":
    main()
