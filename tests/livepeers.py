"""Two real peers that train a tiny GPT-2 in threads and report metrics: a run to look at.

Shared by the observability tests (dashboard, metrics, status CLI): each needs a run with a
few closed rounds and per-peer loss / perplexity, made by the real SDK against a real hub.
"""

from __future__ import annotations

import math
import threading
import time

import torch

from syncclient import SyncClient, SyncResult
from tests.conftest import tiny_gpt2


class Peers:
    """``Peers(url, run, rounds=3).start()`` … ``.join()`` (re-raises a peer's failure)."""

    def __init__(
        self,
        url: str,
        run: str,
        *,
        rounds: int,
        token: str | None = None,
        codec: str | None = None,
        names: tuple[str, ...] = ("peer-a", "peer-b"),
        pause: float = 0.0,
        steps: int = 2,
    ) -> None:
        self.url, self.run, self.rounds, self.token, self.codec = url, run, rounds, token, codec
        self.names, self.pause, self.steps = names, pause, steps
        self.results: dict[str, list[SyncResult]] = {name: [] for name in names}
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._guarded, args=(i,), daemon=True) for i in range(len(names))]

    def start(self) -> Peers:
        for t in self._threads:
            t.start()
        return self

    def join(self, timeout: float = 120.0) -> dict[str, list[SyncResult]]:
        for t in self._threads:
            t.join(timeout)
        if self.errors:
            raise self.errors[0]
        if any(t.is_alive() for t in self._threads):
            raise TimeoutError(f"peers of run {self.run!r} still running after {timeout}s")
        return self.results

    def _guarded(self, i: int) -> None:
        try:
            self._peer(i)
        except BaseException as exc:
            self.errors.append(exc)

    def _peer(self, i: int) -> None:
        name = self.names[i]
        model = tiny_gpt2(seed=i)
        gen = torch.Generator().manual_seed(100 + i)
        held_out = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(7))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        client = SyncClient(
            self.url,
            run=self.run,
            peer=name,
            token=self.token,
            codec=self.codec,
            min_peers=len(self.names),
            retry_seconds=30,
        )
        client.join(model)
        step = 0
        for _ in range(self.rounds):
            for _ in range(self.steps):
                ids = torch.randint(0, 256, (4, 16), generator=gen)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                step += 1
            # the later peers are slower: the timeline shows the first ones waiting for them
            time.sleep(self.pause * (i + 1))
            with torch.no_grad():
                eval_loss = model(input_ids=held_out, labels=held_out).loss.item()
            metrics = {"loss": loss.item(), "eval_loss": eval_loss, "eval_ppl": math.exp(eval_loss), "step": step}
            self.results[name].append(client.sync(model, samples=4 * self.steps, metrics=metrics))
        client.leave()
