"""``SyncCallback`` for PyTorch Lightning: join a weightsync run from a ``Trainer`` with one line.

```python
from syncclient.lightning import SyncCallback

trainer = L.Trainer(max_epochs=3, callbacks=[SyncCallback("http://hub:8000", sync_every=1000, run="imdb")])
trainer.fit(model, train_loader)
```

What :class:`syncclient.SyncCallback` does for Hugging Face, at a batch's end: join at fit start
(the model on its device, the optimizers made), tell the client each step (``trainer.global_step``:
``accumulate_grad_batches`` needs nothing special; a batch's samples: its first tensor's length),
sync when due with the last ``loss`` and ``trainer.callback_metrics`` (``self.log("val_acc", ...)``
shows in the dashboard), a last sync at train end, then leave; on an exception (Ctrl-C included)
leave, so the others stop waiting. One process per peer: a Trainer on several devices is refused
at fit start. ``lr_scaling`` goes through torch's optimizer hooks.

Works with ``lightning`` and, if that is not installed, ``pytorch_lightning``;
:func:`callback_class` gives the class for the other one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch import Callback
except ModuleNotFoundError as exc:
    if exc.name not in ("lightning", "lightning.pytorch"):
        raise
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment]
    except ModuleNotFoundError:
        raise ImportError(
            "syncclient.lightning needs PyTorch Lightning: pip install lightning (or weightsync[lightning])"
        ) from exc

import torch

from syncclient.adapters import Adapter, sync_metrics
from syncclient.client import SyncClient
from syncclient.peerlr import DEFAULT_PEER_LR, scale_each_step
from syncclient.schedule import SyncEvery

__all__ = ["SyncCallback", "callback_class"]

logger = logging.getLogger(__name__)


class _Sync(Adapter):
    """The callback's behaviour, apart from the ``Callback`` base it is mixed into."""

    def __init__(
        self,
        hub: str | None = None,
        *,
        sync_every: SyncEvery | None = None,
        client: SyncClient | None = None,
        lr_scaling: str = DEFAULT_PEER_LR.scaling,
        lr_scaling_warmup: int | None = DEFAULT_PEER_LR.warmup,
        **client_kwargs: Any,
    ) -> None:
        super().__init__(hub, sync_every, client, lr_scaling, lr_scaling_warmup, client_kwargs)
        self._unhook: list[Any] = []  # removes the learning-rate scaling of each optimizer

    # -- hooks ------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        if trainer.world_size > 1:
            raise ValueError(
                f"SyncCallback supports one training process per peer, got a Trainer on {trainer.world_size} "
                "processes: run one peer per process (DDP peers are not supported yet)"
            )
        self._begin(pl_module, trainer.global_step)
        peers = self.client.world_size or 1
        self._unhook = [
            scale_each_step(opt, self.peer_lr, peers, lambda: trainer.global_step) for opt in trainer.optimizers
        ]

    def on_train_batch_end(
        self, trainer: Any, pl_module: torch.nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs  # read at the sync
        # a batch end is an optimizer step's only when the step advanced (gradient accumulation)
        self.client.progress(_batch_size(batch) or 1, step=trainer.global_step)
        due, last_step = self._due(trainer.global_step, trainer.max_steps)
        if due:
            self._sync(trainer, pl_module, final=last_step)

    def on_train_end(self, trainer: Any, pl_module: torch.nn.Module) -> None:
        if not self._active:
            return
        try:
            if self.client.clock.unsynced:
                self._sync(trainer, pl_module, final=True)
        finally:
            self._leave()

    def on_exception(self, trainer: Any, pl_module: torch.nn.Module, exception: BaseException) -> None:
        if self._active:
            self._leave()

    # -- the work ---------------------------------------------------------------------------------

    def _sync(self, trainer: Any, pl_module: torch.nn.Module, *, final: bool = False) -> None:
        """One blocking sync; ``final``: training ends here (see ``SyncClient.sync``)."""
        metrics = sync_metrics({"loss": self._loss, **trainer.callback_metrics}, trainer.global_step)
        steps = self.client.clock.step - self.client.clock.last  # before the sync starts the clock afresh
        result = self.client.sync(pl_module, samples=max(1, self.client.pending_samples), metrics=metrics, final=final)
        self._synced(result, trainer.global_step, steps)

    def _leave(self) -> None:
        self._active = False
        for unhook in self._unhook:
            unhook()
        self._unhook = []
        self.client.leave()  # leave() also closes the client; a client passed in is left too


class SyncCallback(_Sync, Callback):  # type: ignore[misc]  # Callback: Any when Lightning has no stubs
    """Average this Trainer's ``LightningModule`` with the other peers of a run every
    ``sync_every`` optimizer steps, or whenever the peers together trained ``round_samples``
    samples. The arguments are :class:`syncclient.SyncCallback`'s, less ``on_sync`` and ``overlap``;
    ``lr_scaling`` scales the optimizers' own rates.
    """


_CLASSES: dict[type, type] = {Callback: SyncCallback}


def callback_class(base: type) -> type:
    """``SyncCallback`` for the ``Callback`` class of another Lightning package (``lightning`` and
    ``pytorch_lightning`` each check callbacks against their own)."""
    if base not in _CLASSES:
        _CLASSES[base] = type("SyncCallback", (_Sync, base), {"__module__": __name__, "__doc__": SyncCallback.__doc__})
    return _CLASSES[base]


def _batch_size(batch: Any) -> int:
    """The length of the batch's first tensor (depth first through tuples, lists and dicts); 0
    if it holds none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return 0
