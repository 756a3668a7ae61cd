"""How short may a peer's lease be? The age its lease reaches on the hub while the peer trains.

    python bench/lease.py                                   # every load, lease 10 s, 60 s each
    python bench/lease.py --lease 6 --seconds 20 --loads idle,step --out /tmp/lease   # lease-<time>.json there

A lease must outlast the longest gap between two heartbeat requests *as the hub sees them*. The
SDK's heartbeat is a request the hub holds for a third of the lease, asked again at once from a
thread of its own; what delays the next one is the peer's process: a training step that keeps
the cores busy, Python that holds the GIL, data loading in worker processes. For each load this
starts a hub (``syncserver serve --lease-seconds L``) and one peer process that joins a run and
trains under that load for ``--seconds``, its SDK heartbeat beside it; the bench polls the hub's
status 20 times a second and records the age of the peer's lease (``last_seen_seconds``), and
counts the hub's ``peer_gone`` lines (a false "gone": the peer never stopped).

Loads (each on every core the machine has; 2 on the VM of bench/RESULTS.md):

- ``idle``: the peer sleeps (the hold alone: the baseline);
- ``step``: a CPU-bound training step: torch matmuls on every core, Python that tokenises
  (GIL-heavy: bytecode, dicts, strings), and a DataLoader of 2 worker processes doing the same;
- ``gil``: ``step`` plus, every step, one C call that holds the GIL for long (``sorted()`` of a
  2M-element list, as a pickle of a batch or a pure-Python tokenizer's call would).

The margin is ``L - max age``: what a beat lost on the link (retried at once, then after 0.1 s
doubling) has left. RESULTS reports the figures; settings.LEASE_SECONDS takes its default from them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

LOADS = ("idle", "step", "gil")
RUN, PEER = "lease", "p0"


# ---- the peer process ---------------------------------------------------------------------------
def _tokenise(n: int, rng: random.Random) -> list[int]:
    """GIL-heavy Python: split and look up words, as a pure-Python tokenizer does."""
    vocab: dict[str, int] = {}
    words = " ".join(f"w{rng.randrange(5000)}" for _ in range(n)).split()
    return [vocab.setdefault(w, len(vocab)) for w in words]


class _Texts:
    """A dataset whose items cost Python work in the DataLoader's worker processes."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.tensor(_tokenise(2000, random.Random(i))[:64])


def peer(url: str, load: str, seconds: float) -> None:
    """Join, then train under ``load`` for ``seconds`` (the heartbeat runs beside), then leave."""
    import torch

    from syncclient import SyncClient

    model = torch.nn.Linear(64, 64)
    client = SyncClient(url, run=RUN, peer=PEER, timeout=30, retry_seconds=60)
    client.join(model)
    rng = random.Random(0)
    steps = 0
    until = time.monotonic() + seconds
    loader = None
    if load != "idle":
        torch.set_num_threads(os.cpu_count() or 1)
        data = torch.utils.data.DataLoader(_Texts(), batch_size=16, num_workers=2)
        loader = iter(data)
    while time.monotonic() < until:
        if loader is None:
            time.sleep(0.1)
            continue
        batch = next(loader).float()
        a = torch.randn(512, 512)
        for _ in range(20):  # the step: matmuls on every core
            a = torch.tanh(a @ a / 512)
        loss = model(batch).pow(2).mean() + a.mean()
        loss.backward()
        _tokenise(20_000, rng)  # the step's Python (GIL-heavy)
        if load == "gil":
            sorted(rng.random() for _ in range(2_000_000))  # one long GIL hold
        steps += 1
    print(json.dumps({"steps": steps}), flush=True)
    client.leave()


# ---- the bench ----------------------------------------------------------------------------------
def one(load: str, lease: float, seconds: float, work: Path) -> dict[str, Any]:
    """A hub and one peer under ``load``: the ages its lease reached on the hub."""
    import httpx

    from syncserver.process import ServerProcess

    log = work / f"hub-{load}.log"
    hub = ServerProcess(
        [
            sys.executable,
            "-m",
            "syncserver",
            "serve",
            "--data-dir",
            str(work / f"hub-{load}"),
            "--lease-seconds",
            str(lease),
        ],
        log=log,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    url = hub.start()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--peer", url, "--loads", load, "--seconds", str(seconds)],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    ages: list[float] = []
    try:
        with httpx.Client(base_url=url, timeout=10) as http:
            while proc.poll() is None:
                answer = http.get(f"/v1/runs/{RUN}")
                if answer.status_code == 200:
                    states = {p["peer"]: p for p in answer.json()["peers"]}
                    if PEER in states and states[PEER]["state"] != "left" and answer.json()["sealed"]:
                        ages.append(states[PEER]["last_seen_seconds"])
                time.sleep(0.05)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
        hub.stop()
    gone = len(re.findall(rf"peer_gone run={RUN} peer={PEER}", log.read_text()))
    ages.sort()
    steps = json.loads(out.strip().splitlines()[-1])["steps"] if out.strip() else 0
    return {
        "load": load,
        "lease_s": lease,
        "hold_s": round(lease / 3, 3),
        "seconds": seconds,
        "steps": steps,
        "samples": len(ages),
        "max_age_s": round(ages[-1], 3) if ages else None,
        "p99_age_s": round(ages[int(0.99 * (len(ages) - 1))], 3) if ages else None,
        "false_gone": gone,
        "margin_s": round(lease - ages[-1], 3) if ages else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lease", type=float, default=10.0, help="the hub's lease_seconds (default 10)")
    ap.add_argument("--seconds", type=float, default=60.0, help="training under each load (default 60)")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated, of {', '.join(LOADS)}")
    ap.add_argument("--out", type=Path, help="write the rows to OUT/lease-<time>.json")
    ap.add_argument("--peer", metavar="URL", help=argparse.SUPPRESS)  # the peer process
    args = ap.parse_args()
    loads = args.loads.split(",")
    if args.peer:
        peer(args.peer, loads[0], args.seconds)
        return
    unknown = set(loads) - set(LOADS)
    if unknown:
        ap.error(f"unknown load(s) {', '.join(sorted(unknown))}; use {', '.join(LOADS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lease-") as tmp:
        for load in loads:
            row = one(load, args.lease, args.seconds, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| load | lease s | hold s | steps | max lease age s | p99 s | margin s | false gone |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['load']} | {r['lease_s']:g} | {r['hold_s']:g} | {r['steps']} | {r['max_age_s']} | "
            f"{r['p99_age_s']} | {r['margin_s']} | {r['false_gone']} |"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"lease-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps({"machine": f"{os.cpu_count()} cores", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
