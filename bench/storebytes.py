"""Bytes out of and into the hub per round, with and without an object store: ``python bench/storebytes.py``.

    python bench/storebytes.py                          # 2 and 4 peers, fp32 and int8, 3 rounds
    python bench/storebytes.py --peers 2 --codecs fp32 --rounds 1 --params 20000   # the smoke test

Starts SeaweedFS (tests/s3server.py; ``--bucket B``: a store already running, that the ``AWS_*``
variables name), then for every case a hub without a store and a hub with
``--store`` (real ``syncserver serve`` processes), N SDK peers in threads on one small torch
model (a stack of float32 matrices, ``--params`` parameters), and ``--rounds`` barrier rounds of
seeded perturbations. The hub's own bytes out are read from its ``/metrics``: result and model
bytes it served itself (``weightsync_download_bytes_total{via="hub"}``) plus what it uploaded to
the bucket (``weightsync_store_upload_bytes_total``); its bytes in: the updates peers PUT to it
(``weightsync_upload_bytes_total{via="hub"}``) plus what it read from the bucket
(``weightsync_store_read_bytes_total``: with a store, each update once to check it and again to
merge it), against the updates peers put in the bucket (``...{via="store"}``). Per round is the
difference between after the join and after the rounds, divided by the rounds (version 0 at the
join is not counted).
These are counts, not times: the machine's load does not change them. Every peer must end on
the hub's last version (sha-256), and with 2 peers the two hubs on the same bits.

Results: a markdown table on stdout and ``bench/results/storebytes-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from syncclient import SyncClient  # noqa: E402
from syncserver.process import ServerProcess  # noqa: E402


def model(params: int) -> torch.nn.Module:
    """Four float32 matrices of about ``params`` parameters in all, the same for every seed-0 peer."""
    side = max(8, int((params / 4) ** 0.5))
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(4)))


def perturb(m: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


def digest(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(m.state_dict().items()):
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def scrape(url: str, run: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).raise_for_status().text
    found = {"hub": 0.0, "store": 0.0, "uploaded": 0.0, "in_hub": 0.0, "in_store": 0.0, "read": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "weightsync_store_read_bytes_total":  # the hub's, not a run's: one case at a time
                found["read"] += s.value
            if s.labels.get("run") != run:
                continue
            if s.name == "weightsync_download_bytes_total":
                found[s.labels["via"]] += s.value
            elif s.name == "weightsync_store_upload_bytes_total":
                found["uploaded"] += s.value
            elif s.name == "weightsync_upload_bytes_total":
                found[f"in_{s.labels['via']}"] += s.value
    return found


def one_case(url: str, n: int, codec: str, rounds: int, params: int) -> dict[str, Any]:
    run = f"{codec}-{n}"
    clients = [SyncClient(url, run=run, peer=f"p{i}", codec=codec, min_peers=n) for i in range(n)]
    models = [model(params) for _ in range(n)]
    errors: list[BaseException] = []

    def each(body: Any) -> None:
        def target(i: int) -> None:
            try:
                body(i)
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        if errors:
            raise errors[0]

    each(lambda i: clients[i].join(models[i]))
    before = scrape(url, run)
    for r in range(rounds):

        def step(i: int, r: int = r) -> None:
            perturb(models[i], 1000 * r + i)
            clients[i].sync(models[i], samples=8 + i)

        each(step)
    after = scrape(url, run)
    for c in clients:
        c.leave()
        c.close()
    digests = {digest(m) for m in models}
    assert len(digests) == 1, "peers disagree"
    out = {k: (after[k] - before[k]) / rounds for k in after}
    return {
        "weights": {k: t.numpy().copy() for k, t in models[0].state_dict().items()},
        "digest": digests.pop(),
        "hub_out": out["hub"] + out["uploaded"],
        "peers_from_store": out["store"],
        "peers_from_hub": out["hub"],
        "hub_in": out["in_hub"] + out["read"],
        "peers_to_store": out["in_store"],
        "model_bytes": 4 * sum(p.numel() for p in models[0].parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--codecs", nargs="+", default=["fp32", "int8"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--params", type=int, default=1_000_000, help="model parameters (float32)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--reducers",
        type=int,
        default=0,
        help="also a store hub with K local reducers: they check the uploads, merge, and write results as parts",
    )
    parser.add_argument(
        "--bucket", help="use this bucket of the store the AWS_* variables name, instead of starting SeaweedFS"
    )
    args = parser.parse_args()

    rows = []
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
        bucket = args.bucket
        if bucket is None:
            from tests.s3server import SeaweedFS

            s3 = stack.enter_context(SeaweedFS(work / "s3").start())
            env |= s3.env()
            bucket = s3.bucket
        servers = {}
        prefix = f"bench-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d%H%M%S%f}"
        for kind in ("hub", "store", "reducers")[: 3 if args.reducers else 2]:
            extra = ["--store", f"s3://{bucket}/{prefix}-{kind}"] if kind != "hub" else []
            extra += ["--reducers", str(args.reducers)] if kind == "reducers" else []
            command = [sys.executable, "-m", "syncserver", "serve", "--data-dir", str(work / kind), *extra]
            servers[kind] = ServerProcess([*command, "--log-level", "warning"], log=work / f"{kind}.log", env=env)
            servers[kind].spawn()  # all at once; then each waited for
            stack.callback(servers[kind].stop)
        hubs = {}
        for kind, server in servers.items():
            hubs[kind] = server.wait_ready(60)
            if kind == "reducers":  # they check the first upload already
                while len(httpx.get(f"{server.url}/v1/reduce/reducers").json()) < args.reducers:
                    time.sleep(0.1)
        for codec in args.codecs:
            for n in args.peers:
                got = {kind: one_case(url, n, codec, args.rounds, args.params) for kind, url in hubs.items()}
                # with 2 peers the two hubs must agree bit for bit; with more, their updates may be
                # acknowledged in another order, and float32 sums in another order differ in the
                # last bits (docs/RELIABILITY.md, "Bit-identical after a hub crash")
                same = all(got["hub"]["digest"] == other["digest"] for other in got.values())
                assert same or n > 2, "the store changed the bits"
                model_bytes = got["hub"]["model_bytes"]
                row = {
                    "codec": codec,
                    "peers": n,
                    "model_mb": model_bytes / 1e6,
                    "hub_out_mb_no_store": got["hub"]["hub_out"] / 1e6,
                    "hub_out_mb_store": got["store"]["hub_out"] / 1e6,
                    "peers_from_store_mb": got["store"]["peers_from_store"] / 1e6,
                    "peers_from_hub_mb_with_store": got["store"]["peers_from_hub"] / 1e6,
                    "ratio": got["hub"]["hub_out"] / got["store"]["hub_out"],
                    "hub_in_mb_no_store": got["hub"]["hub_in"] / 1e6,
                    "hub_in_mb_store": got["store"]["hub_in"] / 1e6,
                    "peers_to_store_mb": got["store"]["peers_to_store"] / 1e6,
                    "hub_in_mb_store_reducers": got["reducers"]["hub_in"] / 1e6 if "reducers" in got else None,
                    "hub_out_mb_store_reducers": got["reducers"]["hub_out"] / 1e6 if "reducers" in got else None,
                    "same_bits": same,
                    "max_abs_diff": max(
                        float(abs(got["hub"]["weights"][k] - got["store"]["weights"][k]).max())
                        for k in got["hub"]["weights"]
                    ),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\nper round, {args.rounds} rounds, a {rows[0]['model_mb']:.2f} MB fp32 model\n")
    print(
        "| codec | peers | hub out, no store (MB) | hub out, store (MB) | x model | peers from store (MB) | ratio "
        "| hub in, no store (MB) | hub in, store (MB) | peers to store (MB) | hub in, store + reducers (MB) "
        "| hub out, store + reducers (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['codec']} | {r['peers']} | {r['hub_out_mb_no_store']:.2f} | {r['hub_out_mb_store']:.2f} | "
            f"{r['hub_out_mb_store'] / r['model_mb']:.2f} | {r['peers_from_store_mb']:.2f} | {r['ratio']:.2f} | "
            f"{r['hub_in_mb_no_store']:.2f} | {r['hub_in_mb_store']:.2f} | {r['peers_to_store_mb']:.2f} | "
            + (f"{r['hub_in_mb_store_reducers']:.3f} |" if r["hub_in_mb_store_reducers"] is not None else "- |")
            + (f" {r['hub_out_mb_store_reducers']:.3f} |" if r["hub_out_mb_store_reducers"] is not None else " - |")
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    (args.out / f"storebytes-{stamp}.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
