"""SyncClient: join a run, sync every few thousand steps, leave.

The client orchestrates: :mod:`syncclient.update` holds the update maths (base, residual, encode,
fold, overlap), :mod:`syncclient.flows` a sync's requests, :mod:`syncclient.transport` the bytes
(retries, resumption, the one map to :mod:`syncclient.exceptions`), :mod:`syncclient.background`
the lease and a samples run's progress, :class:`~syncclient.schedule.SyncClock` when a sync is due.

A sync sends ``encode(local - base + residual)``, waits for the round's merged update ``U`` and
sets the model to ``base + decode(U)``, the very sum the hub computes: every peer and the hub hold
bit-identical weights afterwards. ``sync`` is :meth:`SyncClient.sync_async` (Streaming DiLoCo's
overlap) waited for at once, with no local steps to keep.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from syncclient.background import Heartbeat, ProgressReporter
from syncclient.exceptions import SchemaMismatch, SyncError
from syncclient.flows import Outcome, RunFlows
from syncclient.group import PeerGroup
from syncclient.preemption import LEAVE_MARGIN, Notice, Preempted, Watch, metadata_base, preemption_mode
from syncclient.schedule import SyncClock, SyncEvery
from syncclient.transport import Download, Transport
from syncclient.update import EncodedUpdate, UpdateState
from syncclient.weights import ArrayView, ModelView
from syncwire import Codec, get_codec, layout_bytes, wire_layout
from syncwire.runsettings import AUTO, FLUSH_KEY, PACE_KEYS, RUN_SETTINGS, check_run_settings, paired_interval

__all__ = ["JoinInfo", "PendingSync", "SyncClient", "SyncResult"]

log = logging.getLogger(__name__)

T = TypeVar("T")
FLUSHED = {FLUSH_KEY: 1.0}  # a flush update's metrics: its samples are the final update's, counted once


@dataclass(frozen=True)
class JoinInfo:
    """Where a peer stands after joining."""

    run: str
    peer: str
    rank: int
    world_size: int
    version: int
    codec: str
    outer: str
    config: dict[str, Any]


@dataclass(frozen=True)
class SyncResult:
    """What one sync did. ``caught_up`` means the round closed without this peer's update
    (it was late): the model was brought to the latest version and its local work dropped."""

    version: int
    bytes_up: int
    bytes_down: int
    seconds: float
    upload_seconds: float
    wait_seconds: float
    caught_up: bool = False
    compression: float = 1.0  # float32 bytes / bytes sent
    codec_error: float = 0.0  # ||delta - decoded|| / ||delta|| of what was sent
    # of ``seconds``, the part on the training thread: all of a ``sync``; of a ``sync_async``, the
    # snapshot (the encode runs behind the upload), waiting in ``apply`` and applying
    stall_seconds: float = 0.0
    run_samples: int = -1  # samples all peers had trained by ``version`` (a budget to stop on)


class PendingSync:
    """A sync on its way, from :meth:`SyncClient.sync_async`: ``done()`` says, without blocking,
    whether the merged update is in; ``apply(model)`` (waiting if need be) loads it, keeping the
    steps taken since the snapshot. Apply it exactly once, before the client's next sync."""

    def __init__(
        self,
        client: SyncClient,
        future: Future[Outcome],
        round_: int,
        snapshot: dict[str, np.ndarray] | None,
        started: float,
        stall: float,
        update: EncodedUpdate,
    ) -> None:
        self._client, self._future, self.round = client, future, round_
        self._snapshot = snapshot  # x_t; None: a blocking sync ({}: a catch-up while training goes on)
        self._started, self._stall = started, stall
        self._update = update  # its ratio and error are known once the worker sent it

    def _result(self, outcome: Outcome, version: int, waiting: float) -> SyncResult:
        """What this sync did, applied now at ``version`` (and logged); ``waiting``: when ``apply`` began."""
        done, late = time.monotonic(), outcome.latest is not None
        result = SyncResult(
            version=version,
            bytes_up=outcome.bytes_up,
            bytes_down=outcome.bytes_down,
            seconds=done - self._started,
            upload_seconds=outcome.upload_seconds,
            wait_seconds=outcome.wait_seconds,
            caught_up=late,
            compression=1.0 if late else self._update.ratio,
            codec_error=0.0 if late else self._update.error,
            stall_seconds=self._stall + done - waiting,
            run_samples=outcome.latest.run_samples if outcome.latest is not None else outcome.run_samples,
        )
        run, peer, mb = self._client.run, self._client.peer, (result.bytes_up / 1e6, result.bytes_down / 1e6)
        if late:
            said = "run %s: round %d closed without %s (late); caught up to version %d, local steps dropped"
            log.warning(said, run, self.round, peer, version)
        else:
            said = "run %s: synced to version %d in %.2fs, %.2fs of it on this thread (%.1f MB up, %.1f MB down)"
            log.info(said, run, version, result.seconds, result.stall_seconds, *mb)
        return result

    def done(self) -> bool:
        """Whether ``apply`` would return without waiting for the hub."""
        return self._future.done()

    def apply(self, model: torch.nn.Module) -> SyncResult:
        """Load the merged version plus this peer's steps since the snapshot into ``model``."""
        return self._client._apply(self, ModelView(model))


class SyncClient:
    """One peer's connection to a run on a hub (docs/sdk.md).

    >>> client = SyncClient("http://hub:8000", run="imdb-gpt2", peer="gpu-eu-1")
    >>> client.join(model)            # model now equals the run's latest version
    >>> client.sync(model, samples=256_000, metrics={"loss": 3.1})
    >>> client.leave()

    ``codec`` ... ``max_staleness`` configure the run if this peer creates it and must match an
    existing run's (None: accept it); :data:`syncwire.runsettings.RUN_SETTINGS` says what each means
    and checks it here. ``min_peers`` is also the rendezvous (ranks follow sorted names).
    ``round_samples`` makes a samples run, or with ``policy="async"`` an asynchronous one
    (docs/concepts/rounds.md): report each step with :meth:`progress`, send when :attr:`due` (or
    let :meth:`step` do both). ``sync_every``: optimizer steps between syncs (an int or a
    :class:`~syncclient.schedule.SyncSchedule`), or ``"auto"``: the hub picks each interval,
    keeping ``utilization`` (default 0.95) of the peers' time computing, within
    ``[sync_min, sync_max]`` (docs/concepts/outer.md). ``group``: a torch.distributed process group
    training this peer (:mod:`syncclient.group`): every rank makes the same calls, ``samples``
    its own. ``verify``: True, a CA bundle (PEM file or folder) or an ``ssl.SSLContext``.
    ``retry_seconds``: how long hub trouble is retried before :class:`~syncclient.HubUnreachable`.
    ``preemption``: which notices of the machine's end to act on (``auto``, ``aws``, ``gcp``,
    ``azure``, ``sigterm``, ``off``; default ``WEIGHTSYNC_PREEMPTION`` or ``auto``), at
    ``metadata_url``: on one, the next :meth:`progress` hands in the steps since the last sync,
    leaves and raises :class:`~syncclient.preemption.Preempted` (:mod:`syncclient.preemption`).
    """

    def __init__(
        self,
        hub: str,
        *,
        run: str,
        peer: str | None = None,
        token: str | None = None,
        codec: str | None = None,
        outer: str | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        outer_warmup: int | None = None,
        min_peers: int | None = None,
        min_merge_peers: int | None = None,
        round_timeout: float | None = None,
        norm_guard: float | None = None,
        policy: str | None = None,
        round_samples: int | None = None,
        max_staleness: int | None = None,
        utilization: float | None = None,
        sync_min: int | None = None,
        sync_max: int | None = None,
        sync_every: SyncEvery | None = None,
        verify: bool | str | ssl.SSLContext = True,
        timeout: float = 60.0,
        retry_seconds: float = 600.0,
        group: Any = None,
        preemption: str | None = None,
        metadata_url: str | None = None,
    ) -> None:
        given = locals()  # the run settings' keywords are the table's names
        samples = round_samples is not None and policy != "async"
        sync_every, given["utilization"] = paired_interval(sync_every, utilization, samples=samples)
        self._config = check_run_settings({setting.name: given[setting.name] for setting in RUN_SETTINGS})
        if not hub.startswith(("http://", "https://")):
            raise ValueError(f"hub must be an http:// or https:// URL, got {hub!r}")
        self.hub = hub.rstrip("/")
        self.run = run
        self.peer = peer or f"{socket.gethostname()}-{os.getpid()}"
        self.retry_seconds = retry_seconds
        self.preemption, self._metadata_url = preemption_mode(preemption), metadata_base(metadata_url)
        self.clock = SyncClock(sync_every)
        self._transport = Transport(
            self.hub, run=run, token=token, verify=verify, timeout=timeout, retry_seconds=retry_seconds
        )
        self._runs = f"/v1/runs/{run}"
        # a long poll must end (answered) well before the read timeout, or waiting for a slow
        # round would look like a dead hub: retried with backoff, then HubUnreachable
        self._poll = max(1.0, min(20.0, timeout / 2))
        self._group = PeerGroup(group) if group is not None else None
        self._flows = RunFlows(self._transport, run=run, peer=self.peer, poll=self._poll)
        self.version = -1
        self.run_samples = -1  # samples the run had trained by the last version loaded whole (join, catch-up)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.codec: Codec | None = None
        self._state: UpdateState | None = None  # from the first version loaded on
        self._heartbeat: Heartbeat | None = None  # from join on: the hub knows this peer
        self._worker: ThreadPoolExecutor | None = None  # the one thread a sync's network work runs on
        self._inflight: PendingSync | None = None  # started, not yet applied: the state is the worker's
        # x_t's memory, written by every overlapped sync (ModelView.snapshot) and read until its apply
        self._kept: dict[str, np.ndarray] = {}
        self.policy: str | None = None  # the run's round policy, from join on
        self._progress: ProgressReporter | None = None  # samples runs: tells the hub how far this peer is
        self._unflushed: int | None = None  # the last sync's weight, if an ordinary one: its residual waits
        # the interval under way, for the hub's pick of the next (PACE_KEYS): its start (monotonic)
        # and the training thread's seconds in our work and blocked on the hub
        self._lap_started, self._host, self._waited = time.monotonic(), 0.0, 0.0
        self._model: torch.nn.Module | None = None  # from join on: what a preempted peer hands in
        self._watch: Watch | None = None  # from join on, one process per peer: the machine's end
        self.closed = False  # close() (or leave()) ran: nothing more goes to the hub
        self.preempted = False  # it handed in and left on a notice of the machine's end (Preempted)

    # ---- the public surface --------------------------------------------------------------
    def join(self, model: torch.nn.Module) -> JoinInfo:
        """Join the run and load the global version into ``model``, once the run started
        (``min_peers``). The first peer of a new run uploads ``model`` as version 0."""
        info = self._in_group(model, self._join, JoinInfo)
        self.version, self.rank, self.world_size = info.version, info.rank, info.world_size
        self.policy = info.config.get("policy", "barrier")
        if self._group is not None and self._group.leader:
            self._leave_at_exit()
        elif self._group is None and self._watch is None:
            self._model, self._watch = model, Watch(self.preemption, self._abandon, self._metadata_url)
        return info

    def _join(self, view: ModelView | ArrayView) -> JoinInfo:
        def joined(lease: float) -> None:  # the hub knows us from here on: keep the lease
            if self._heartbeat is None:
                beat = f"{self._runs}/peers/{self.peer}/heartbeat"
                watch = self._transport.sibling()  # its own connection: the one the hub watches
                self._heartbeat = Heartbeat(watch, beat, lease=lease, run=self.run, peer=self.peer)

        def version0() -> list[tuple[str, np.ndarray, str]]:  # if the hub tells us to initialise
            return [(name, a, "F32") for name, a in view.export().items()]

        group_size = {"group_size": self._group.size} if self._group is not None else {}
        state = self._flows.join({**self._config, **group_size}, version0=version0, joined=joined)
        schema = {name: tuple(shape) for name, shape in state["schema"].items()}
        if schema != view.schema:
            self.close()
            raise SchemaMismatch(_schema_diff(schema, view.schema, self.run))
        self.codec = get_codec(state["config"]["codec"])
        # nothing the hub sends is bigger than the float32 model or an encoded update: a body
        # that declares more is refused before anything is allocated
        fp32 = 4 * sum(math.prod(s) for s in schema.values())
        self._transport.max_download = max(fp32, layout_bytes(wire_layout(self.codec, schema)))
        self.rank, self.world_size = int(state["rank"]), int(state["world_size"])
        self._adopt(view, self._flows.latest())
        who = (self.run, self.peer, self.rank, self.world_size, self.version)
        log.info("run %s: joined as %s (rank %d of %d) at version %d", *who)
        config = state["config"]
        self.policy = config.get("policy", "barrier")
        self._check_interval(config)
        if self._progress is None:  # every run: the hub's ledger; samples runs: when the round is due
            self._progress = ProgressReporter(
                self._transport,
                f"{self._runs}/peers/{self.peer}/progress",
                poll=min(0.5, self._poll),
                # a group's leader counts for its ranks (equal batches)
                count=lambda: self.clock.samples * (self._group.size if self._group is not None else 1),
                version=lambda: self.version,
                syncing=lambda: self._inflight is not None,
                run=self.run,
                peer=self.peer,
                listen=self.policy == "samples",
            )
        return JoinInfo(
            self.run, self.peer, self.rank, self.world_size, self.version, config["codec"], config["outer"], config
        )

    def sync(
        self,
        model: torch.nn.Module,
        *,
        samples: int,
        metrics: Mapping[str, float] | None = None,
        final: bool = False,
    ) -> SyncResult:
        """Send what ``model`` learned since the last sync; return with the merged version loaded.

        ``samples`` (examples seen since the last sync) weighs this peer in the average. Blocks
        for the whole round (:meth:`sync_async` overlaps it with training). ``final``: this
        peer's last sync, which the hub merges by plain averaging (a DiLoCo step would overshoot
        with nothing trained after it); in a barrier run of a lossy codec that flushes
        (:attr:`syncwire.Codec.flush`: not ``topk``) one more round then sends the residual
        (docs/concepts/codecs.md, "Error feedback and the final round").
        """
        if self._group is None:
            return self._final_sync(ModelView(model), samples, metrics, final)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples must be an int >= 0 (this rank's), got {samples!r}")
        total = self._group.total(samples)  # the group's update weighs all its ranks' samples
        if not self._group.leader:
            self.clock.sent()  # as the leader's clock does in _start
        result = self._in_group(model, lambda view: self._final_sync(view, total, metrics, final), SyncResult)
        self.version = result.version
        return result

    def _final_sync(
        self, view: ModelView | ArrayView, samples: int, metrics: Mapping[str, float] | None, final: bool
    ) -> SyncResult:
        """A blocking sync; if ``final``, the flush round after it (see :meth:`sync`)."""
        result = self._apply(self._start(view, samples, metrics, keep_local=False, final=final), view)
        if final and self.flushes and not result.caught_up:
            # the model is the merged version now, so this update is the residual alone; it weighs
            # what the update it was cut from weighed
            result = self._apply(self._start(view, samples, FLUSHED, keep_local=False, final=True), view)
        return result

    @property
    def group(self) -> PeerGroup | None:
        """The process group this client serves (None: one process per peer)."""
        return self._group

    @property
    def flushes(self) -> bool:
        """Whether this run's last sync sends its residual in one more round (see :meth:`sync`)."""
        codec = self._state.codec if self._state is not None else None
        return codec is not None and not codec.lossless and codec.flush and self.policy == "barrier"

    def flush(self, model: torch.nn.Module, *, samples: int | None = None) -> SyncResult | None:
        """The second round of a final :meth:`sync`, alone: send the residual as a final update and
        load the merged version. For a program that cannot tell its last sync when it makes it
        (``weightsync-run``'s plain loop flushes at exit if it trained nothing since). ``model``
        must hold the last sync's version; ``samples``: that sync's weight, unless given. None, and
        no round, when nothing waits (see :attr:`flushes`; a last sync final or flushed already).
        One process per peer (a group's last ``sync(final=True)`` flushes)."""
        if self._state is None:
            raise SyncError("join(model) before flush()")
        if self._group is not None:
            raise SyncError("flush() is for one process per peer: in a process group, mark the last sync final")
        if not self.flushes or self._unflushed is None:
            return None
        view = ModelView(model)
        weight = self._unflushed if samples is None else samples
        return self._apply(self._start(view, weight, FLUSHED, keep_local=False, final=True), view)

    def sync_async(
        self, model: torch.nn.Module, *, samples: int, metrics: Mapping[str, float] | None = None
    ) -> PendingSync:
        """Start a sync and return at once, so that training goes on while it travels (overlap).

        Here: snapshot ``model`` as ``x_t`` (one more float32 copy, held until applied) and start
        encoding. On a background thread: upload, wait for the merged update ``U``, fold it in
        (``base' = base + decode(U)``). ``pending.apply(model)`` then sets ``model = base' + (model
        - x_t)``: the steps since the snapshot count in the next round. One sync at a time:
        ``sync``, ``sync_async`` or ``pull`` before ``apply`` raises :class:`SyncError` (waiting
        would hide a forgotten ``apply``). A late peer's ``apply`` drops all local work since the
        last sync, as ``sync`` catches up.
        """
        if self._group is not None:
            raise SyncError("sync_async() with a process group is not supported: use sync() (see syncclient.group)")
        return self._start(ModelView(model), samples, metrics, keep_local=True)

    def progress(self, samples: int, *, step: int | None = None) -> None:
        """After each optimizer step: count it and the ``samples`` it trained (no I/O; a background
        thread reports the count, for the hub's samples ledger and a samples run's round). ``step``:
        the global step reached (a Trainer's); None: one more than the last. Then :attr:`due` says
        whether to sync."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples must be an int >= 0, got {samples!r}")
        self.clock.tick(samples, step)
        if self._watch is not None and (self._watch.abandoned or self._watch.notice is not None):
            self._hand_in(self._watch)

    @property
    def due(self) -> bool:
        """Whether to sync now: in a samples run, the hub asked for this round's update and a step
        was trained since the last sync; else the :attr:`clock` reached ``sync_every``'s next
        step. In a process group every rank asks at the same points, and in samples and auto runs
        the leader's answer goes to all (its client alone hears the hub)."""
        if self.policy == "samples":
            due = self.clock.unsynced and self._progress is not None and self._progress.due(self.version)
        elif self.clock.every == AUTO:  # the leader's clock hears the hub's intervals
            due = self.clock.on_time
        else:
            return self.clock.on_time
        return self._group.flag(due) if self._group is not None else due

    @property
    def pending_samples(self) -> int:
        """Samples counted with :meth:`progress` since the last sync began (this process's)."""
        return self.clock.samples

    def count_from(self, step: int) -> None:
        """Count steps from global optimizer ``step`` (a Trainer starting there, maybe resumed);
        :class:`SyncError` when nothing says when this run syncs."""
        self._check_clock()
        self.clock.start(step)
        self._lap_started, self._host, self._waited = time.monotonic(), 0.0, 0.0

    def step(
        self, model: torch.nn.Module, *, samples: int, metrics: Mapping[str, float] | None = None
    ) -> SyncResult | None:
        """After each optimizer step (torchft's post-step hook): count ``samples`` and, when
        :attr:`due`, sync what was counted since the last sync; its result, or None.

        >>> for batch in loader:
        ...     train_step(batch)
        ...     client.step(model, samples=len(batch))
        """
        self._check_clock()
        self.progress(samples)
        return self.sync(model, samples=max(1, self.pending_samples), metrics=metrics) if self.due else None

    def pull(self, model: torch.nn.Module) -> int:
        """Load the run's latest version into ``model`` (dropping local changes); return it."""
        if self.version < 0:
            raise SyncError("join(model) before pull()")
        self._check_idle()

        def call(view: ModelView | ArrayView) -> int:
            self._adopt(view, self._flows.latest())
            return self.version

        self.version = self._in_group(model, call, int)
        return self.version

    def status(self) -> dict[str, Any]:
        """The run's state as the hub sees it (peers, open round, recent rounds)."""
        if self._group is not None and not self._group.leader:
            raise SyncError("status() asks the hub, and only rank 0 of a process group talks to it")
        result: dict[str, Any] = self._transport.call("GET", self._runs).json()
        return result

    def leave(self, *, retry: bool = True) -> None:
        """Tell the hub this peer is done (it stops waiting for it), then close (in a process group
        rank 0 tells it). ``retry=False``: one quick try (a process going away)."""
        if self._heartbeat is not None:
            try:
                quick: dict[str, Any] = {} if retry else {"timeout": 5}
                self._transport.call("POST", f"{self._runs}/peers/{self.peer}/leave", retry=retry, **quick)
            except SyncError as exc:
                log.warning("run %s: leaving failed (%s); the hub will drop us when our lease expires", self.run, exc)
        self.close()

    def close(self) -> None:
        """Stop the heartbeat and close connections (without leaving the run)."""
        if self._inflight is not None and not self._inflight.done():
            log.warning(
                "run %s: closing with the sync of round %d in flight, never applied", self.run, self._inflight.round
            )
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
        for daemon in (self._heartbeat, self._progress, self._watch):
            if daemon is not None:
                daemon.stop()
        self._heartbeat = self._progress = self._watch = None
        self.closed = True
        atexit.unregister(self.leave)
        self._transport.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # ---- internals -----------------------------------------------------------------------
    def _in_group(self, model: torch.nn.Module, call: Callable[[Any], T], kind: type[T]) -> T:
        """``call(view)`` on this process's model, or in a process group on the leader for every rank."""
        if self._group is None:
            return call(ModelView(model))
        return self._group.run(model, lambda arrays: call(ArrayView(arrays)), kind)

    def _leave_at_exit(self) -> None:
        """A group's leader leaves the run when its process ends, SIGTERM included: torchrun
        stops every rank of a group that lost one, and the other peers must not wait for it."""
        atexit.register(self.leave, retry=False)  # (left or closed already: nothing to tell)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def _hand_in(self, watch: Watch) -> None:
        """The machine is being taken (:mod:`syncclient.preemption`): send the steps since the last
        sync as this peer's update of the open round, wait for its acknowledgement while the notice
        lasts, leave (the round closes without us), and end the program with :class:`Preempted`."""
        notice, handed, round_ = watch.claim(), 0, self.version
        self.preempted = True
        if notice is None:  # the watch left for us: the notice ran out before this step
            assert watch.notice is not None
            self.close()
            raise Preempted(watch.notice, 0, round_)
        assert self._model is not None  # (a watch is made at join, with the model)
        view = ModelView(self._model)
        try:
            inflight = self._inflight  # an overlapped sync: the steps since its snapshot need its result
            if inflight is not None and wait([inflight._future], timeout=_time_left(notice)).done:
                self._apply(inflight, view)
            handed, round_ = self._send_last(view, notice)
        except (SyncError, TimeoutError) as exc:
            log.warning("run %s: the hand-in failed (%s): the steps since the last sync are lost", self.run, exc)
        finally:
            self.leave(retry=False)
            self._transport.abort()  # an upload the notice cut short ends now
        log.warning("run %s: %s", self.run, Preempted(notice, handed, round_))
        raise Preempted(notice, handed, round_)

    def _send_last(self, view: ModelView, notice: Notice) -> tuple[int, int]:
        """Upload the steps since the last sync as a final update, acknowledged before ``notice``
        runs out: (samples acknowledged, round); (0, version) when nothing can go."""
        state = self._state
        if self._inflight is not None or state is None or state.torn or not self.clock.unsynced:
            return 0, self.version  # still in flight, no base to compute a delta from, or nothing new
        samples, round_ = max(1, self.clock.samples), self.version
        metrics = {"step": float(self.clock.step)} | self._lap(time.monotonic(), samples, False)
        update = state.encode(view.export())
        self.clock.sent()
        future = self._submit(self._flows.hand_in, round_, update, samples, metrics, state, True)
        landed = future.result(timeout=_time_left(notice))
        return (samples, landed) if landed is not None else (0, round_)

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on the one thread a sync's network work runs on (made on first use)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"weightsync-sync-{self.peer}")
        return self._worker.submit(fn, *args)

    def _abandon(self) -> None:
        """The notice runs out and the training thread never stepped: tell the hub we leave (the
        watch's thread; the training thread closes the client at its next step)."""
        if self._heartbeat is not None:
            with contextlib.suppress(SyncError):
                self._transport.call("POST", f"{self._runs}/peers/{self.peer}/leave", retry=False, timeout=5)

    def _check_clock(self) -> None:
        if self.policy != "samples" and self.clock.every is None:
            raise SyncError(
                f"run {self.run!r} is a {self.policy} run, whose rounds do not close on samples: "
                "give sync_every=N (optimizer steps between syncs)"
            )

    def _check_interval(self, config: Mapping[str, Any]) -> None:
        """A run that picks its interval and a peer that keeps its own (or the other way) would sync
        at different steps: refused at join, in one line."""
        picks, auto = config.get("utilization") is not None, self.clock.every == AUTO
        if self.policy == "barrier" and picks != auto:
            self.leave(retry=False)
            if picks:
                raise SyncError(f"run {self.run!r} picks its interval (utilization {config['utilization']}): "
                                "give sync_every='auto'")  # fmt: skip
            raise SyncError(f"run {self.run!r} has its peers pick their interval: give sync_every=N, not 'auto'")

    def _check_idle(self) -> None:
        if self._inflight is not None:
            raise SyncError(
                f"the sync of round {self._inflight.round} is in flight: apply it (pending.apply(model)) first"
            )

    def _start(
        self,
        view: ModelView | ArrayView,
        samples: int,
        metrics: Mapping[str, float] | None,
        *,
        keep_local: bool,
        final: bool = False,
    ) -> PendingSync:
        """The caller's half of a sync: snapshot, encode, hand the network work to the worker."""
        if self._state is None:
            raise SyncError("join(model) before sync()")
        self._check_idle()
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive int, got {samples!r}")
        started = time.monotonic()
        if self._progress is not None:
            self._progress.pause()  # (before the count starts afresh: the reporter never sends the 0)
        pace = self._lap(started, samples, keep_local)
        self.clock.sent()
        self._unflushed = None if final else samples
        if self._state.torn:  # the last result stopped arriving midway: no delta from this base
            log.warning("run %s: the last result did not arrive whole; catching up to the latest version", self.run)
            future = self._submit(self._flows.catch_up)
            nothing = EncodedUpdate([], [], 0, lambda: None)
            self._inflight = PendingSync(self, future, self.version, {} if keep_local else None, started, 0.0, nothing)
            return self._inflight
        snapshot = None
        if keep_local:  # x_t: training goes on, so the encode reads a copy (sync_async: a ModelView)
            assert isinstance(view, ModelView)
            snapshot = view.snapshot(self._kept)
        # encodes while it uploads, on other threads; a blocking sync's export shares the model's memory on CPU
        update = self._state.encode(view.export() if snapshot is None else snapshot)
        sent_metrics = {k: float(v) for k, v in (metrics or {}).items() if math.isfinite(float(v))} | pace
        future = self._submit(self._flows.exchange, self.version, update, samples, sent_metrics, self._state, final)
        stall = time.monotonic() - started
        self._host += stall  # the next interval's: it starts with this snapshot
        self._inflight = PendingSync(self, future, self.version, snapshot, started, stall, update)
        return self._inflight

    def _lap(self, started: float, samples: int, overlap: bool) -> dict[str, float]:
        """The interval a sync starting now ends (PACE_KEYS: the hub picks the next from it); the
        next one starts."""
        steps, seconds = self.clock.step - self.clock.last, started - self._lap_started
        figures = (steps, samples, seconds, self._host, self._waited, overlap)
        self._lap_started, self._host, self._waited = started, 0.0, 0.0
        return {key: round(float(value), 4) for key, value in zip(PACE_KEYS, figures, strict=True)}

    def _apply(self, pending: PendingSync, view: ModelView | ArrayView) -> SyncResult:
        """Wait for the worker, then load ``base'`` (blocking) or ``base' + (model - x_t)`` (overlap),
        or catch up when late."""
        if self._inflight is not pending:
            raise SyncError(f"the sync of round {pending.round} was applied already")
        waiting = time.monotonic()
        try:
            outcome = pending._future.result()
        except BaseException:
            if pending._future.done():  # it failed: the next sync may try again (interrupted: not)
                self._inflight = None
            raise
        self._inflight = None
        got = time.monotonic()
        self._waited += got - waiting
        snapshot, pending._snapshot = pending._snapshot, None
        if outcome.latest is not None:
            self._adopt(view, outcome.latest)
            if snapshot is not None:  # the steps trained meanwhile were dropped too: count from here
                self.clock.start(self.clock.step)
        else:
            assert self._state is not None
            if outcome.fresh_base is not None:
                self._state.base = _tensors(view, outcome.fresh_base, self.run)  # the residual stays: it was not sent
            if snapshot is None:
                view.load(self._state.base)
            else:  # (overlap: sync_async, or the hand-in's apply, both with a ModelView)
                assert isinstance(view, ModelView)
                view.rebase(self._state.base, snapshot)
            self.version = outcome.version
            self.clock.told(outcome.next_every)
        self._host += time.monotonic() - got
        return pending._result(outcome, self.version, waiting)

    def _adopt(self, view: ModelView | ArrayView, download: Download) -> None:
        """Make a downloaded full model the base and load it (local work is dropped)."""
        assert self.codec is not None
        # a new state: the residual belonged to work that was just dropped
        self._state, self._unflushed = UpdateState(self.codec, _tensors(view, download, self.run)), None
        view.load(self._state.base)
        self.version, self.run_samples = download.version, download.run_samples
        self.clock.told(download.next_every)


def _tensors(view: ModelView | ArrayView, download: Download, run: str) -> dict[str, np.ndarray]:
    """A downloaded full model's tensors, in the model's order (which must be the run's)."""
    reader = download.reader
    if set(reader.tensors) != set(view.schema):
        raise SchemaMismatch(_schema_diff({k: v.shape for k, v in reader.tensors.items()}, view.schema, run))
    return {name: reader.tensors[name] for name in view.schema}


def _time_left(notice: Notice) -> float:
    return max(0.0, notice.left() - LEAVE_MARGIN)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwind, so that atexit handlers (leaving the run) run


def _schema_diff(run: Mapping[str, tuple[int, ...]], model: Mapping[str, tuple[int, ...]], name: str) -> str:
    shapes = {k for k in run.keys() & model.keys() if tuple(run[k]) != tuple(model[k])}
    found = {"missing": run.keys() - model.keys(), "unexpected": model.keys() - run.keys(), "shape differs for": shapes}
    parts = [f"{what} {sorted(names)[:3]}" for what, names in found.items() if names]
    return f"the model does not match run {name!r}: " + "; ".join(parts)
