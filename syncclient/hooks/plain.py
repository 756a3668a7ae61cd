"""A plain PyTorch loop: sync every N optimizer steps, through torch's global optimizer hooks.

``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook`` see every step of
every optimizer in the process, whatever the loop looks like. At the first step (before it
updates anything) the pre-hook finds the model the optimizer trains (:mod:`.model`), joins the
run, which loads the run's version into it (so all peers start from the same weights), and
removes itself. After every step the post-hook counts; every ``sync_every`` steps (or, with
``round_samples``, when the hub says the round is due) a sync is due, and it is made, blocking,
at the start of the lead's next step (a pre-hook, before that step changes the weights), or at
exit if no step comes. So a peer's last sync is always the one at exit, marked final (as the
callbacks mark theirs: :meth:`SyncClient.sync`), whether or not the step count is a multiple of
N: peers of one run, whatever their kind, then agree on their last round and end on the same
version. The cost: that next step's gradient was computed on the weights before the sync, as
if one step were in flight (the SDK's overlap keeps more than that): negligible at N in the
hundreds.

Steps are those of one optimizer, the *lead* (the first to step): two optimizers over parts of
one model (e.g. Muon for the matrices, AdamW for the rest) step once each per iteration, which
is one step, not two. Another optimizer is looked at once, on its first step: over the same
model it is fine (and becomes the lead when the lead is gone, e.g. re-created per epoch); over
another model it is refused (one run syncs one model).

At exit (when the program's main thread ends, before the interpreter shuts its thread pools
down: the SDK uploads from one), unless the program died of an exception: the last, final sync
if the lead stepped since the previous one, then leave the run (the hub stops waiting for this
peer: the others go on without it). Peers that took the same number of steps (sharded data
makes sure of it) thus end bit-identical; what the program saved *before* that last sync holds
its own last steps, not the merged weights.

Refusals (no single model, a second model, the hub rank disagreeing with ``WEIGHTSYNC_RANK``,
a failed sync) end the program with one line on stderr and exit code 1 (``SystemExit``), not a
traceback through the training loop.

Cost per step between syncs: a weak reference call, a counter, a comparison (bench/hooks.py).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, NoReturn

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from syncclient.hooks import session, shard
from syncclient.hooks.model import AmbiguousModel, describe, find_model
from syncclient.hooks.settings import HookSettings

__all__ = ["PlainLoop", "install"]


def install(settings: HookSettings) -> PlainLoop:
    """At torch's import: watch every optimizer step of the process."""
    loop = PlainLoop(settings)
    loop.start()
    return loop


def _dead() -> None:
    return None


class PlainLoop:
    def __init__(self, settings: HookSettings) -> None:
        self.settings = settings
        self.model: torch.nn.Module | None = None
        self.client: Any = None  # a SyncClient, once joined
        self.steps = 0  # the lead optimizer's steps since join
        self.last_sync = 0  # self.steps at the last sync
        self.samples = 0  # trained since the last sync
        self._lead: Any = _dead  # a weakref to the lead optimizer (a dead one returns None)
        self._others: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._by_samples = False
        self._due = False  # a sync is due: made at the lead's next step, or at exit
        self._pid = os.getpid()
        self._begun = False
        self._pre: Any = None  # torch's hook handles
        self._post: Any = None
        self._unscale: Any = lambda: None  # removes the learning-rate scaling of the lead's steps

    def start(self) -> None:
        self._pre = register_optimizer_step_pre_hook(self._first_step)
        self._post = register_optimizer_step_post_hook(self._after_step)
        session.on_claimed(self.stop)

    def stop(self) -> None:
        """Stand aside for good: a Trainer claimed the process (never called from a hook: torch
        iterates its hook dicts while calling them, so a hook removes only the other kind)."""
        for handle in (self._pre, self._post):
            if handle is not None:
                handle.remove()
        self._pre = self._post = None

    # -- hooks ------------------------------------------------------------------------------------

    def _first_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the process's first optimizer step: find the model and join, or stand aside."""
        if self._begun:
            return  # left in place only when standing aside for the SDK: a call that returns
        self._begun = True
        if not session.claim("torch", f"a torch optimizer ({type(optimizer).__name__})"):
            if self._post is not None:
                self._post.remove()
                self._post = None
            return
        self._join(_model_of(optimizer))
        self._lead = weakref.ref(optimizer)
        self._others[optimizer] = True
        self._scale(optimizer)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the lead's step that follows a due sync: make it (the weights are still those
        the steps so far left). The other optimizers' steps of the due iteration come first."""
        lead = self._lead()
        if not self._due or self.client is None or (lead is not None and lead is not optimizer):
            return
        self._due = False
        self._sync()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._pre is not None and not self._due:  # joined, and no sync waits: no pre-hook needed
            self._pre.remove()
            self._pre = None
        if self._lead() is not optimizer and not self._adopt(optimizer):
            return
        samples = shard.take_samples() or 1  # a loop without a DataLoader counts steps
        self.steps += 1
        self.samples += samples
        if self._by_samples:
            self.client.progress(samples)
            due = self.client.due
        else:
            due = self.steps - self.last_sync >= self.settings.sync_every  # type: ignore[operator]
        if due and not self._due:
            self._due = True
            if self._pre is None:
                self._pre = register_optimizer_step_pre_hook(self._before_step)

    def _adopt(self, optimizer: torch.optim.Optimizer) -> bool:
        """Another optimizer stepped: is it over our model, and is it the lead now?"""
        if self.client is None:
            return False  # stood aside, or not joined
        if optimizer not in self._others:
            assert self.model is not None
            model = _model_of(optimizer)
            if _inner(model) is not _inner(self.model):
                self._refuse(
                    f"a second optimizer trains another model ({describe([model])}, besides "
                    f"{describe([self.model])} which this run syncs): make both submodules of one torch.nn.Module, "
                    "or sync with the SDK yourself (SyncClient)"
                )
            self._others[optimizer] = True
        if self._lead() is None:  # the lead was dropped (e.g. a new optimizer per epoch): this one leads
            self._lead = weakref.ref(optimizer)
            self._scale(optimizer)  # from its next step: this one has been taken
            return True
        return False

    def _scale(self, optimizer: torch.optim.Optimizer) -> None:
        """Each of the lead's steps at the learning rate scaled for the run's peers (syncclient.peerlr)."""
        from syncclient.peerlr import scale_each_step

        self._unscale()
        self._unscale = scale_each_step(
            optimizer, self.settings.peer_lr, self.client.world_size or 1, lambda: self.steps
        )

    # -- the run ----------------------------------------------------------------------------------

    def _join(self, model: torch.nn.Module) -> None:
        from syncclient.client import SyncClient  # only now: the program does not use the SDK itself
        from syncclient.exceptions import SyncError

        settings = self.settings
        client = SyncClient(settings.hub, **settings.client_kwargs())
        try:
            info = client.join(model)
        except SyncError as exc:
            client.close()
            raise SystemExit(f"weightsync: cannot join run {settings.run!r} at {settings.hub}: {exc}") from None
        session.check_rank(settings, client)  # on a mismatch it leaves and stops the program
        if client.policy != "samples" and settings.sync_every is None:
            client.leave()
            raise SystemExit(f"weightsync: run {settings.run!r} is a {client.policy} run: give --sync-every N")
        self.model, self.client, self._by_samples = model, client, client.policy == "samples"
        session.attached(lambda: self.client, lambda: self.model)
        session.note(
            f"syncing {describe([_inner(self.model)])} as {info.peer} (rank {info.rank} of {info.world_size}) "
            f"in run {settings.run!r}, "
            + ("when rounds are due" if self._by_samples else f"every {settings.sync_every} optimizer steps")
        )
        _at_main_thread_exit(self._at_exit)

    def _sync(self) -> None:
        from syncclient.exceptions import SyncError

        try:
            self.client.sync(self.model, samples=self.samples, metrics={"step": float(self.steps)})
        except SyncError as exc:
            self._refuse(f"the sync at step {self.steps} failed: {exc}")
        self.last_sync, self.samples = self.steps, 0

    def _refuse(self, why: str) -> NoReturn:
        """Leave the run (no last sync at exit) and end the program with one line."""
        client, self.client, self._due = self.client, None, False
        if client is not None:
            client.leave()
        raise SystemExit(f"weightsync: {why}")

    def _at_exit(self) -> None:
        if os.getpid() != self._pid or self.client is None:
            return
        from syncclient.exceptions import SyncError

        try:
            if session.crashed():
                session.note("the program failed: leaving the run without a last sync")
            elif self.steps > self.last_sync:
                self.client.sync(
                    self.model, samples=max(1, self.samples), metrics={"step": float(self.steps)}, final=True
                )
                self.last_sync = self.steps
        except SyncError as exc:
            session.note(f"the last sync failed ({exc}): this peer's weights may differ from the others'")
        finally:
            self.client.leave()


def _model_of(optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    try:
        return find_model(p for group in optimizer.param_groups for p in group["params"])
    except AmbiguousModel as exc:
        raise SystemExit(f"weightsync: cannot tell which model to sync: {exc}") from None


def _inner(model: Any) -> Any:
    from syncclient._model import unwrap

    return unwrap(model)


def _at_main_thread_exit(fn: Any) -> None:
    """Run ``fn`` when the main thread ends, before the interpreter stops its thread pools: a
    sync in an ``atexit`` function would find the SDK's pool closed. ``threading._register_atexit``
    is how ``concurrent.futures`` itself gets that moment; without it (another Python), ``atexit``."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        import atexit

        atexit.register(fn)
    else:
        register(fn)
