"""``SyncCallback``: join a weightsync run from a ``transformers.Trainer`` with one line.

```python
from syncclient import SyncCallback

trainer = Trainer(
    model=model, args=args, train_dataset=train,
    callbacks=[SyncCallback("http://hub:8000", sync_every=1000, run="imdb-gpt2")],
)
trainer.train()
```

At train begin it joins (unless its ``client`` joined already, to learn its rank before sharding
the data). After each optimizer step it tells the client (``state.global_step``: gradient
accumulation needs nothing special), whose clock says when a sync is due; it then asks the Trainer
to log and syncs in ``on_log`` with the fresh loss and the eval metrics since the last sync (an
evaluation at that step runs after the log, on the merged weights). At train end: a last sync if
steps were trained since, then leave. ``overlap=True`` (docs/sdk.md, "Overlap"): a later step end
applies the merged update once it is in; the syncs at ``max_steps`` and at train end block, so
every peer ends identical. Several GPUs per peer (``args.world_size > 1``): the client serves
the process group (docs/concepts/groups.md), without overlap (the ranks would have to agree at
every step on whether the result is in).

The Trainer's optimizer state is kept across syncs on purpose, as local SGD and DiLoCo do:
resetting Adam at every sync measured worse, and averaging its first moment helped less than
scaling the learning rate, for twice the bytes (bench/RESULTS.md, issue 27; :mod:`syncclient.peerlr`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from syncclient.adapters import Adapter, sync_metrics
from syncclient.client import PendingSync, SyncClient, SyncResult
from syncclient.peerlr import DEFAULT_PEER_LR, LRScaler
from syncclient.schedule import SyncEvery

__all__ = ["SyncCallback"]

logger = logging.getLogger(__name__)


class SyncCallback(Adapter, TrainerCallback):
    """Average this Trainer's model with the other peers of a run every ``sync_every`` steps,
    or whenever the peers together trained ``round_samples`` samples.

    Args:
        hub: the hub's base URL (``http://`` or ``https://``). Give ``hub`` or ``client``.
        sync_every: optimizer steps between syncs (an int >= 1), a
            :class:`~syncclient.schedule.SyncSchedule` (barrier and async runs), or ``"auto"``:
            the hub picks each interval (``utilization``, ``sync_min``, ``sync_max``).
        client: a :class:`SyncClient` you built yourself, joined already or not; left at the
            end but not closed.
        on_sync: called with each :class:`SyncResult` (with ``overlap``: when applied);
            exceptions it raises stop training.
        overlap: send each update in the background and apply the merged result a step or more
            later, keeping the steps taken meanwhile (see the module docstring). Off by default.
        lr_scaling: each peer's learning rate with N peers: the Trainer's ``learning_rate`` (serial's,
            at the global batch) x 1 (``"none"``, default), x ``sqrt(N)`` (``"sqrt"``) or x ``N``
            (``"linear"``); the scheduler keeps its own rates (:mod:`syncclient.peerlr`).
        lr_scaling_warmup: optimizer steps over which that factor ramps in from 1 (default:
            one round, ``sync_every`` steps; a schedule's first interval).
        **client_kwargs: passed to ``SyncClient(hub, ...)``: ``run`` (required), ``peer``,
            ``token``, the run settings (``codec``, ``round_samples``, ...), ``timeout``, ...

    Attributes:
        client: the :class:`SyncClient` in use.
        join_info: what ``join`` returned (``None`` if the client had joined before).
        last_result: the latest :class:`SyncResult`, ``None`` before the first sync.
        syncs: how many syncs this callback completed (with ``overlap``: applied).
    """

    def __init__(
        self,
        hub: str | None = None,
        *,
        sync_every: SyncEvery | None = None,
        client: SyncClient | None = None,
        on_sync: Callable[[SyncResult], None] | None = None,
        overlap: bool = False,
        lr_scaling: str = DEFAULT_PEER_LR.scaling,
        lr_scaling_warmup: int | None = DEFAULT_PEER_LR.warmup,
        **client_kwargs: Any,
    ) -> None:
        if on_sync is not None and not callable(on_sync):
            raise ValueError(f"on_sync must be callable, got {on_sync!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        super().__init__(hub, sync_every, client, lr_scaling, lr_scaling_warmup, client_kwargs)
        self._owns_client = client is None
        self._hub, self._client_kwargs = hub, client_kwargs  # to remake the client for a process group
        self.sync_every, self.on_sync, self.overlap = sync_every, on_sync, overlap
        self._scaler = LRScaler()
        self._peers = 1  # the run's world size, known once joined
        self._pending = False  # a sync is due; done at the next on_log (or the next step at the latest)
        self._eval_metrics: dict[str, Any] = {}
        self._inflight: PendingSync | None = None  # overlap: started, not yet applied
        self._inflight_steps = 0  # the steps that sync carries

    # -- events ---------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Checked on every rank, so that a DDP job fails everywhere instead of hanging on rank 1.
        if args.world_size > 1:
            self._serve_the_group(args)
        self._begin(_model(kwargs), state.global_step)
        self._peers = self.client.world_size or 1
        self._pending, self._loss, self._eval_metrics = False, None, {}

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._active and self._pending:  # the Trainer did not log after the due step
            self._sync(args, state, _model(kwargs))

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._active and kwargs.get("optimizer") is not None:
            self._scaler.before(kwargs["optimizer"], self.peer_lr.factor(self._peers, state.global_step))

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._scaler.after()  # the scheduler steps next, from the rate it set

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if not self._active:
            return control
        self.client.progress(int(args.train_batch_size * args.gradient_accumulation_steps), step=state.global_step)
        if self._inflight is not None and self._inflight.done():
            self._land(state, _model(kwargs))  # (a late peer's clock counts from this step again)
        if self._due(state.global_step, state.max_steps)[0]:
            # Decide here, act in on_log: asking for a log makes the Trainer report the loss of
            # the steps since its last log, which we send with the update. Evaluation at this
            # step runs after the log, so it sees the merged weights.
            self._pending = True
            control.should_log = True
        return control

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self._active:
            return
        if logs and logs.get("loss") is not None:
            self._loss = logs["loss"]
        if self._pending:
            self._sync(args, state, _model(kwargs))

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._active and metrics:
            self._eval_metrics.update(metrics)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._active:
            return
        try:
            self._land(state, _model(kwargs))
            if self._pending or self.client.clock.unsynced:
                self._sync(args, state, _model(kwargs), blocking=True)
        finally:
            self._active = False
            self.client.leave()
            if self._owns_client:
                self.client.close()

    # -- the work ---------------------------------------------------------------------------------

    def _serve_the_group(self, args: TrainingArguments) -> None:
        """Several processes train this peer: the client must serve their process group."""
        if self.overlap:
            raise ValueError(f"overlap=True is for one process per peer; this peer has {args.world_size} ranks")
        if self.client.group is not None:
            return
        if not self._owns_client:
            raise ValueError(
                f"this peer has {args.world_size} ranks: pass SyncClient(..., group=torch.distributed.group.WORLD)"
            )
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"args.world_size is {args.world_size} but torch.distributed is not initialised")
        self.client.close()  # never joined: made before the Trainer set torch.distributed up
        self.client = SyncClient(self._hub, group=dist.group.WORLD, sync_every=self.sync_every, **self._client_kwargs)  # type: ignore[arg-type]

    def _sync(self, args: TrainingArguments, state: TrainerState, model: Any, *, blocking: bool = False) -> None:
        self._land(state, model)  # the previous overlapped sync, if still out: wait for it here
        clock, self._pending = self.client.clock, False
        if not clock.unsynced:  # it was late: its apply dropped every local step, nothing left to send
            return
        steps, samples = clock.step - clock.last, self.client.pending_samples
        metrics = sync_metrics({**self._eval_metrics, "loss": self._loss}, state.global_step)
        self._loss, self._eval_metrics = None, {}
        last_step = self._due(state.global_step, state.max_steps)[1]
        if self.overlap and not blocking and not last_step:  # at the last step nothing would overlap
            self._inflight = self.client.sync_async(model, samples=samples, metrics=metrics)
            self._inflight_steps = steps
            return
        # the last step's sync, or the one at train end: the peer's last (see SyncClient.sync)
        final = last_step or blocking
        self._synced(self.client.sync(model, samples=samples, metrics=metrics, final=final), state.global_step, steps)

    def _land(self, state: TrainerState, model: Any) -> None:
        """Apply the overlapped sync in flight, if any (waiting for its result if need be)."""
        if self._inflight is None:
            return
        pending, self._inflight = self._inflight, None
        self._synced(pending.apply(model), state.global_step, self._inflight_steps)


def _model(kwargs: dict[str, Any]) -> Any:
    model = kwargs.get("model")
    if model is None:
        raise ValueError("SyncCallback needs the model: the Trainer passes it as kwargs['model']")
    return model
