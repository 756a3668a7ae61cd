"""A plain PyTorch loop: sync every N optimizer steps, through torch's global optimizer hooks (a
loop with no optimizer, that steps its weights by hand: :mod:`.byhand`, through this one's syncs).

``register_optimizer_step_pre_hook`` / ``..._post_hook`` see every step of every optimizer in the
process. At the first step (before it updates anything) the pre-hook finds the model the
optimizer trains (:mod:`.model`), joins the run (which loads the run's version into it) and
removes itself; after every step the post-hook reports it to the client, whose clock says whether
a sync is due (:class:`~syncclient.schedule.SyncClock`). When syncs are made (docs/launcher.md,
"What a saved file holds, and when"):

- right after a window's last step (step kN; with two optimizers over one model, after the
  iteration's last one, so that the sync holds the whole iteration);
- when the program reads the model's state (``model.state_dict()``: every way of saving it but
  ``torch.save(model)``, which is watched too) with steps not synced: synced then, marked final
  as a Trainer's last sync is, taking that window's round; a read just after an ordinary sync of
  a lossy codec flushes its residual. So a file saved after the last step holds the run's model,
  and a checkpoint mid-training costs no round;
- at exit (the main thread's end, before the interpreter shuts the SDK's thread pool), unless
  the program died of an exception: the last sync or flush, then leave.

A ``round_samples`` run syncs at the first step after the hub says the round is due, and at
exit. Steps are those of the *lead* optimizer (the first to step): two optimizers over parts of
one model step once per iteration. Another optimizer is looked at on its first step: over the same
model it is fine (and leads once the lead is gone); over another model it is refused. Refusals
end the program with one line on stderr and exit code 1 (``SystemExit``), not a traceback.

Cost per step between syncs: 2.6-3.2 µs with the DataLoader's count (bench/hooks.py, mlp, at
load 9); per ``state_dict()`` call of any module, an identity check.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any, NoReturn

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from syncclient.exceptions import SyncError  # the standard library only
from syncclient.hooks import session, shard
from syncclient.hooks.model import AmbiguousModel, describe, find_model
from syncclient.hooks.settings import HookSettings

__all__ = ["PlainLoop", "install"]


def install(settings: HookSettings) -> PlainLoop:
    """At torch's import: watch every optimizer step of the process."""
    loop = PlainLoop(settings)
    loop.start()
    return loop


class PlainLoop:
    def __init__(self, settings: HookSettings) -> None:
        self.settings = settings
        self.model: torch.nn.Module | None = None
        self.client: Any = None  # a SyncClient, once joined: its clock counts the lead's steps
        self._lead: Any = lambda: None  # a weakref to the lead optimizer (a dead one returns None)
        self._latest: Any = lambda: None  # the optimizer that stepped last
        self._tail: Any = lambda: None  # the last optimizer to step before the lead's latest step
        self._others: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._due = False  # a sync waits for the iteration's last optimizer (or the lead's next step)
        self._syncing = False
        self._pid = os.getpid()
        self._thread = threading.get_ident()  # the training thread (reads from others do not sync)
        self._begun = False
        self._pre: Any = None  # torch's hook handles
        self._post: Any = None
        self._unscale: Any = lambda: None  # removes the learning-rate scaling of the lead's steps
        self._byhand: Any = None  # watches backward passes until an optimizer steps (syncclient.hooks.byhand)

    def start(self) -> None:
        from syncclient.hooks.byhand import ByHand

        self._pre = register_optimizer_step_pre_hook(self._first_step)
        self._post = register_optimizer_step_post_hook(self._after_step)
        self._byhand = ByHand(self)
        session.on_claimed(self.stop)

    def stop(self) -> None:
        """Stand aside for good: a Trainer claimed the process (never called from a hook: torch
        iterates its hook dicts while calling them, so a hook removes only the other kind)."""
        for handle in (self._pre, self._post):
            if handle is not None:
                handle.remove()
        self._pre = self._post = None
        if self._byhand is not None and not self._byhand.stepping:
            self._byhand.stop()

    # -- hooks ------------------------------------------------------------------------------------

    def _first_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the process's first optimizer step: find the model and join, or stand aside."""
        if self._begun:
            return  # left in place only when standing aside for the SDK: a call that returns
        self._begun = True
        if self._byhand is not None:
            self._byhand.stop()  # an optimizer steps this loop
        if not session.claim("torch", f"a torch optimizer ({type(optimizer).__name__})"):
            if self._post is not None:
                self._post.remove()
                self._post = None
            return
        self._join(_model_of(optimizer))
        self._thread = threading.get_ident()
        self._lead = weakref.ref(optimizer)
        self._others[optimizer] = True
        self._scale(optimizer)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the lead's next step, if the sync of the iteration before is still due (its
        last optimizer did not step this time): make it before this step changes the weights."""
        if self._due and self.client is not None and self._lead() in (optimizer, None):
            self._sync()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._pre is not None and not self._due:  # joined, and no sync waits: no pre-hook needed
            self._pre.remove()
            self._pre = None
        if self._lead() is not optimizer and not self._adopt(optimizer):
            if self.client is not None:  # another optimizer over the model, in the lead's iteration
                self._latest = weakref.ref(optimizer)
                if self._due and self._tail() is optimizer:
                    self._sync()
            return
        latest = self._latest()
        if latest is not optimizer:  # another optimizer stepped last: it ends the lead's iterations
            if latest is not None:
                self._tail = self._latest
            self._latest = self._lead
        elif self._tail is not self._lead:  # the lead stepped last: its step ends the iteration
            self._tail = self._lead
        self._syncing = True  # a preempted peer's hand-in (in progress) reads the model's state: not a save
        try:
            self.client.progress(shard.take_samples() or 1)  # a loop without a DataLoader counts steps
        finally:
            self._syncing = False
        if not self.client.due:
            return
        if self._tail() in (None, optimizer):  # one optimizer: its step ends the iteration
            self._sync()
        else:
            self._due = True
            if self._pre is None:
                self._pre = register_optimizer_step_pre_hook(self._before_step)

    def _state_read(self, module: torch.nn.Module) -> None:
        """The program reads ``module``'s state: if it is the model's, make it the run's model first."""
        if self.client is None or self._syncing or os.getpid() != self._pid:
            return
        if threading.get_ident() != self._thread:
            return  # a read from another thread (a background checkpoint) waits for the next one
        if module is not self.model and module is not _inner(self.model):
            return
        if self._due:
            self._sync()
        if self.client.clock.window_open:
            self._sync(final=True)
        else:
            self._flush()

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
        clock = self.client.clock
        self._unscale = scale_each_step(
            optimizer, self.settings.peer_lr, self.client.world_size or 1, lambda: clock.step
        )

    # -- the run ----------------------------------------------------------------------------------

    def _join(self, model: torch.nn.Module, steps: str = "optimizer steps") -> None:
        from syncclient.client import SyncClient  # only now: the program does not use the SDK itself

        settings = self.settings
        client = SyncClient(settings.hub, **settings.client_kwargs())
        try:
            info = client.join(model)
        except SyncError as exc:
            client.close()
            raise SystemExit(f"weightsync: cannot join run {settings.run!r} at {settings.hub}: {exc}") from None
        session.check_rank(settings, client)  # on a mismatch it leaves and stops the program
        try:
            client.count_from(0)
        except SyncError as exc:
            client.leave()
            raise SystemExit(f"weightsync: {exc} (--sync-every N)") from None
        self.model, self.client = model, client
        session.attached(lambda: self.client, lambda: self.model)
        session.note(
            f"syncing {describe([_inner(self.model)])} as {info.peer} (rank {info.rank} of {info.world_size}) "
            f"in run {settings.run!r}, "
            + ("when rounds are due" if client.policy == "samples" else settings.said_interval(steps))
        )
        _watch_state_reads(self)
        _watch_saves(self)
        _at_main_thread_exit(self._at_exit)

    def _sync(self, *, final: bool = False) -> None:
        """Sync the steps since the last sync; ``final``: with a lossy codec, flush the residual in
        one more round (the next window's)."""
        self._due, self._syncing = False, True
        clock = self.client.clock
        try:
            metrics = {"step": float(clock.step)}
            self.client.sync(self.model, samples=max(1, clock.samples), metrics=metrics, final=final)
        except SyncError as exc:
            if final:
                raise
            self._refuse(f"the sync at step {clock.step} failed: {exc}")
        finally:
            self._syncing = False

    def _flush(self) -> None:
        """Send the residual an ordinary last sync held back (if any), in the next window's round."""
        self._syncing = True
        try:
            self.client.flush(self.model)
        except SyncError as exc:
            self._refuse(f"the flush at step {self.client.clock.step} failed: {exc}")
        finally:
            self._syncing = False

    def _refuse(self, why: str) -> NoReturn:
        """Leave the run (no last sync at exit) and end the program with one line."""
        client, self.client, self._due = self.client, None, False
        if client is not None:
            client.leave()
        raise SystemExit(f"weightsync: {why}")

    def _at_exit(self) -> None:
        if os.getpid() != self._pid or self.client is None or self.client.closed:
            return  # (closed: the peer was preempted, and handed in and left already)
        try:
            if session.crashed():
                session.note("the program failed: leaving the run without a last sync")
            elif self.client.clock.unsynced:
                self._sync(final=True)
            else:
                self.client.flush(self.model)
        except SyncError as exc:
            session.note(f"the last sync failed ({exc}): this peer's weights may differ from the others'")
        finally:
            self.client.leave()


def _watch_state_reads(loop: PlainLoop) -> None:
    """``torch.nn.Module.state_dict``, wrapped to tell ``loop`` first (every way of saving a model
    reads it); on the class: a hook on the model would travel with ``torch.save(model)`` and ``deepcopy``."""
    original = torch.nn.Module.state_dict

    @functools.wraps(original)
    def state_dict(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        loop._state_read(self)
        return original(self, *args, **kwargs)

    torch.nn.Module.state_dict = state_dict  # type: ignore[method-assign]


def _watch_saves(loop: PlainLoop) -> None:
    """``torch.save``, wrapped to tell ``loop`` of each module it is given (``torch.save(model)``
    pickles the module: its state is never read, so :func:`_watch_state_reads` would not see it)."""
    original = torch.save

    @functools.wraps(original)
    def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
        held = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
        for thing in (obj, *held):
            if isinstance(thing, torch.nn.Module):
                loop._state_read(thing)
        return original(obj, *args, **kwargs)

    torch.save = save


def _model_of(optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    try:
        return find_model(p for group in optimizer.param_groups for p in group["params"])
    except AmbiguousModel as exc:
        raise SystemExit(f"weightsync: cannot tell which model to sync: {exc}") from None


def _inner(model: Any) -> Any:
    from syncclient.weights import unwrap  # the SDK (torch, numpy), only once the program uses torch

    return unwrap(model)


def _at_main_thread_exit(fn: Any) -> None:
    """Run ``fn`` when the main thread ends, before the interpreter stops its thread pools: a
    sync in an ``atexit`` function would find the SDK's pool closed. ``threading._register_atexit``
    is how ``concurrent.futures`` itself gets that moment; without it (another Python), ``atexit``."""
    import atexit

    getattr(threading, "_register_atexit", atexit.register)(fn)
