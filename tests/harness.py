"""The one test harness: peers in threads, the hub's view of a run, and waits on conditions.

Every test that drives real peers against a real hub (:class:`tests.conftest.Hub`) uses these,
instead of a copy of its own:

- :func:`run_peers`: ``body(i)`` for n peers in threads, the first failure re-raised;
- :class:`Peers`: named SyncClients on their own models, driven step by step by the test
  (:meth:`Peers.sync` "trains" by :func:`perturb` and remembers each delta, for the exact-mean
  check) or left to train for real and report metrics (:meth:`Peers.train`, a run with loss and
  perplexity curves for the dashboard, metrics and status tests);
- :func:`hub_model`, :func:`version_file`, :func:`result_file`, :func:`status`, :func:`round_record`: what
  the hub holds;
- :func:`wait_for`: poll a condition until it holds or a deadline passes (never sleep-then-assert).

:func:`perturb`, :class:`Blocks` and :func:`tiny_gpt2` live in :mod:`tests.models`, with the models of
peer processes (which import that module alone).

``tests/peer_proc.py`` is the same peer as a process of its own, for the tests that SIGKILL one
(:func:`launch`, :func:`sigkill`).
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import safetensors.numpy
import torch

from syncclient import SyncClient
from syncclient.weights import ModelView
from tests.conftest import REPO, Hub
from tests.models import perturb, tiny_gpt2

# ---- peer processes ----------------------------------------------------------------------------


def launch(
    hub_url: str, run: str, peer: str, seed: int, samples: int, out: Path, **opts: Any
) -> subprocess.Popen[bytes]:
    """``tests/peer_proc.py`` as a process, paced by go files; ``opts``: its other flags
    (``until_version=2`` is ``--until-version 2``); its output in ``out/<peer>.log``."""
    args = [
        sys.executable,
        str(REPO / "tests" / "peer_proc.py"),
        "--hub",
        hub_url,
        "--run",
        run,
        "--peer",
        peer,
        "--seed",
        str(seed),
        "--samples",
        str(samples),
        "--out",
        str(out),
        "--go-files",
    ]
    for key, value in opts.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    log = open(out / f"{peer}.log", "ab")  # noqa: SIM115 (owned by the process)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def sigkill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


# ---- waiting ------------------------------------------------------------------------------------


def wait_for(condition: Callable[[], object], what: str = "the condition", timeout: float = 60.0) -> None:
    """Until ``condition()`` is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:.0f} s"
        time.sleep(0.01)


def run_peers(n: int, body: Callable[[int], Any], timeout: float = 180.0) -> list[Any]:
    """Run ``body(i)`` for n peers in threads; return their results, re-raise the first failure."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = body(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"a peer is still running after {timeout:.0f} s"
    return results


# ---- the hub's view -----------------------------------------------------------------------------

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
"""What the helpers below (and the tests' own polls of a hub) read through. ``httpx.get`` builds a
client per request, and with it a TLS context that loads certifi's CA bundle: ~21 ms of CPU on a
2-core VM, for a request to a local hub that costs the hub 1.5 ms, repeated at every poll of a
wait. This client builds its context once; it keeps no connection between requests, as
``httpx.get`` does not, so a hub killed and restarted on its port is reached afresh."""


def hub_model(hub: Hub, run: str, token: str | None = None) -> dict[str, np.ndarray]:
    """The run's latest version, downloaded as a peer would."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = HTTP.get(f"{hub.url}/v1/runs/{run}/model", headers=headers, timeout=60)
    r.raise_for_status()
    return safetensors.numpy.load(r.content)


def version_file(hub: Hub, run: str, version: int) -> dict[str, np.ndarray]:
    """Version ``version`` as the hub stored it. The hub writes a version's file after the round
    commits and serves the model once it is written, so a one-byte request waits for it. (The
    one place the tests know the hub's file layout.)"""
    HTTP.get(f"{hub.url}/v1/runs/{run}/model", headers={"Range": "bytes=0-0"}, timeout=60).raise_for_status()
    return safetensors.numpy.load_file(str(hub.data_dir / "runs" / run / "versions" / f"{version:08d}.safetensors"))


def result_file(hub: Hub, run: str, round_: int) -> Path:
    """Where the hub writes round ``round_``'s result (the other place the tests know its layout:
    the crash tests put there what a merge killed before its commit leaves)."""
    return hub.data_dir / "runs" / run / "rounds" / f"{round_:08d}" / "result.safetensors"


def status(hub: Hub, run: str, token: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = HTTP.get(f"{hub.url}/v1/runs/{run}", headers=headers, timeout=10)
    r.raise_for_status()
    return dict(r.json())


def round_record(hub: Hub, run: str, round_: int) -> dict[str, Any]:
    (record,) = [r for r in status(hub, run)["rounds"] if r["round"] == round_]
    return record


# ---- the maths the hub must match -------------------------------------------------------------------


def weighted_mean64(deltas: list[dict[str, np.ndarray]], samples: list[int]) -> dict[str, np.ndarray]:
    """The reference: sample-weighted mean of the deltas, in float64, computed independently."""
    total = float(sum(samples))
    return {
        name: sum(d[name].astype(np.float64) * n for d, n in zip(deltas, samples, strict=True)) / total
        for name in deltas[0]
    }


def assert_exact_mean(hub: Hub, run: str, round_: int, deltas: list[dict[str, np.ndarray]], samples: list[int]) -> None:
    """version(round+1) - version(round) equals the float64 weighted mean of ``deltas`` (1e-6)."""
    before, after = version_file(hub, run, round_), version_file(hub, run, round_ + 1)
    expected = weighted_mean64(deltas, samples)
    assert set(after) == set(expected)
    for name, mean in expected.items():
        got = after[name].astype(np.float64) - before[name].astype(np.float64)
        np.testing.assert_allclose(got, mean, rtol=0, atol=1e-6, err_msg=name)


# ---- training -----------------------------------------------------------------------------------


def sgd_steps(model: torch.nn.Module, gen: torch.Generator, steps: int, opt: torch.optim.Optimizer) -> float:
    """Real optimizer steps on random tokens of the tiny GPT-2's vocabulary; the last loss."""
    loss = torch.tensor(math.nan)
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.item())


def train_a_little(model: torch.nn.Module, seed: int, steps: int = 2) -> None:
    """A few real SGD steps, different per seed."""
    sgd_steps(model, torch.Generator().manual_seed(seed), steps, torch.optim.SGD(model.parameters(), lr=0.1))


# ---- peers --------------------------------------------------------------------------------------


class Peers:
    """Peers in threads, each a SyncClient on its own copy of ``model()`` (a tiny GPT-2 unless
    told). ``url`` may differ per peer (some through a fault proxy)."""

    def __init__(
        self,
        url: str | dict[str, str],
        run: str,
        names: Sequence[str],
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
        """ "Train" by :func:`perturb` (then sleep ``train_seconds``), remember the delta, sync."""
        client, model = self.clients[name], self.models[name]
        view = ModelView(model)
        base = {k: v.copy() for k, v in view.export().items()}
        perturb(model, seed, client.version)
        time.sleep(train_seconds)  # heartbeats go on meanwhile: a slow peer, not a test's wait
        self.deltas[name, client.version] = {k: v - base[k] for k, v in view.export().items()}
        self.results[name] = client.sync(model, samples=samples)
        return self.results[name]

    def train(self, name: str, rounds: int, *, steps: int = 2, pause: float = 0.0) -> list[Any]:
        """Join, then ``rounds`` times: ``steps`` real SGD steps on random tokens, ``pause``
        seconds (a slower peer), and a sync with loss and validation perplexity; then leave."""
        i = list(self.clients).index(name)
        client, model = self.clients[name], self.models[name]
        gen = torch.Generator().manual_seed(100 + i)
        held_out = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(7))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        client.join(model)
        results, step = [], 0
        for _ in range(rounds):
            loss = sgd_steps(model, gen, steps, opt)
            step += steps
            time.sleep(pause)  # the dashboard's timeline shows the others waiting for this one
            with torch.no_grad():
                eval_loss = model(input_ids=held_out, labels=held_out).loss.item()
            metrics = {"loss": loss, "eval_loss": eval_loss, "eval_ppl": math.exp(eval_loss), "step": step}
            results.append(client.sync(model, samples=4 * steps, metrics=metrics))
        client.leave()
        return results

    def train_all(self, rounds: int, *, steps: int = 2, pause: float = 0.0) -> Peers:
        """Every peer :meth:`train` in its own thread (the i-th pausing i+1 times ``pause``);
        :meth:`wait` for them."""
        for i, name in enumerate(self.clients):
            self.start(name, lambda n=name, p=pause * (i + 1): self.train(n, rounds, steps=steps, pause=p))
        return self

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
