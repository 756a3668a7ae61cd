"""The runs of one hub: their life, their members, and the waits peers make on them.

No HTTP (routes translate), no maths (:mod:`syncserver.reduce.engine`), no round rule
(:mod:`~syncserver.core.policy` decides, :mod:`~syncserver.core.rounds` receives and closes), no
paths (:mod:`syncserver.storage.store`). Everything runs on the event loop thread, so state changes
between two ``await`` points are atomic; tensor work goes to worker threads. A run's life::

    created ──(first peer initialises)──> version 0 ──(min_peers joined)──> sealed: ranks fixed
    round v: open ──(first update)──> collecting ──(the policy says Close)──> closing
             ──(result durable, sqlite commit)──> version v+1 = round v+1 open
             └──(then, in the background)──> version v+1's file written
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from anyio import to_thread

from syncserver.core.changes import until
from syncserver.core.ledger import Account
from syncserver.core.planes import LocalPlane, Redirect
from syncserver.core.presigned import PresignedUploads
from syncserver.core.quotas import check_new_peer, check_new_run
from syncserver.core.rounds import InitialVersion, Rounds, Ticket
from syncserver.core.shape import RunShape
from syncserver.core.state import Peer, Run, RunConfig, Via, now
from syncserver.core.view import HubView
from syncserver.core.workers import Workers
from syncserver.errors import Conflict, Gone, InvalidUpdate, NotFound
from syncserver.settings import HubSettings
from syncserver.storage.store import Blob, Missing, ResultKey, Store, VersionKey
from syncserver.storage.uploads import Received
from syncwire import get_codec
from syncwire.runsettings import RUN_SETTINGS, settle

__all__ = ["Coordinator", "RoundProgress", "Start"]

log = logging.getLogger(__name__)

DOWNLOADS_KEPT = 64  # rounds whose result download spans are remembered (the dashboard's timeline)


@dataclass(frozen=True)
class Start:
    """What a peer must do next: ``initialise`` (upload version 0), ``waiting`` (ask again) or ``ready``."""

    state: Literal["initialise", "waiting", "ready"]
    run: str
    peer: str
    lease_seconds: float
    config: RunConfig | None = None  # initialise and ready
    detail: str = ""  # waiting
    rank: int | None = None  # ready (None: left before the run started and came back after)
    world_size: int = 0  # ready
    version: int = -1  # ready
    shape: RunShape | None = None  # ready: the run's schema, made once
    uploads: Literal["hub", "store"] = "hub"  # ready: where updates go (store: presign, then PUT the parts there)


@dataclass(frozen=True)
class RoundProgress:
    """Where the open round stands after a progress report (``due``: send your update now)."""

    round: int
    version: int  # the run's latest (above round: that round closed)
    due: bool
    samples: int  # of the open round so far
    target: int | None  # round_samples in a samples run


class Coordinator:
    """All runs of one hub."""

    def __init__(self, settings: HubSettings, store: Store, plane: LocalPlane, workers: Workers) -> None:
        self.settings = settings
        self.store = store
        self.plane = plane  # where the bytes live
        self.workers = workers  # who does the tensor work
        self.board = workers.board  # the reducers' leases, for their routes
        self.runs: dict[str, Run] = {}
        self.view = HubView(self.runs, store, settings.lease_seconds, plane, workers)
        self.rounds = Rounds(settings, store, self.view, plane, workers)
        self.presigned = PresignedUploads(self.rounds, plane, settings.data_dir / "tmp", workers)
        self._ticker: asyncio.Task[None] | None = None

    # ---- life ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Load every run from disk, drop what a crash left half-done, start the ticker."""
        self.store.clear_tmp()
        for record in self.store.runs():
            config = RunConfig.load(record.config)
            policy = config.make_policy(self.settings.lease_seconds, self.settings.disconnect_grace, record.version)
            run = Run(record.name, config, get_codec(config.codec), policy, record.version)
            run.schema, run.sealed, run.creator = record.schema, record.sealed, record.creator
            if run.schema is not None:
                run.shape = await to_thread.run_sync(RunShape.of, run.schema, run.codec, self.settings.max_body_bytes)
            self.store.recover(run.name, run.version)
            await self.plane.recover(run)
            for p in self.store.peers(run.name):
                # every peer gets a fresh lease: they ride through the restart on retries
                run.peers[p.name] = Peer(p.name, p.rank, p.joined, p.group_size)
                run.policy.restore(
                    p.name, active_from=p.active_from, counted=p.rank is not None, left=p.left, now=now()
                )
            booked = self.store.ledger(run.name)
            run.ledger.load({p: Account(acked, lost, base) for p, (acked, lost, base) in booked.items()})
            self.runs[run.name] = run
            self.rounds.recover(run)
            log.info("run_recovered run=%s version=%d pending=%d", run.name, run.version, len(run.acked))
        self._ticker = asyncio.create_task(self._tick_forever())

    def end_polls(self) -> None:
        """The server is shutting down: every long poll answers now, as at its deadline (a poll would
        hold a restart ``long_poll_seconds``); the clients ask again and find the hub gone or back."""
        self.view.stopping = True
        for run in self.runs.values():
            run.changed.notify()
        self.view.changed()
        self.workers.end_polls()

    async def stop(self) -> None:
        if self._ticker:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        await self.rounds.tasks.stop()
        await self.workers.stop()

    async def _tick_forever(self) -> None:
        """Tick often and at each live lease's end: a hung peer costs its lease, not a tick more (bench/failures.py)."""
        interval = min(0.5, self.settings.lease_seconds / 4)
        while True:
            ends = (run.policy.next_loss() for run in list(self.runs.values()))
            wake = min((end for end in ends if end is not None), default=now() + interval)
            # just past the end: a lease is lost once it is strictly older than lease_seconds
            await asyncio.sleep(min(interval, max(0.0, wake - now()) + 0.005))
            for run in list(self.runs.values()):
                self._tick(run)

    def _tick(self, run: Run) -> None:
        """Leases, dropped watches and deadlines: the only things that change with time alone."""
        if gone := run.policy.expire(now()):
            for name, why in gone.items():
                log.warning("peer_gone run=%s peer=%s reason=%s", run.name, name, why.value)
            if run.init_claim in gone:
                log.warning("initialiser_gone run=%s peer=%s", run.name, run.init_claim)
                run.init_claim = None
            self.view.changed(run)
        self.rounds.decide(run)

    def run(self, name: str) -> Run:
        return self.view.get(name)

    def seen(self, run_name: str, peer_name: str) -> Run:
        """A request from ``peer_name`` begins: its run, the peer's lease renewed."""
        run = self.run(run_name)
        self.peer(run, peer_name)
        return run

    def peer(self, run: Run, name: str) -> Peer:
        """The peer, its lease renewed (a long poll looks again with :meth:`member`: that renews nothing)."""
        peer = self.member(run, name)
        if run.policy.seen(name, now()):
            log.info("peer_back run=%s peer=%s", run.name, name)
        return peer

    def member(self, run: Run, name: str) -> Peer:
        """The peer, a member of the run that has not left; its lease untouched."""
        peer = run.peers.get(name)
        if peer is None or run.policy.members[name].left:
            raise NotFound(f"peer {name!r} is not a member of run {run.name!r}; join first", run=run.name)
        return peer

    # ---- joining -------------------------------------------------------------------------
    def join(
        self, run_name: str, peer_name: str, requested: dict[str, Any], *, group_size: int = 1, creator: str = "token"
    ) -> Start:
        """Register a peer (again after a crash: same name, same rank); what it must do next.
        ``group_size``: its torch group's ranks (shown); ``creator``: the token's kind, for quotas."""
        run = self.runs.get(run_name)
        if run is None:
            min_peers = requested.get("min_peers") or self.settings.min_peers
            check_new_run(self.runs.values(), creator, min_peers, self.settings)
            run = self._create(run_name, requested, creator)
        else:
            for key, value in requested.items():
                if value is not None and _configured(run, key) != value:
                    raise Conflict(
                        f"run {run_name!r} uses {key}={_configured(run, key)!r}; this peer asked for {value!r}",
                        config=run.config.__dict__,
                    )
            check_new_peer(run, peer_name, self.settings)
        admit = run.policy.join(peer_name, now(), counted=run.sealed)
        peer = run.peers.setdefault(peer_name, Peer(peer_name, run.world_size() if run.sealed else None, time.time()))
        peer.group_size = group_size
        joined = "peer_rejoined" if admit.returning else "peer_joined"
        log.info("%s run=%s peer=%s rank=%s", joined, run_name, peer_name, peer.rank)
        self._save_forfeiting(run, peer)
        self._maybe_seal(run)
        self.view.changed(run)
        return self._start_state(run, peer)

    def _save_forfeiting(self, run: Run, peer: Peer) -> None:
        """Save a peer that joins (again) or leaves, with the samples it reported and did not deliver:
        a new process (or none) takes over, and they are lost (the ledger's rule)."""
        loss = run.ledger.forfeit(peer.name)
        self.store.save_peer(run.name, run.record(peer), lost=loss)
        run.ledger.forfeited(peer.name, loss)
        if loss is not None:
            said = "samples_lost run=%s round=%d peer=%s samples=%d (it joined again or left)"
            log.warning(said, run.name, loss.round, loss.peer, loss.samples)

    def _create(self, name: str, requested: dict[str, Any], creator: str) -> Run:
        chosen = {k: v for k, v in requested.items() if v is not None}
        try:
            defaults = {s.name: getattr(self.settings, s.name) for s in RUN_SETTINGS}
            config = RunConfig(**settle({**defaults, **chosen}, chosen))
            codec = get_codec(config.codec)
            policy = config.make_policy(self.settings.lease_seconds, self.settings.disconnect_grace, -1)
        except ValueError as exc:
            raise InvalidUpdate(str(exc)) from None
        self.store.create_run(name, config.__dict__, creator)
        run = self.runs[name] = Run(name, config, codec, policy, creator=creator)
        log.info("run_created run=%s %s", name, " ".join(f"{k}={v}" for k, v in config.__dict__.items()))
        return run

    def _maybe_seal(self, run: Run) -> None:
        """Fix ranks by sorted name (shards not by who joined first) once v0 and min_peers are in."""
        members = sorted(name for name, m in run.policy.members.items() if not m.left)
        if run.sealed or run.version < 0 or len(members) < run.config.min_peers:
            return
        ranks = {name: rank for rank, name in enumerate(members)}
        self.store.seal(run.name, ranks)
        for name, rank in ranks.items():
            run.peers[name].rank = rank
        run.policy.seal(members)
        run.sealed = True
        log.info("run_started run=%s peers=%d members=%s", run.name, len(members), ",".join(members))
        self.view.changed(run)

    def _start_state(self, run: Run, peer: Peer) -> Start:
        start = functools.partial(Start, run=run.name, peer=peer.name, lease_seconds=self.settings.lease_seconds)
        if run.version < 0:
            if run.init_claim is None or run.init_claim not in run.policy.live:
                run.init_claim = peer.name
            if run.init_claim == peer.name:
                return start("initialise", config=run.config)
            return start("waiting", detail=f"waiting for {run.init_claim} to upload version 0")
        if not run.sealed:
            joined = sum(not m.left for m in run.policy.members.values())
            return start("waiting", detail=f"{joined} of {run.config.min_peers} peers have joined")
        assert run.shape is not None
        return start(
            "ready",
            config=run.config,
            rank=peer.rank,
            world_size=run.world_size(),
            version=run.version,
            shape=run.shape,
            uploads=self.plane.uploads,
        )

    async def _wait(
        self, ready: Callable[[], bool], run: Run, wait: float, also: asyncio.Future[Any] | None = None
    ) -> bool:
        """A long poll on ``run``: at most what the client asked and ``SYNC_LONG_POLL_SECONDS``."""
        seconds = min(wait, self.settings.long_poll_seconds)
        return await until(ready, run.changed, seconds, lambda: self.view.stopping, also)

    async def wait_start(self, run_name: str, peer_name: str, wait: float) -> Start:
        """Long poll until the peer may start (or must initialise); at most ``wait`` seconds."""
        run = self.seen(run_name, peer_name)

        def state() -> Start:
            return self._start_state(run, self.member(run, peer_name))

        await self._wait(lambda: state().state != "waiting", run, wait)
        return state()

    async def commit_init(self, ticket: Ticket, received: Received) -> InitialVersion:
        """Version 0 is in (:meth:`Rounds.init_ticket` let it come): the run's schema, and maybe its start."""
        run = self.run(ticket.run)
        # O(schema): in a worker thread, so that a run of 100,000 tensors stalls no other run
        shape = await to_thread.run_sync(RunShape.of_infos, received.infos, run.codec, self.settings.max_body_bytes)
        ack = self.rounds.commit_init(run, ticket, received, shape)
        self._maybe_seal(run)
        self.view.changed(run)
        return ack

    # ---- progress and liveness -------------------------------------------------------------
    async def progress(self, run_name: str, peer_name: str, round_: int, samples: int, wait: float) -> RoundProgress:
        """A peer trained ``samples`` since its update to round ``round_`` began (a heartbeat too). In
        a samples run, a long poll until the round is due or closed: ``due``, send the update now."""
        run = self.run(run_name)
        peer = self.peer(run, peer_name)
        await self.rounds.check_open(run, round_)
        peer.observe(round_, samples, time.monotonic())
        run.ledger.report(peer_name, round_, samples)
        was_due = run.policy.due
        self.rounds.carry_out(run, run.policy.progress(peer_name, samples, now()))
        if run.policy.due != was_due:
            log.info("round_due run=%s round=%d samples=%d", run.name, run.version, run.policy.round_total())
            self.view.changed(run)
        samples = run.config.policy == "samples"
        await self._wait(lambda: not samples or run.policy.due or run.version != round_, run, wait)
        due = run.policy.due or (run.version > round_ and run.config.policy != "async")  # or closed
        target = run.config.round_samples if samples else None
        return RoundProgress(round_, run.version, due, run.policy.round_total(), target)

    async def heartbeat(
        self, run_name: str, peer_name: str, wait: float = 0.0, dropped: Awaitable[object] | None = None
    ) -> int:
        """Renew the peer's lease; the run's version. With ``dropped`` (done once the peer closes the
        connection) it is its *watch*, held until news or ``wait`` (a third of the lease at most)."""
        run = self.seen(run_name, peer_name)
        if wait <= 0 or dropped is None:
            return run.version
        run.policy.watch(peer_name, now())
        lost = asyncio.ensure_future(dropped)
        try:
            seconds = min(wait, self.settings.lease_seconds / 3)
            await self._wait(lambda: lost.done() or run.policy.members[peer_name].left, run, seconds, lost)
        finally:
            closed = lost.done()
            lost.cancel()
            run.policy.unwatch(peer_name, now(), dropped=closed)
        if closed:
            grace = self.settings.disconnect_grace
            log.info("peer_disconnected run=%s peer=%s (gone in %gs unless it comes back)", run.name, peer_name, grace)
            # decide at the grace's end, not at the next tick: the survivors wait for this
            asyncio.get_running_loop().call_later(grace + 0.01, self._tick, run)
        return run.version

    def leave(self, run_name: str, peer_name: str) -> None:
        run = self.run(run_name)
        peer = self.peer(run, peer_name)
        close = run.policy.leave(peer_name, now())
        self._save_forfeiting(run, peer)
        log.info("peer_left run=%s peer=%s", run.name, peer_name)
        self.view.changed(run)
        self.rounds.carry_out(run, close)

    # ---- results and models --------------------------------------------------------------
    async def wait_result(
        self, run_name: str, round_: int, peer_name: str | None, wait: float, *, direct: bool = False
    ) -> Blob | Redirect | None:
        """Long poll for round ``round_``'s result: where the plane serves it, or None if still open."""
        run = self.run(run_name)
        if peer_name is not None:
            self.peer(run, peer_name)

        def ended() -> bool:
            if peer_name is not None:
                self.member(run, peer_name)  # a peer gone meanwhile stops waiting
            return round_ != run.version or run.version < 0

        if not await self._wait(ended, run, wait):
            return None
        if round_ > run.version or run.version < 0:
            raise Conflict(
                f"round {round_} is not open; the run is at version {run.version}", current_version=run.version
            )
        try:
            return await self.plane.serve(run, ResultKey(run.name, round_), direct=direct, peer=peer_name)
        except Missing:
            raise Gone(f"round {round_}'s result was pruned; pull the model", current_version=run.version) from None

    async def model(
        self, run_name: str, *, direct: bool = False, peer_name: str | None = None
    ) -> tuple[int, Blob | Redirect]:
        """The run's current version and where the plane serves it from, once it is built."""
        run = self.run(run_name)
        if run.version < 0:
            raise Conflict(f"run {run_name!r} has no version 0 yet", current_version=-1)
        while True:
            key = VersionKey(run.name, run.version)
            try:
                return key.number, await self.plane.serve(run, key, direct=direct, peer=peer_name)
            except Missing:
                await self.workers.written(run)

    # ---- downloads (the dashboard's timeline, the metrics) ---------------------------------
    def count_download(self, run_name: str, peer_name: str | None, nbytes: int, via: Via) -> None:
        """A download answered: ``nbytes`` served by the hub, or redirected to the store."""
        if (run := self.runs.get(run_name)) is None:
            return
        run.traffic.down[via] += nbytes
        if peer_name in run.peers:
            run.peers[peer_name].bytes_down += nbytes

    def record_download(self, run_name: str, round_: int, peer_name: str | None, began: float) -> None:
        """A peer has round ``round_``'s whole result: its round's last phase, for timeline and metrics."""
        if (run := self.runs.get(run_name)) is None or peer_name is None or peer_name not in run.peers:
            return
        ended = time.time()
        run.downloads.setdefault(round_, {})[peer_name] = (began, ended)
        while len(run.downloads) > DOWNLOADS_KEPT:
            del run.downloads[min(run.downloads)]
        self.view.downloaded(run, round_, peer_name, ended - began)

    def downloaded(self, run_name: str, peer_name: str, round_: int, seconds: float) -> None:
        """A peer fetched round ``round_``'s result from the store in ``seconds`` (the hub sees no end)."""
        run = self.seen(run_name, peer_name)
        if not 0 <= round_ < run.version:
            raise Conflict(f"round {round_} has no result yet; the run is at version {run.version}")
        self.record_download(run_name, round_, peer_name, time.time() - seconds)


def _configured(run: Run, key: str) -> Any:
    """A run's setting as a join compares it (the codec in its one spelling: older runs kept it as given)."""
    return run.codec.spec if key == "codec" else getattr(run.config, key)
