"""``SyncCallback``: join a weightsync run from a ``transformers.Trainer`` with one line.

```python
from syncclient import SyncCallback

trainer = Trainer(
    model=model, args=args, train_dataset=train,
    callbacks=[SyncCallback("http://hub:8000", sync_every=1000, run="imdb-gpt2")],
)
trainer.train()
```

What it does, on the main process of the peer:

- **train begin**: join the run and load the global version into the model, so every peer
  starts from the same weights. If you pass a ``client`` that has already joined (to learn your
  rank and world size before you shard the data), it does not join again.
- **every ``sync_every`` optimizer steps** (``state.global_step``, so gradient accumulation needs
  nothing special): send the update with the number of samples seen since the last sync and
  the training loss of those steps (it asks the Trainer to log at that step, so the loss is
  fresh), then train on from the merged version.
- **or, with ``round_samples=S``** (a run whose rounds close on a global sample count, the
  ``samples`` policy): count each step's samples for the hub and sync at the first step end
  after the hub says the round is due (the peers together trained S samples). A fast peer syncs
  after more steps than a slow one; nobody waits for more than the step another peer is in.
  Whichever the callback was given, it follows the run's policy as the hub reports it at join.
- **evaluate**: the eval metrics ride along with the next update.
- **train end**: a last sync if there were steps since the previous one, then leave.

Every update carries ``step`` (``state.global_step``) in its metrics: the dashboard plots
against it.

**Overlap** (``overlap=True``; Streaming DiLoCo's eager updates): at a sync step the callback
starts :meth:`SyncClient.sync_async` (snapshot ``x_t`` and encoding on the training thread,
upload and waiting on a background thread) and training goes on. At each later step end it
checks whether the round's merged update ``U`` is in; once it is, it applies it:
``base' = base + decode(U)`` (identical on every peer) and ``model = base' + (model - x_t)``,
keeping the steps taken meanwhile, which then count in the next update. If the result is still
out at the next sync step, it waits for it there before starting the next one; at train end it
applies the pending one, then makes a final *blocking* sync (if any step was taken since the
snapshot), so every peer ends with identical weights. In between, peers differ by their own
in-flight steps. A sync due at the last step (``max_steps``) is blocking. Costs and caveats:
one more float32 copy of the model while a sync is in flight; an evaluation at a sync step
sees this peer's own weights (the merge lands a step or more later); a late peer (the round
closed without it) is caught up when the result is applied, as with a blocking sync: its
weights become the latest version and its local steps, in-flight ones included, are dropped.

The Trainer's optimizer state (Adam's moments, the learning-rate schedule) is kept across
syncs on purpose. After a sync the weights jump to the merged version while the moments still
describe this peer's recent gradients; that is what local SGD and DiLoCo do (the inner
optimizer is local, only weights are averaged). Resetting Adam at every sync restarts its bias
correction and measured worse; averaging the first moment at each sync helped a little, for
twice the bytes, and less than scaling the learning rate (bench/RESULTS.md, issue 27).

**Each peer's learning rate** is the Trainer's, or with ``lr_scaling`` that times ``sqrt(N)`` or
``N`` with N peers, ramped in over the first round: a peer trains on 1/N of the global batch,
Adam steps each peer about as far as serial steps on the whole batch, and the average of N such
noisier steps is shorter than serial's. It is off by default: at serial's best rate it did not
win (bench/RESULTS.md, issue 27). The factor is applied for each optimizer step and undone right
after it, so the scheduler (and a checkpoint of it) keeps the rates it set (:mod:`syncclient.peerlr`).

**A peer with several GPUs** (``torchrun --nproc-per-node P``, DDP or FSDP, ``args.world_size >
1``): every rank runs the callback; the client serves the process group
(``SyncClient(..., group=torch.distributed.group.WORLD)``, made at train begin when the
callback made the client): rank 0 alone talks to the hub and the merged weights reach every
rank after each sync (:mod:`syncclient.group`). Overlap is not available there (the ranks would
have to agree at every step on whether the result is in).

The sample count of an update is ``steps * args.train_batch_size *
args.gradient_accumulation_steps * args.world_size``: the nominal number of training
samples, which overcounts by less than one batch when an epoch ends on a short batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from syncclient.adapters import callback_client, join_at_train_begin, sync_metrics
from syncclient.client import PendingSync, SyncClient, SyncResult
from syncclient.peerlr import DEFAULT_PEER_LR, LRScaler, PeerLR
from syncclient.schedule import SyncSchedule

__all__ = ["SyncCallback"]

logger = logging.getLogger(__name__)


class SyncCallback(TrainerCallback):
    """Average this Trainer's model with the other peers of a run every ``sync_every`` steps,
    or whenever the peers together trained ``round_samples`` samples.

    Args:
        hub: the hub's base URL (``http://`` or ``https://``). Give ``hub`` or ``client``.
        sync_every: optimizer steps between syncs (an int >= 1), or a
            :class:`~syncclient.schedule.SyncSchedule` (e.g. every 5 until step 60, then every
            15; the same on every peer): barrier and async runs.
        round_samples: samples per round for the run (an int >= 1), which makes it a samples
            run when this peer creates it; a keyword of ``SyncClient`` too.
        client: a :class:`SyncClient` you built yourself; joined already or not. The callback
            leaves the run at the end but does not close a client it did not create.
        on_sync: called with each :class:`SyncResult` after a sync (for scripts that log or
            evaluate per round); exceptions it raises stop training. With ``overlap`` it is
            called when the result is applied.
        overlap: send each update in the background and apply the merged result a step or more
            later, keeping the steps taken meanwhile (see the module docstring). Hides the
            sync's network time from training; off by default.
        lr_scaling: each peer's learning rate with N peers: the Trainer's ``learning_rate`` (serial's,
            at the global batch) x 1 (``"none"``, default), x ``sqrt(N)`` (``"sqrt"``) or x ``N``
            (``"linear"``); the scheduler keeps its own rates (:mod:`syncclient.peerlr`).
        lr_scaling_warmup: optimizer steps over which that factor ramps in from 1 (default:
            one round, ``sync_every`` steps; a schedule's first interval).
        **client_kwargs: passed to ``SyncClient(hub, ...)``: ``run`` (required), ``peer``,
            ``token``, ``codec``, ``outer``, ``outer_lr``, ``outer_momentum``, ``outer_warmup``, ``min_peers``,
            ``round_timeout``, ``timeout``, ...

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
        sync_every: int | SyncSchedule | None = None,
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
        self.client = callback_client(hub, sync_every=sync_every, client=client, client_kwargs=client_kwargs)
        self._owns_client = client is None
        self._hub, self._client_kwargs = hub, client_kwargs  # to remake the client for a process group
        self.sync_every = sync_every
        self.on_sync = on_sync
        self.overlap = overlap
        self.peer_lr = PeerLR(lr_scaling, lr_scaling_warmup).for_rounds(sync_every)
        self._scaler = LRScaler()
        self._peers = 1  # the run's world size, known once joined
        self.join_info: Any = None
        self.last_result: SyncResult | None = None
        self.syncs = 0
        self._active = False  # joined and not yet left: the events below act only then
        self._pending = False  # a sync is due; done at the next on_log (or the next step at the latest)
        self._loss: Any = None  # training loss logged since the last sync
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
        self.join_info = join_at_train_begin(self.client, _model(kwargs), state.global_step) or self.join_info
        self._peers = self.client.world_size or 1
        self._active = True
        self._pending = False
        self._loss = None
        self._eval_metrics = {}

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
        last_step = state.max_steps > 0 and state.global_step >= state.max_steps
        if self.client.due or (last_step and self.client.clock.unsynced):
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
        self._loss = None
        self._eval_metrics = {}
        last_step = state.max_steps > 0 and state.global_step >= state.max_steps
        if self.overlap and not blocking and not last_step:  # at the last step nothing would overlap
            self._inflight = self.client.sync_async(model, samples=samples, metrics=metrics)
            self._inflight_steps = steps
            return
        # the last step's sync, or the one at train end: the peer's last (see SyncClient.sync)
        final = last_step or blocking
        self._finish(state, self.client.sync(model, samples=samples, metrics=metrics, final=final), steps)

    def _land(self, state: TrainerState, model: Any) -> None:
        """Apply the overlapped sync in flight, if any (waiting for its result if need be)."""
        if self._inflight is None:
            return
        pending, self._inflight = self._inflight, None
        self._finish(state, pending.apply(model), self._inflight_steps)

    def _finish(self, state: TrainerState, result: SyncResult, steps: int) -> None:
        self.last_result = result
        self.syncs += 1
        logger.info(
            "step %d: synced %d steps -> version %d in %.2f s (%.2f s of it stalled training)%s",
            state.global_step,
            steps,
            result.version,
            result.seconds,
            result.stall_seconds,
            " (late: caught up, local steps dropped)" if result.caught_up else "",
        )
        if self.on_sync is not None:
            self.on_sync(result)


def _model(kwargs: dict[str, Any]) -> Any:
    model = kwargs.get("model")
    if model is None:
        raise ValueError("SyncCallback needs the model: the Trainer passes it as kwargs['model']")
    return model
