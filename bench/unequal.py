"""Peers of unequal speed: barrier rounds against samples rounds against async, to the same quality.

    python bench/unequal.py                  # 4 peers, one 4x slower, then all equal; 3 policies each
    python bench/unequal.py --scenarios slow --policies barrier samples
    python bench/unequal.py --quick          # a smoke run of seconds (tests/test_bench_smoke.py)

For each scenario and policy: a real hub process (``python -m syncserver serve`` on a loopback
port the OS picks) and ``--peers`` peer processes (one torch thread each; forked from a fork
server that imported torch and transformers once, while the data is tokenized) that train the same
randomly initialised GPT-2 (``--layers`` x ``--width``, IMDB from ../shared/data tokenized with
the GPT-2 tokenizer, its ``--vocab`` - 1 most frequent tokens kept and the rest mapped to one
"rare" id, so that a CPU step is short) with AdamW, each on its own shard of the blocks
(cycled), until the run as a whole has trained ``--budget`` samples: equal total samples in
every run. In the ``slow`` scenario the last peer sleeps three times its own measured compute
time after every step, so that its steps take 4x as long; in ``equal`` nobody sleeps.

- **barrier**: every peer syncs every ``--sync-every`` steps and trains ``budget / peers``
  samples (its equal share): each round waits for the slow peer.
- **samples**: ``round_samples = peers * sync_every * batch`` (the barrier round's samples);
  each peer calls ``client.step(model, samples=batch)`` after every step and syncs when the hub
  says the round is due; all stop once ``SyncResult.run_samples`` reaches the budget.
- **async**: every peer pushes every ``--sync-every`` of its own steps; the hub applies each
  update as it arrives (``round_samples`` as above: an update moves the model by its share,
  discounted by staleness); all stop once the run has trained the budget.

An observer polls the hub and downloads every new version (with the time it saw it); after the
run each version is evaluated on held-out blocks. Reported per run: the wall time from the
run's start to its last version, the time to reach the **target** validation perplexity (the
barrier run's final one in the same scenario), the final perplexity, bytes moved (hub side:
updates in, results and models out), and per peer its steps, samples, and seconds spent waiting
inside ``sync`` (upload excluded: the long poll for the round's result). Results: a markdown
table on stdout and ``bench/results/unequal-<date>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import multiprocessing
import multiprocessing.forkserver
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
DATA = REPO.parent / "shared" / "data"
sys.path[:0] = [str(REPO)]

from syncserver.process import ServerProcess  # noqa: E402 (after the path above)

forks = multiprocessing.get_context("forkserver")

# -----------------------------------------------------------------------------
# settings
parser = argparse.ArgumentParser(description="Barrier vs samples vs async rounds with one slow peer.")
parser.add_argument("--peers", type=int, default=4, help="peer processes")
parser.add_argument("--scenarios", nargs="+", choices=["slow", "equal"], default=["slow", "equal"])
parser.add_argument("--policies", nargs="+", choices=["barrier", "samples", "async"], default=None)
parser.add_argument("--slowdown", type=float, default=4.0, help="the slow peer's steps take this many times longer")
parser.add_argument("--layers", type=int, default=2, help="GPT-2 layers")
parser.add_argument("--width", type=int, default=128, help="GPT-2 width (n_embd); 4 heads")
parser.add_argument("--vocab", type=int, default=8192, help="token ids kept (the most frequent; the rest: one id)")
parser.add_argument("--context", type=int, default=32, help="tokens per block (sample)")
parser.add_argument("--batch", type=int, default=16, help="blocks per step per peer")
parser.add_argument("--sync-every", type=int, default=10, help="steps between syncs (barrier, async)")
parser.add_argument("--budget", type=int, default=32_000, help="samples (blocks) the whole run trains")
parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (constant)")
parser.add_argument("--reviews", type=int, default=6000, help="training reviews (IMDB train split)")
parser.add_argument("--val-blocks", type=int, default=512, help="held-out blocks for validation perplexity")
parser.add_argument("--codec", default="fp32", help="the runs' codec")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, few samples")
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")

#: what a peer process is told (the rest is the driver's)
PEER_SETTINGS = ("peers", "layers", "width", "vocab", "context", "batch", "sync_every", "budget", "lr", "codec", "seed")

#: what the fork server imports once for every peer (each would pay ~3.5 CPU-s to import them)
PEER_MODULES = ["__main__", "numpy", "torch", "transformers.models.gpt2.modeling_gpt2", "syncclient.client"]


def model_for(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.width,
        n_head=4,
        vocab_size=args.vocab,
        n_positions=args.context,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


# -----------------------------------------------------------------------------
# data: IMDB blocks with a small vocabulary, written once for every process
def make_blocks(args: argparse.Namespace, path: Path) -> dict[str, int]:
    import numpy as np
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DATA / "gpt2-tokenizer")
    texts = pq.read_table(DATA / "imdb" / "train.parquet", columns=["text"]).column("text").to_pylist()
    order = np.random.default_rng(args.seed).permutation(len(texts))
    texts = [texts[i] for i in order[: args.reviews + 500]]
    ids = np.concatenate([np.array(t, np.int64) for t in tokenizer(texts)["input_ids"]])
    counts = np.bincount(ids, minlength=len(tokenizer))
    keep = np.argsort(-counts)[: args.vocab - 1]  # id vocab-1 stands for every rarer token
    remap = np.full(len(tokenizer), args.vocab - 1, np.int64)
    remap[keep] = np.arange(args.vocab - 1)
    split = sum(len(t) for t in tokenizer(texts[: args.reviews])["input_ids"])
    train, val = remap[ids[:split]], remap[ids[split:]]
    train_blocks = train[: len(train) // args.context * args.context].reshape(-1, args.context)
    val_blocks = val[: len(val) // args.context * args.context].reshape(-1, args.context)[: args.val_blocks]
    np.savez(path, train=train_blocks, val=val_blocks)
    return {
        "train_blocks": len(train_blocks),
        "val_blocks": len(val_blocks),
        "rare_share": float((train == args.vocab - 1).mean()),
    }


# -----------------------------------------------------------------------------
# one peer: train its shard (cycled) with the run's policy until the run's budget is trained
def peer_process(args: argparse.Namespace, result: Path) -> None:
    """A peer process's body: train, then write what it did to ``result``. The SDK reads no
    ``SYNC_*`` variable of the shell that ran the benchmark (a token, say): the run is its own."""
    for name in [k for k in os.environ if k.startswith("SYNC_")]:
        del os.environ[name]
    result.write_text(json.dumps(peer(args)))


def peer(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from syncclient import SyncClient

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same init everywhere (join makes it so anyway)
    model = model_for(args)
    blocks = torch.from_numpy(np.load(args.blocks)["train"])
    shard = blocks[args.peer :: args.peers]
    round_samples = args.peers * args.sync_every * args.batch
    client = SyncClient(
        args.url,
        run=args.run,
        peer=f"peer{args.peer}",
        min_peers=args.peers,
        codec=args.codec,
        policy=args.policy,
        round_samples=None if args.policy == "barrier" else round_samples,
        max_staleness=1000 if args.policy == "async" else None,
        round_timeout=600,
        timeout=120,
        retry_seconds=120,
    )
    client.join(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1000 + args.peer)
    own_budget = args.budget // args.peers  # barrier: each peer its equal share
    samples = steps = 0
    run_samples = 0
    waits, syncs, compute = [], 0, 0.0
    started = time.time()
    order = torch.randperm(len(shard), generator=gen)
    at = 0

    def done() -> bool:
        return samples >= own_budget if args.policy == "barrier" else run_samples >= args.budget

    while not done():
        if at + args.batch > len(order):  # the next pass over the shard
            order, at = torch.randperm(len(shard), generator=gen), 0
        batch = shard[order[at : at + args.batch]]
        at += args.batch
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        spent = time.perf_counter() - t0
        compute += spent
        if args.delay:
            time.sleep(args.delay * spent)  # a slower GPU: real training, then the measured extra
        steps += 1
        samples += args.batch
        result = None
        if args.policy == "samples":
            result = client.step(model, samples=args.batch, metrics={"loss": loss.item(), "step": float(steps)})
        elif steps % args.sync_every == 0 or done():
            since = args.batch * (steps % args.sync_every or args.sync_every)
            result = client.sync(model, samples=since, metrics={"loss": loss.item(), "step": float(steps)})
        if result is not None:
            syncs += 1
            waits.append(result.wait_seconds)
            run_samples = max(run_samples, result.run_samples)
    ended = time.time()
    client.leave()
    return {
        "peer": args.peer,
        "steps": steps,
        "samples": samples,
        "syncs": syncs,
        "wait_seconds": sum(waits),
        "compute_seconds": compute,
        "started": started,
        "ended": ended,
        "slow": bool(args.delay),
    }


# -----------------------------------------------------------------------------
# the observer: every version the hub publishes, with when it was seen
class Observer(threading.Thread):
    """Polls the run's status and saves each new version it sees to ``folder``."""

    def __init__(self, url: str, run: str, folder: Path) -> None:
        super().__init__(daemon=True)
        self.url, self.run_name, self.folder = url, run, folder
        self.versions: list[tuple[int, float, Path]] = []
        self.stop = threading.Event()
        folder.mkdir(parents=True, exist_ok=True)

    def run(self) -> None:
        import httpx

        seen = -1
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set():
                try:
                    version = http.get(f"/v1/runs/{self.run_name}").json()["version"]
                except (httpx.HTTPError, KeyError, ValueError):
                    version = -1
                if version > seen:
                    r = http.get(f"/v1/runs/{self.run_name}/model")
                    if r.status_code == 200:
                        seen = int(r.headers["x-sync-version"])
                        path = self.folder / f"{seen:06d}.safetensors"
                        path.write_bytes(r.content)
                        self.versions.append((seen, time.time(), path))
                self.stop.wait(0.2)


def evaluate(args: argparse.Namespace, blocks: Path, versions: list[tuple[int, float, Path]]) -> list[dict[str, Any]]:
    """Each version's validation perplexity. Run in a process forked from the fork server, where
    torch and the model are imported already: the driver never imports them."""
    import numpy as np
    import safetensors.torch
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    val = torch.from_numpy(np.load(blocks)["val"])
    model = model_for(args).eval()
    out = []
    for version, seen, path in versions:
        model.load_state_dict(safetensors.torch.load_file(path), strict=False)
        model.tie_weights()
        with torch.no_grad():
            losses = [model(input_ids=b, labels=b).loss.item() for b in val.split(64)]
        out.append({"version": version, "seen": seen, "val_ppl": math.exp(sum(losses) / len(losses))})
    return out


def run_one(args: argparse.Namespace, scenario: str, policy: str, tmp: Path, blocks: Path) -> dict[str, Any]:
    import httpx

    name = f"{scenario}-{policy}"
    serve = [sys.executable, "-m", "syncserver", "serve", "--host=127.0.0.1", f"--data-dir={tmp / name}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}  # the hub's settings are the flags
    hub = ServerProcess(
        [*serve, "--log-level=warning", "--keep-versions=2"], log=tmp / f"{name}.log", env=env, cwd=REPO
    )
    try:
        url = hub.start()
        observer = Observer(url, name, tmp / f"{name}-versions")
        observer.start()
        shared = {k: v for k, v in vars(args).items() if k in PEER_SETTINGS}
        procs = []
        for i in range(args.peers):
            slow = scenario == "slow" and i == args.peers - 1
            mine = argparse.Namespace(**shared, peer=i, url=url, policy=policy, run=name, blocks=blocks)
            mine.delay = args.slowdown - 1 if slow else 0.0
            procs.append(forks.Process(target=peer_process, args=(mine, tmp / f"{name}-{i}.json"), daemon=True))
            procs[-1].start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"a {name} peer failed (exit {p.exitcode})")
        status = httpx.get(f"{url}/v1/runs/{name}").json()
        # Until the observer holds the version the run ended at (it polls every 0.2 s): a fixed
        # wait could end before its last download on a busy machine, and evaluate an older one.
        deadline = time.monotonic() + 120
        while not observer.versions or observer.versions[-1][0] < status["version"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the observer did not see version {status['version']} in 120 s")
            time.sleep(0.02)
        observer.stop.set()
        observer.join()
    finally:
        hub.stop(timeout=30)
    peers = [json.loads((tmp / f"{name}-{i}.json").read_text()) for i in range(args.peers)]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=forks) as pool:
        curve = pool.submit(evaluate, args, blocks, observer.versions).result()
    t0 = min(p["started"] for p in peers)
    return {
        "scenario": scenario,
        "policy": policy,
        "version": status["version"],
        "run_samples": sum(r["samples"] for r in status["rounds"]) if status["version"] <= 50 else None,
        "wall": max(p["ended"] for p in peers) - t0,
        "final_val_ppl": curve[-1]["val_ppl"],
        "curve": [{**c, "t": c["seen"] - t0} for c in curve],
        "bytes_up": sum(p["bytes_up"] for p in status["peers"]),
        "bytes_down": sum(p["bytes_down"] for p in status["peers"]),
        "peers": peers,
    }


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    return next((c["t"] for c in curve if c["val_ppl"] <= target), None)


def main() -> None:
    args = parser.parse_args()
    for key in [k for k in os.environ if k.startswith("SYNC_")]:
        del os.environ[key]  # the hub's settings, and weightsync-run's: not for the peers to read
    # the fork server imports the peers' modules while the driver tokenizes the data
    forks.set_forkserver_preload(PEER_MODULES)
    multiprocessing.forkserver.ensure_running()
    if args.quick:
        args.layers, args.width, args.vocab, args.budget, args.reviews, args.val_blocks = 1, 32, 512, 480, 400, 64
        args.batch, args.sync_every = 8, 3
    policies = args.policies or ["barrier", "samples", "async"]
    started = datetime.datetime.now(datetime.UTC)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="unequal-bench-") as tmp:
        blocks = Path(tmp) / "blocks.npz"
        data = make_blocks(args, blocks)
        print(f"data: {data}", flush=True)
        for scenario in args.scenarios:
            for policy in policies:
                row = run_one(args, scenario, policy, Path(tmp), blocks)
                print(
                    f"{scenario} {policy}: wall {row['wall']:.1f} s, final val ppl {row['final_val_ppl']:.2f}, "
                    f"{row['version']} versions",
                    flush=True,
                )
                rows.append(row)
    round_samples = args.peers * args.sync_every * args.batch
    print(
        f"\n{args.peers} peers (GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, "
        f"batch {args.batch}x{args.context}, budget {args.budget} samples, sync every {args.sync_every} steps "
        f"or {round_samples} samples, codec {args.codec}); slow scenario: one peer's steps {args.slowdown:g}x "
        f"as long; {os.cpu_count()} CPUs\n"
    )
    print(
        "| scenario | policy | wall s | target ppl | time to target s | vs barrier | final val ppl | vs barrier "
        "| versions | MB up / down | per peer: steps, samples, waiting s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for scenario in args.scenarios:
        mine = [r for r in rows if r["scenario"] == scenario]
        base = next((r for r in mine if r["policy"] == "barrier"), mine[0])
        target = base["final_val_ppl"]
        base_time = time_to(base["curve"], target)
        for r in mine:
            reach = time_to(r["curve"], target)
            r["target_ppl"], r["time_to_target"] = target, reach
            speed = f"{base_time / reach:.2f}x sooner" if reach and base_time else "-"
            per_peer = "; ".join(
                f"{p['steps']}{' (slow)' if p['slow'] else ''}, {p['samples']}, {p['wait_seconds']:.1f}"
                for p in r["peers"]
            )
            print(
                f"| {scenario} | {r['policy']} | {r['wall']:.1f} | {target:.2f} | "
                f"{'not reached' if reach is None else f'{reach:.1f}'} | {speed} | {r['final_val_ppl']:.2f} | "
                f"{r['final_val_ppl'] / target - 1:+.2%} | {r['version']} | "
                f"{r['bytes_up'] / 1e6:.1f} / {r['bytes_down'] / 1e6:.1f} | {per_peer} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"unequal-{started:%Y-%m-%d}{'-quick' if args.quick else ''}.json"
    settings = {k: v for k, v in vars(args).items() if k in (*PEER_SETTINGS, "slowdown", "reviews", "val_blocks")}
    path.write_text(
        json.dumps(
            {
                "date": started.isoformat(),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
                "settings": settings,
                "data": data,
                "rows": rows,
            },
            indent=1,
            default=str,
        )
    )
    print(f"\nwrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


if __name__ == "__main__":
    main()
