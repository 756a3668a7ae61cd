"""``syncclient.lightning.SyncCallback`` added by hand to a real Lightning ``Trainer``, against a
real hub: two peers in threads sync every N optimizer steps, a last sync at fit end, and end
with the hub's last version. Skipped, saying so, where Lightning is not installed
(``pip install '.[lightning]'``; ``make test`` installs it with the dev extra)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning", reason="PyTorch Lightning is not installed: pip install '.[lightning]'")

from syncclient.lightning import SyncCallback  # noqa: E402  (after the skip)
from syncclient.schedule import SyncSchedule  # noqa: E402
from tests.conftest import Hub  # noqa: E402
from tests.harness import hub_model, run_peers, status  # noqa: E402

STEPS = 10  # 40 samples, batch 4, one epoch


class Regression(L.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # peers start apart: the join makes them equal
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_mse", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(seed: int) -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS * 4, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def quiet_trainer(callback: SyncCallback, **limits: int) -> L.Trainer:
    """A CPU Trainer with the callback and nothing else that writes (logs, checkpoints, bars)."""
    return L.Trainer(
        accelerator="cpu",
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **limits,
    )


def fit(hub: Hub, i: int, sync_every: int | SyncSchedule) -> tuple[Regression, SyncCallback]:
    module = Regression(seed=i)
    callback = SyncCallback(hub.url, sync_every=sync_every, run="pl", peer=f"peer-{i}")
    trainer = quiet_trainer(callback, max_epochs=1)
    trainer.fit(module, data(seed=10 + i))
    assert trainer.global_step == STEPS
    return module, callback


def test_two_lightning_peers_end_on_the_hubs_last_version(hub_factory: Any) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    hub = hub_factory("--min-peers", "2")
    (a, cb_a), (b, cb_b) = run_peers(2, lambda i: fit(hub, i, sync_every=4))
    # 10 steps every 4: syncs at 4 and 8, and the last one at fit end (2 steps since)
    rounds = status(hub, "pl")["rounds"]
    assert [len(r["participants"]) for r in rounds] == [2, 2, 2]
    assert cb_a.syncs == cb_b.syncs == 3 and cb_a.last_result is not None
    assert cb_a.last_result.version == cb_b.last_result.version == 3  # type: ignore[union-attr]
    last = hub_model(hub, "pl")
    for module in (a, b):
        for name, tensor in module.state_dict().items():
            np.testing.assert_array_equal(tensor.numpy(), last[name], err_msg=name)
    # the samples the peers reported: 16, 16 and 8 each
    assert [r["samples"] for r in rounds] == [32, 32, 16]


def test_two_lightning_peers_on_a_sync_schedule_sync_at_the_same_steps(hub_factory: Any) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    hub = hub_factory("--min-peers", "2")
    plan = SyncSchedule(((2, 4),), 5)  # 10 steps: syncs at 2, 4, 9 and the last at fit end (1 step since)
    (a, cb_a), (b, cb_b) = run_peers(2, lambda i: fit(hub, i, sync_every=plan))
    rounds = status(hub, "pl")["rounds"]
    assert [r["samples"] for r in rounds] == [16, 16, 40, 8] and cb_a.syncs == cb_b.syncs == 4
    last = hub_model(hub, "pl")
    for module in (a, b):
        for name, tensor in module.state_dict().items():
            np.testing.assert_array_equal(tensor.numpy(), last[name], err_msg=name)


def test_several_devices_are_refused_at_fit_start(hub: Hub) -> None:
    callback = SyncCallback(hub.url, sync_every=2, run="ddp")

    class Trainer:  # what the callback reads of a Trainer on two processes
        world_size = 2
        global_step = 0

    with pytest.raises(ValueError, match="one training process per peer, got a Trainer on 2 processes"):
        callback.on_fit_start(Trainer(), Regression(seed=0))
    callback.client.close()


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="give sync_every=N"):
        SyncCallback("http://hub:8000", run="r")
    with pytest.raises(ValueError, match="hub must be an http:// or https:// URL"):
        SyncCallback("hub:8000", sync_every=2, run="r")


class Probe(L.LightningModule):
    """A gradient of 1 under plain SGD: each step moves the weight by exactly the rate it used."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.moves: list[float] = []
        self._before = 0.0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self._before = self.w.item()
        return self.w.sum() + 0 * batch.sum()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.moves.append(round(self._before - self.w.item(), 6))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_each_step_runs_at_the_rate_scaled_for_the_peers(hub_factory: Any) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    hub = hub_factory("--min-peers", "2")

    def peer(i: int) -> tuple[Probe, Any]:
        module = Probe()
        callback = SyncCallback(
            hub.url, sync_every=10, run="pl-lr", peer=f"p{i}", lr_scaling="linear", lr_scaling_warmup=2
        )
        trainer = quiet_trainer(callback, max_steps=4)
        trainer.fit(module, torch.utils.data.DataLoader(torch.zeros(8, 1), batch_size=2))
        return module, trainer.optimizers[0]

    for module, optimizer in run_peers(2, peer):
        assert module.moves == pytest.approx([0.1, 0.15, 0.2, 0.2])  # x 2 peers, ramped over 2 steps
        assert optimizer.param_groups[0]["lr"] == 0.1  # the optimizer keeps its own rate
