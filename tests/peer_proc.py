"""Peers for the fault tests: a real process to SIGKILL, threads, and the checks they share.

    python tests/peer_proc.py --hub URL --run R --peer NAME --seed S --samples N \\
        --until-version V --out DIR [--train-seconds T] [--go-files]

It builds ``tiny_gpt2(0)`` (every peer the same init; the first to join uploads version 0),
joins, and for each round: waits for ``DIR/go_<round>`` if ``--go-files`` (so the test sets
the pace), "trains" (a deterministic perturbation from ``seed`` and the round, then sleeps
``--train-seconds``), dumps its delta as ``DIR/delta_<peer>_<round>.safetensors`` (exactly the
float32 ``local - base`` the SDK sends with the fp32 codec), and syncs. Progress goes to
``DIR/<peer>.jsonl`` (one event a line), the final weights to ``DIR/final_<peer>.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import safetensors.numpy  # noqa: E402

from syncclient import SyncClient  # noqa: E402
from syncclient._model import ModelView  # noqa: E402
from tests.conftest import Hub, tiny_gpt2  # noqa: E402


def perturb(model: torch.nn.Module, seed: int, round_: int, scale: float = 0.01) -> None:
    """A peer's "training" for one round: deterministic in (seed, round) and the start weights."""
    gen = torch.Generator().manual_seed(seed * 1000 + round_)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def weighted_mean64(deltas: list[dict[str, np.ndarray]], samples: list[int]) -> dict[str, np.ndarray]:
    """The reference: sample-weighted mean of the deltas, in float64, computed independently."""
    total = float(sum(samples))
    return {
        name: sum(d[name].astype(np.float64) * n for d, n in zip(deltas, samples, strict=True)) / total
        for name in deltas[0]
    }


def version_file(hub: Hub, run: str, version: int) -> dict[str, np.ndarray]:
    """Version ``version`` as the hub stored it. The hub writes a version's file after the round
    commits and serves the model once it is written, so a one-byte request waits for it."""
    httpx.get(f"{hub.url}/v1/runs/{run}/model", headers={"Range": "bytes=0-0"}, timeout=60).raise_for_status()
    return safetensors.numpy.load_file(str(hub.data_dir / "runs" / run / "versions" / f"{version:08d}.safetensors"))


def assert_exact_mean(hub: Hub, run: str, round_: int, deltas: list[dict[str, np.ndarray]], samples: list[int]) -> None:
    """version(round+1) - version(round) equals the float64 weighted mean of ``deltas`` (1e-6)."""
    before, after = version_file(hub, run, round_), version_file(hub, run, round_ + 1)
    expected = weighted_mean64(deltas, samples)
    assert set(after) == set(expected)
    for name, mean in expected.items():
        got = after[name].astype(np.float64) - before[name].astype(np.float64)
        np.testing.assert_allclose(got, mean, rtol=0, atol=1e-6, err_msg=name)


def status(hub: Hub, run: str) -> dict[str, Any]:
    return httpx.get(f"{hub.url}/v1/runs/{run}", timeout=10).json()


def round_record(hub: Hub, run: str, round_: int) -> dict[str, Any]:
    (record,) = [r for r in status(hub, run)["rounds"] if r["round"] == round_]
    return record


class Peers:
    """In-process peers (threads), each a SyncClient on its own copy of ``model()`` (a tiny
    GPT-2 unless told), "training" by :func:`perturb`; every delta sent is remembered for the
    exact-mean check. ``url`` may differ per peer (some through a fault proxy)."""

    def __init__(
        self,
        url: str | dict[str, str],
        run: str,
        names: list[str],
        model: Callable[[], torch.nn.Module] = lambda: tiny_gpt2(0),
        **client: Any,
    ) -> None:
        urls = url if isinstance(url, dict) else dict.fromkeys(names, url)
        options = {"retry_seconds": 60.0, **client}
        self.clients = {n: SyncClient(urls[n], run=run, peer=n, **options) for n in names}
        self.models = {n: model() for n in names}
        self.deltas: dict[tuple[str, int], dict[str, np.ndarray]] = {}
        self.results: dict[str, Any] = {}
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def join(self) -> None:
        self.parallel(list(self.clients), lambda n: self.clients[n].join(self.models[n]))

    def sync(self, name: str, samples: int, seed: int, train_seconds: float = 0.0) -> Any:
        client, model = self.clients[name], self.models[name]
        view = ModelView(model)
        base = {k: v.copy() for k, v in view.export().items()}
        perturb(model, seed, client.version)
        time.sleep(train_seconds)
        self.deltas[name, client.version] = {k: v - base[k] for k, v in view.export().items()}
        self.results[name] = client.sync(model, samples=samples)
        return self.results[name]

    def start(self, name: str, fn: Callable[[], Any]) -> threading.Thread:
        def target() -> None:
            try:
                fn()
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    def parallel(self, names: list[str], fn: Callable[[str], Any]) -> None:
        for t in [self.start(n, lambda n=n: fn(n)) for n in names]:
            t.join(120)
        self.check()

    def wait(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), f"peer {t.name} is stuck"
        self.check()

    def check(self) -> None:
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def events(out: Path, peer: str) -> list[dict[str, Any]]:
    path = out / f"{peer}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hub", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--samples", type=int, default=100, help="this peer's weight in the average")
    ap.add_argument("--until-version", type=int, required=True, help="stop once the model is at this version")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--train-seconds", type=float, default=0.0, help="sleep per round (heartbeats keep going)")
    ap.add_argument("--go-files", action="store_true", help="wait for OUT/go_<round> before each round")
    args = ap.parse_args()

    def log(event: str, **fields: Any) -> None:
        with open(args.out / f"{args.peer}.jsonl", "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")

    model = tiny_gpt2(0)
    client = SyncClient(args.hub, run=args.run, peer=args.peer, timeout=10, retry_seconds=120)
    info = client.join(model)
    log("joined", version=info.version, rank=info.rank)
    view = ModelView(model)
    while client.version < args.until_version:
        round_ = client.version
        if args.go_files:
            while not (args.out / f"go_{round_}").exists():
                time.sleep(0.02)
        log("training", round=round_)
        base = {k: v.copy() for k, v in view.export().items()}
        perturb(model, args.seed, round_)
        time.sleep(args.train_seconds)
        delta = {k: v - base[k] for k, v in view.export().items()}
        safetensors.numpy.save_file(delta, str(args.out / f"delta_{args.peer}_{round_}.safetensors"))
        log("syncing", round=round_)
        result = client.sync(model, samples=args.samples)
        log("synced", round=round_, version=result.version, caught_up=result.caught_up)
    safetensors.numpy.save_file(
        {k: v.copy() for k, v in view.export().items()}, str(args.out / f"final_{args.peer}.safetensors")
    )
    client.leave()
    log("done", version=client.version)


if __name__ == "__main__":
    main()
