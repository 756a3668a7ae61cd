"""The round state machine of every run: membership, leases, deadlines, folding, publishing.

No HTTP here (routes translate requests into these calls) and no maths (that is
:mod:`syncserver.aggregate`). Everything runs on the event loop thread, so state changes
between two ``await`` points are atomic; tensor work goes to worker threads.

A run's life::

    created ──(first peer initialises)──> version 0 ──(min_peers joined)──> sealed: ranks fixed
    round v: open ──(first update)──> collecting ──(all live peers in, or deadline with
             ≥ min_peers)──> closing ──(result fsynced, sqlite commit)──> version v+1 = round v+1 open
                                        └──(then, in the background)──> version v+1's file written

An update is acknowledged once its file is complete, verified, fsynced and recorded in
sqlite; it is then folded into the round's float32 accumulator in acknowledgement order
(so a hub restarted after a crash rebuilds the very same sums from the files). A round
commits once its result (the encoded merged update) is durable; the file of version v+1 is
written after that, since it is ``version v + decode(result)``: a restarted hub rebuilds
what a crash left unwritten, and pulls wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
from anyio import to_thread

from syncserver import aggregate
from syncserver.errors import BadRequest, Conflict, Gone, InvalidUpdate, NotFound, PoisonedUpdate, RoundClosed
from syncserver.settings import HubSettings
from syncserver.store import PeerRecord, RoundRecord, Store, UpdateRecord, atomic_file, publish_file
from syncserver.uploads import Received, disk_error
from syncserver.writeback import start_writeback
from syncwire import (
    Codec,
    FormatError,
    Schema,
    TensorInfo,
    check_layout,
    get_codec,
    layout_bytes,
    wire_layout,
    wire_name,
)
from syncwire.codecs import slices
from syncwire.format import MAX_HEADER_BYTES, TensorFile, encode_header

__all__ = ["Coordinator", "PeerState", "RunConfig", "Ticket"]

log = logging.getLogger(__name__)

CONFIG_FIELDS = ("codec", "outer", "outer_lr", "outer_momentum", "min_peers", "round_timeout", "norm_guard")
MAX_SAMPLES = 2**53  # an update's weight: exact as a float, and it fits sqlite's INTEGER
HEADER_SLACK = 64 * 1024  # bytes an update's safetensors header may exceed twice the run's own
SLICE_THREADS = min(4, os.cpu_count() or 1)  # threads that fold and merge (see _each_slice)
DOWNLOADS_KEPT = 64  # rounds whose result download spans are remembered (the dashboard's timeline)


class PeerState(str, Enum):
    LIVE = "live"  # lease fresh: waited for in rounds it takes part in
    LATE = "late"  # lease fresh, but its round closed without it: it is catching up
    GONE = "gone"  # lease expired: not waited for; its next request brings it back
    LEFT = "left"  # said goodbye; joining again brings it back


@dataclass
class RunConfig:
    """What a run is, fixed at creation (the first peer may choose; later peers must agree)."""

    codec: str
    outer: str
    outer_lr: float
    outer_momentum: float
    min_peers: int
    round_timeout: float
    # refuse an update whose norm is over norm_guard x the median of accepted ones; None: off
    # (a default, so that runs created before the guard existed load as they were)
    norm_guard: float | None = None


@dataclass
class Peer:
    name: str
    rank: int | None
    active_from: int  # first round this peer is waited for
    joined: float
    left: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    last_round: int = -1  # last round it submitted to
    samples: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rate: float = 0.0  # samples/s between its last two updates
    last_update_at: float | None = None

    def live(self, now: float, lease: float) -> bool:
        return not self.left and now - self.last_seen <= lease

    def record(self) -> PeerRecord:
        return PeerRecord(self.name, self.rank, self.active_from, self.joined, self.left)


@dataclass
class Run:
    name: str
    config: RunConfig
    codec: Codec
    version: int = -1
    schema: Schema | None = None
    sealed: bool = False
    peers: dict[str, Peer] = field(default_factory=dict)
    init_claim: str | None = None
    # the open round (number == version)
    acked: dict[str, UpdateRecord] = field(default_factory=dict)
    uploading: dict[str, float] = field(default_factory=dict)
    opened: float | None = None  # wall time of its first acknowledged update
    deadline: float | None = None  # monotonic
    closing: bool = False
    acc: dict[str, np.ndarray] | None = None
    folded: list[str] = field(default_factory=list)
    fold_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    live_set: frozenset[str] = frozenset()
    # the norm guard's memory: norms of this round's accepted updates, of the previous round's,
    # and who was refused this round (not waited for). In memory: a restart starts it afresh.
    norms: dict[str, float] = field(default_factory=dict)
    previous_norms: list[float] = field(default_factory=list)
    rejected: set[str] = field(default_factory=set)
    # round -> peer -> (wall time its result download began, ended); in memory, bounded
    downloads: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    # writes the file of ``version`` (= version - 1 + decode(result of round version - 1)) after
    # the round that made it committed; pulls and the next such write wait for it
    writing: asyncio.Task[None] | None = None

    def notify(self) -> None:
        """Wake every waiter of this run (they re-check what they wait for)."""
        self.changed.set()
        self.changed = asyncio.Event()

    def world_size(self) -> int:
        ranks = [p.rank for p in self.peers.values() if p.rank is not None]
        return max(ranks) + 1 if ranks else 0


@dataclass
class Ticket:
    """Permission to stream one update: what it must look like and where it goes."""

    run: str
    round: int
    peer: str
    digest: str
    samples: int
    metrics: dict[str, float]
    max_bytes: int
    check_header: Callable[[dict[str, TensorInfo]], None]


class Coordinator:
    """All runs of one hub."""

    def __init__(self, settings: HubSettings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.runs: dict[str, Run] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # observers (metrics, dashboard), called on the event loop; they must be cheap:
        # (run, round record) after each publish, (run, update) after each acknowledgement,
        # (run, round, peer, seconds) after a peer fetched a round's result
        self.on_round: list[Callable[[Run, RoundRecord], None]] = []
        self.on_update: list[Callable[[Run, UpdateRecord], None]] = []
        self.on_download: list[Callable[[Run, int, str, float], None]] = []
        # the same few threads fold and merge every round: fresh threads each round would each
        # get a fresh malloc arena, and the hub's memory crept up round after round
        self._slice_pool = ThreadPoolExecutor(SLICE_THREADS, thread_name_prefix="syncserver-slices")

    # ---- life ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Load every run from disk, drop what a crash left half-done, start the ticker."""
        self.store.clear_tmp()
        for record in self.store.runs():
            config = RunConfig(**record.config)
            run = Run(record.name, config, get_codec(config.codec), record.version, record.schema, record.sealed)
            self.store.recover(run.name, run.version)
            for p in self.store.peers(run.name):
                # every peer gets a fresh lease: they ride through the restart on retries
                run.peers[p.name] = Peer(p.name, p.rank, p.active_from, p.joined, p.left)
            if run.version >= 0:
                for update in self.store.updates(run.name, run.version):
                    run.acked[update.peer] = update
                if run.acked:
                    run.opened = min(u.received for u in run.acked.values())
                    run.deadline = time.monotonic() + config.round_timeout
            run.live_set = self._live(run)
            self.runs[run.name] = run
            if run.version > 0 and not self.store.version_path(run.name, run.version).exists():
                self._write_versions(run)  # killed between a commit and its version's rename
            log.info("run_recovered run=%s version=%d pending=%d", run.name, run.version, len(run.acked))
        self._ticker = asyncio.create_task(self._tick_forever())

    async def stop(self) -> None:
        if self._ticker:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        self._slice_pool.shutdown()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _tick_forever(self) -> None:
        interval = min(0.5, self.settings.lease_seconds / 4)
        while True:
            await asyncio.sleep(interval)
            for run in list(self.runs.values()):
                self._tick(run)

    def _tick(self, run: Run) -> None:
        """Leases and deadlines: the only things that change with time alone."""
        live = self._live(run)
        if live != run.live_set:
            for name in run.live_set - live:
                if not run.peers[name].left:
                    log.warning("peer_gone run=%s peer=%s reason=lease_expired", run.name, name)
            run.live_set = live
            if run.init_claim and run.init_claim not in live:
                log.warning("initialiser_gone run=%s peer=%s", run.name, run.init_claim)
                run.init_claim = None
            run.notify()
        self._maybe_close(run)

    def _live(self, run: Run) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(p.name for p in run.peers.values() if p.live(now, self.settings.lease_seconds))

    # ---- lookups -------------------------------------------------------------------------
    def run(self, name: str) -> Run:
        try:
            return self.runs[name]
        except KeyError:
            raise NotFound(f"unknown run {name!r}") from None

    def _peer(self, run: Run, name: str) -> Peer:
        """The peer, with its lease renewed: any request from a peer proves it is alive."""
        peer = run.peers.get(name)
        if peer is None or peer.left:
            raise NotFound(f"peer {name!r} is not a member of run {run.name!r}; join first", run=run.name)
        peer.last_seen = time.monotonic()
        if name not in run.live_set:
            run.live_set = run.live_set | {name}
            log.info("peer_back run=%s peer=%s", run.name, name)
        return peer

    # ---- joining -------------------------------------------------------------------------
    def join(self, run_name: str, peer_name: str, requested: dict[str, Any]) -> dict[str, Any]:
        """Register a peer (again, after a crash: same name, same rank) and say what it must do next."""
        run = self.runs.get(run_name)
        if run is None:
            run = self._create(run_name, requested)
        else:
            for key, value in requested.items():
                if value is not None and getattr(run.config, key) != value:
                    raise Conflict(
                        f"run {run_name!r} uses {key}={getattr(run.config, key)!r}; this peer asked for {value!r}",
                        config=run.config.__dict__,
                    )
        peer = run.peers.get(peer_name)
        if peer is None:
            in_round = bool(run.acked) or run.closing
            peer = Peer(peer_name, None, max(run.version, 0) + int(in_round), time.time())
            if run.sealed:
                peer.rank = run.world_size()
            run.peers[peer_name] = peer
            log.info("peer_joined run=%s peer=%s rank=%s", run_name, peer_name, peer.rank)
        else:
            peer.left = False
            peer.last_seen = time.monotonic()
            # a peer that comes back mid-round (after a crash) restarts from the latest version
            # and is waited for from the next round on, like any new peer
            if run.acked or run.closing:
                peer.active_from = max(peer.active_from, run.version + 1)
            log.info("peer_rejoined run=%s peer=%s rank=%s", run_name, peer_name, peer.rank)
        self.store.save_peer(run_name, peer.record())
        run.live_set = run.live_set | {peer_name}
        self._maybe_seal(run)
        return self._start_state(run, peer)

    def _create(self, name: str, requested: dict[str, Any]) -> Run:
        s = self.settings
        values = {key: getattr(s, key) for key in CONFIG_FIELDS}
        values.update({k: v for k, v in requested.items() if v is not None})
        config = RunConfig(**values)
        try:
            codec = get_codec(config.codec)
        except ValueError as exc:
            raise InvalidUpdate(str(exc)) from None
        self.store.create_run(name, config.__dict__)
        run = Run(name, config, codec)
        self.runs[name] = run
        log.info("run_created run=%s %s", name, " ".join(f"{k}={v}" for k, v in config.__dict__.items()))
        return run

    def _maybe_seal(self, run: Run) -> None:
        """Fix ranks once version 0 exists and min_peers have joined: by sorted peer name, so
        that data shards do not depend on who happened to join first."""
        members = sorted(p.name for p in run.peers.values() if not p.left)
        if run.sealed or run.version < 0 or len(members) < run.config.min_peers:
            return
        ranks = {name: rank for rank, name in enumerate(members)}
        for name, rank in ranks.items():
            run.peers[name].rank = rank
        self.store.seal(run.name, ranks)
        run.sealed = True
        log.info("run_started run=%s peers=%d members=%s", run.name, len(members), ",".join(members))
        run.notify()

    def _start_state(self, run: Run, peer: Peer) -> dict[str, Any]:
        base = {"run": run.name, "peer": peer.name, "lease_seconds": self.settings.lease_seconds}
        if run.version < 0:
            if run.init_claim is None or run.init_claim not in run.live_set:
                run.init_claim = peer.name
            if run.init_claim == peer.name:
                return {**base, "state": "initialise", "config": run.config.__dict__}
            return {**base, "state": "waiting", "detail": f"waiting for {run.init_claim} to upload version 0"}
        if not run.sealed:
            joined = sum(not p.left for p in run.peers.values())
            return {
                **base,
                "state": "waiting",
                "detail": f"{joined} of {run.config.min_peers} peers have joined",
            }
        assert run.schema is not None
        return {
            **base,
            "state": "ready",
            "rank": peer.rank,
            "world_size": run.world_size(),
            "version": run.version,
            "config": run.config.__dict__,
            "schema": {name: list(shape) for name, shape in run.schema.items()},
        }

    async def wait_start(self, run_name: str, peer_name: str, wait: float) -> dict[str, Any]:
        """Long poll until the peer may start (or must initialise); at most ``wait`` seconds."""
        run = self.run(run_name)
        deadline = time.monotonic() + min(wait, self.settings.long_poll_seconds)
        while True:
            state = self._start_state(run, self._peer(run, peer_name))
            remaining = deadline - time.monotonic()
            if state["state"] != "waiting" or remaining <= 0:
                return state
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.changed.wait(), remaining)

    def init_ticket(self, run_name: str, peer_name: str) -> Ticket:
        """May this peer upload version 0? Any float32 tensors will do: they define the schema."""
        run = self.run(run_name)
        self._peer(run, peer_name)
        if run.version >= 0:
            raise Conflict(f"run {run_name!r} already has version 0", current_version=run.version)
        if run.init_claim != peer_name:
            raise Conflict(f"peer {run.init_claim!r} is initialising run {run_name!r}, not {peer_name!r}")

        def check(infos: dict[str, TensorInfo]) -> None:
            if not infos:
                raise FormatError("version 0 holds no tensors")
            for name, info in infos.items():
                if info.dtype != "F32":
                    raise FormatError(f"version 0 must be float32; tensor {name!r} is {info.dtype}")
                if ":" in name or not name or len(name) > 512:
                    raise FormatError(f"tensor name {name!r} is not allowed (no ':', 1-512 characters)")

        return Ticket(run_name, -1, peer_name, "", 0, {}, self.settings.max_body_bytes, check)

    async def commit_init(self, ticket: Ticket, received: Received) -> dict[str, Any]:
        run = self.run(ticket.run)
        if run.version >= 0 or run.init_claim != ticket.peer:
            received.path.unlink(missing_ok=True)
            raise Conflict(f"run {run.name!r} was initialised by another peer", current_version=run.version)
        order = sorted(received.infos.values(), key=lambda i: i.start)
        schema = {i.name: i.shape for i in order}
        try:
            publish_file(received.path, self.store.version_path(run.name, 0))
            self.store.set_initial_version(run.name, schema)
        except (OSError, sqlite3.Error) as exc:
            raise disk_error(exc) from exc
        run.schema, run.version, run.init_claim = schema, 0, None
        log.info("version0 run=%s peer=%s tensors=%d bytes=%d", run.name, ticket.peer, len(schema), received.nbytes)
        self._maybe_seal(run)
        run.notify()
        return {"version": 0, "tensors": len(schema), "bytes": received.nbytes}

    # ---- liveness ------------------------------------------------------------------------
    def heartbeat(self, run_name: str, peer_name: str) -> dict[str, Any]:
        run = self.run(run_name)
        self._peer(run, peer_name)
        return {"version": run.version, "lease_seconds": self.settings.lease_seconds}

    def leave(self, run_name: str, peer_name: str) -> None:
        run = self.run(run_name)
        peer = self._peer(run, peer_name)
        peer.left = True
        self.store.save_peer(run.name, peer.record())
        run.live_set = run.live_set - {peer_name}
        log.info("peer_left run=%s peer=%s", run.name, peer_name)
        run.notify()
        self._maybe_close(run)

    # ---- updates -------------------------------------------------------------------------
    async def update_ticket(
        self, run_name: str, round_: int, peer_name: str, digest: str, samples: int, metrics: dict[str, float]
    ) -> Ticket | dict[str, Any]:
        """Check an update may be sent before its body is read; a repeat gets its old ack."""
        run = self.run(run_name)
        self._peer(run, peer_name)
        if not 1 <= samples <= MAX_SAMPLES:
            raise InvalidUpdate(f"samples must be a count from 1 to {MAX_SAMPLES}, got {samples}")
        repeat = self._acknowledged(run, round_, peer_name, digest)
        if repeat is not None:
            return repeat
        await self._check_open(run, round_)
        assert run.schema is not None
        layout = wire_layout(run.codec, run.schema)

        def check(infos: dict[str, TensorInfo]) -> None:
            check_layout(infos, layout)

        # the header may be a few times the size of the run's own (other writers pad it, add
        # metadata), not the format's 8 MiB cap: a small run's limit stays small
        own_header, _ = encode_header((name, dtype, shape) for name, (dtype, shape) in layout.items())
        header_cap = min(MAX_HEADER_BYTES, 2 * len(own_header) + HEADER_SLACK)
        max_bytes = min(8 + header_cap + layout_bytes(layout), self.settings.max_body_bytes)
        return Ticket(run_name, round_, peer_name, digest, samples, metrics, max_bytes, check)

    def _acknowledged(self, run: Run, round_: int, peer: str, digest: str) -> dict[str, Any] | None:
        """Idempotency: the same update again is harmless, a different one is a conflict."""
        if round_ == run.version:
            previous = run.acked.get(peer)
        else:
            previous = next((u for u in self.store.updates(run.name, round_) if u.peer == peer), None)
        if previous is None:
            return None
        if previous.digest != digest:
            raise Conflict(
                f"peer {peer!r} already has a different update acknowledged for round {round_}",
                current_version=run.version,
            )
        return self._ack(previous, repeat=True)

    @staticmethod
    def _ack(update: UpdateRecord, repeat: bool = False) -> dict[str, Any]:
        return {
            "round": update.round,
            "peer": update.peer,
            "seq": update.seq,
            "samples": update.samples,
            "bytes": update.nbytes,
            "repeat": repeat,
        }

    async def _check_open(self, run: Run, round_: int) -> None:
        if run.version < 0 or not run.sealed:
            raise Conflict(f"run {run.name!r} has not started yet", current_version=run.version)
        if run.closing and round_ == run.version:
            # it is about to close without this update: answer once the new version exists,
            # so that the peer's catch-up finds it
            while run.closing:
                await run.changed.wait()
        if round_ < run.version:
            raise RoundClosed(
                f"round {round_} closed without this update; the run is at version {run.version}",
                current_version=run.version,
            )
        if round_ > run.version:
            raise Conflict(
                f"round {round_} is not open; the run is at version {run.version}",
                current_version=run.version,
            )

    async def commit_update(self, ticket: Ticket, received: Received) -> dict[str, Any]:
        """Acknowledge a fully received update: verify, make durable, record, fold."""
        run = self.run(ticket.run)
        try:
            if received.digest != ticket.digest:
                raise BadRequest(f"body digest sha-256 {received.digest} does not match Content-Digest {ticket.digest}")
            norm = await to_thread.run_sync(self._verify, run, received.path)
            repeat = self._acknowledged(run, ticket.round, ticket.peer, ticket.digest)
            if repeat is not None:
                return repeat
            await self._check_open(run, ticket.round)
            self._guard(run, ticket.peer, norm)
            path = self.store.update_path(run.name, ticket.round, ticket.peer)
            try:
                publish_file(received.path, path)
                now = time.time()
                update = UpdateRecord(
                    ticket.peer,
                    ticket.round,
                    self.store.next_seq(run.name),
                    ticket.digest,
                    ticket.samples,
                    ticket.metrics,
                    received.nbytes,
                    now,
                    received.seconds,
                )
                self.store.add_update(run.name, update)  # the acknowledgement's commit point
            except (OSError, sqlite3.Error) as exc:  # not acknowledged: leave no file behind
                path.unlink(missing_ok=True)
                raise disk_error(exc) from exc
        finally:
            received.path.unlink(missing_ok=True)
        run.acked[ticket.peer] = update
        if norm is not None:
            run.norms[ticket.peer] = norm
        if run.opened is None:
            run.opened = now
            run.deadline = time.monotonic() + run.config.round_timeout
        peer = run.peers[ticket.peer]
        if peer.last_update_at is not None and now > peer.last_update_at:
            peer.rate = ticket.samples / (now - peer.last_update_at)
        peer.last_update_at, peer.last_round = now, ticket.round
        peer.samples += ticket.samples
        peer.bytes_up += received.nbytes
        log.info(
            "update_acked run=%s round=%d peer=%s samples=%d mb=%.3f upload_s=%.3f",
            run.name,
            ticket.round,
            ticket.peer,
            ticket.samples,
            received.nbytes / 1e6,
            received.seconds,
        )
        for observer in self.on_update:
            observer(run, update)
        await self._fold_pending(run)
        self._maybe_close(run)
        return self._ack(update)

    def _verify(self, run: Run, path: Path) -> float | None:
        """Worker thread: with the norm guard on, the update's L2 norm as decoded, read and
        decoded a slice at a time like the fold. (NaN/Inf were refused as the body streamed in.)"""
        if run.config.norm_guard is None:
            return None
        assert run.schema is not None
        codec = run.codec
        with TensorFile(path) as wire:
            return aggregate.global_norm(
                codec.decode(
                    {s: wire.read(wire_name(name, s), first, first + count) for s, (first, count) in parts.items()},
                    (stop - start,),
                )
                for name, shape in run.schema.items()
                for start, stop, parts in slices(codec, shape)
            )

    def _guard(self, run: Run, peer: str, norm: float | None) -> None:
        """The poisoned-update guard: refuse an update far above the usual norm, before it is
        acknowledged, so that it never reaches the average; the round stops waiting for its peer."""
        factor = run.config.norm_guard
        if factor is None or norm is None:
            return
        median = aggregate.norm_outlier(norm, [*run.previous_norms, *run.norms.values()], factor)
        if median is None:
            return
        run.rejected.add(peer)
        log.warning(
            "update_rejected run=%s round=%d peer=%s norm=%.4g median=%.4g factor=%g",
            run.name,
            run.version,
            peer,
            norm,
            median,
            factor,
        )
        self._maybe_close(run)
        raise PoisonedUpdate(
            f"update norm {norm:.4g} is over {factor:g} x the median {median:.4g} of accepted updates; "
            "it was not applied",
            norm=norm,
            median=median,
            factor=factor,
        )

    # ---- folding and closing -------------------------------------------------------------
    async def _fold_pending(self, run: Run) -> None:
        """Fold every acknowledged, not yet folded update, in acknowledgement order."""
        async with run.fold_lock:
            for update in sorted(run.acked.values(), key=lambda u: u.seq):
                if update.peer not in run.folded:
                    await to_thread.run_sync(self._fold_one, run, update)
                    run.folded.append(update.peer)

    def _fold_one(self, run: Run, update: UpdateRecord) -> None:
        """Fold one acknowledged update into the accumulator, a slice at a time (worker thread).

        The file is read with ``pread`` a few MB at a time and decoded slice by slice, so
        folding holds one slice of temporaries, whatever the model's size.
        """
        assert run.schema is not None
        if run.acc is None:
            run.acc = {name: np.zeros(shape, np.float32) for name, shape in run.schema.items()}
        codec, acc = run.codec, run.acc
        with TensorFile(self.store.update_path(run.name, update.round, update.peer)) as wire:

            def fold(name: str, start: int, stop: int, parts: dict[str, tuple[int, int]]) -> None:
                encoded = {
                    suffix: wire.read(wire_name(name, suffix), first, first + count)
                    for suffix, (first, count) in parts.items()
                }
                aggregate.fold(
                    acc[name].reshape(-1)[start:stop], codec.decode(encoded, (stop - start,)), update.samples
                )

            _each_slice(self._slice_pool, codec, run.schema, fold)

    def _maybe_close(self, run: Run) -> None:
        if run.closing or not run.acked:
            return
        expected = {
            p.name
            for p in run.peers.values()
            if p.rank is not None and p.name in run.live_set and p.active_from <= run.version
        } - run.rejected
        enough = len(run.acked) >= run.config.min_peers
        everyone = expected <= run.acked.keys()
        overdue = run.deadline is not None and time.monotonic() >= run.deadline
        if enough and (everyone or overdue):
            run.closing = True
            self._spawn(self._close(run, sorted(expected - run.acked.keys())))

    async def _close(self, run: Run, dropped: list[str]) -> None:
        round_ = run.version
        started = time.monotonic()
        try:
            async with run.fold_lock:
                for update in sorted(run.acked.values(), key=lambda u: u.seq):
                    if update.peer not in run.folded:
                        await to_thread.run_sync(self._fold_one, run, update)
                        run.folded.append(update.peer)
                folded = time.monotonic()
                result_bytes = await to_thread.run_sync(self._merge, run)
            updates = sorted(run.acked.values(), key=lambda u: u.seq)
            assert run.opened is not None
            record = RoundRecord(
                round=round_,
                opened=run.opened,
                closed=time.time(),
                participants=[u.peer for u in updates],
                dropped=dropped,
                samples=sum(u.samples for u in updates),
                bytes_in=sum(u.nbytes for u in updates),
                result_bytes=result_bytes,
                timings={"fold": folded - started, "merge": time.monotonic() - folded},
            )
            self.store.commit_round(run.name, record)
        except Exception:
            log.exception("round_close_failed run=%s round=%d (will retry)", run.name, round_)
            run.closing = False
            run.notify()
            return
        run.version = round_ + 1
        run.acked, run.acc, run.folded = {}, None, []
        if run.norms:
            run.previous_norms = list(run.norms.values())
        run.norms, run.rejected = {}, set()
        run.opened = run.deadline = None
        run.closing = False
        for name in dropped:
            log.warning("straggler_dropped run=%s round=%d peer=%s", run.name, round_, name)
        log.info(
            "round_closed run=%s round=%d version=%d peers=%d dropped=%d samples=%d mb_in=%.3f mb_out=%.3f "
            "fold_s=%.3f merge_s=%.3f wall_s=%.3f",
            run.name,
            round_,
            run.version,
            len(record.participants),
            len(record.dropped),
            record.samples,
            record.bytes_in / 1e6,
            record.result_bytes / 1e6,
            record.timings["fold"],
            record.timings["merge"],
            record.closed - record.opened,
        )
        self._write_versions(run)
        for observer in self.on_round:
            observer(run, record)
        run.notify()

    def _merge(self, run: Run) -> int:
        """Write round v's result and DiLoCo momentum, a slice at a time (worker thread).

        The result is the encoded global update ``U``. Version v+1 (``version v + decode(U)``,
        exactly what every peer computes from the same bytes) is not written here but after
        the commit (:meth:`_write_versions`): it can always be rebuilt from version v and the
        durable result, so its 4 bytes per parameter stay off the time every peer waits.
        Slices (:func:`syncwire.codecs.slices`) keep the temporaries to a few MB; the momentum
        is read with ``pread`` (no mapping that would count in the RSS); the kernel starts
        writing each slice back to disk as soon as it is written, so the fsyncs before the
        commit wait for little more than the last slices.
        """
        assert run.schema is not None and run.acc is not None
        v, cfg, codec, schema = run.version, run.config, run.codec, run.schema
        total = np.float32(sum(u.samples for u in run.acked.values()))
        diloco = cfg.outer == "diloco"
        momentum_path = self.store.momentum_path(run.name, v)
        result_layout = [(wire, dtype, shape) for wire, (dtype, shape) in wire_layout(codec, schema).items()]
        meta = {"round": str(v), "version": str(v + 1), "codec": codec.spec}
        result_head, result_at = _header(result_layout, meta)
        momentum_head, momentum_at = _header(_fp32_layout(schema), {"version": str(v + 1)})
        with contextlib.ExitStack() as files:
            old_momentum = files.enter_context(TensorFile(momentum_path)) if diloco and momentum_path.exists() else None
            result = files.enter_context(atomic_file(self.store.result_path(run.name, v)))
            mom = files.enter_context(atomic_file(self.store.momentum_path(run.name, v + 1))) if diloco else None
            for f, head in ((result, result_head), (mom, momentum_head)):
                if f is not None:
                    f.write(head)
                    f.flush()  # the slices go straight to the file descriptor, at their offsets
            acc = run.acc

            def merge(name: str, start: int, stop: int, parts: dict[str, tuple[int, int]]) -> None:
                n = stop - start
                mean = acc[name].reshape(-1)[start:stop] / total
                m_old = (
                    old_momentum.read(name, start, stop)
                    if old_momentum is not None
                    else (np.zeros(n, np.float32) if diloco else None)
                )
                update, m_new = aggregate.outer_step(cfg.outer, mean, m_old, lr=cfg.outer_lr, mu=cfg.outer_momentum)
                encoded = codec.encode(update)
                for suffix, (first, count) in parts.items():
                    part = np.ascontiguousarray(encoded[suffix]).reshape(-1)
                    if part.size != count:
                        raise FormatError(f"codec {codec.spec}: a slice's part {suffix!r} has {part.size} values")
                    _write_at(result, part, result_at[wire_name(name, suffix)] + first * part.itemsize)
                if mom is not None and m_new is not None:
                    _write_at(mom, np.ascontiguousarray(m_new, np.float32), momentum_at[name] + start * 4)

            _each_slice(self._slice_pool, codec, schema, merge)
        return len(result_head) + layout_bytes({n: (d, s) for n, d, s in result_layout})

    def _write_versions(self, run: Run) -> None:
        """Start writing the files of the committed versions that have none (after a commit,
        or at start after a crash between a commit and its version's rename), then prune."""
        if run.writing is None or run.writing.done():
            run.writing = self._spawn(self._versions_task(run))
            run.writing.add_done_callback(_log_version_failure)

    async def _versions_task(self, run: Run) -> None:
        while True:
            target = run.version
            await to_thread.run_sync(self._build_versions, run, target)
            with contextlib.suppress(OSError):
                self.store.prune(run.name, target, self.settings.keep_versions)
            if run.version == target:  # else rounds closed meanwhile
                return

    async def version_file(self, run: Run) -> tuple[int, Path]:
        """The run's current version and its file, once that file is written."""
        while True:
            version = run.version
            path = self.store.version_path(run.name, version)
            if path.exists():
                return version, path
            self._write_versions(run)
            assert run.writing is not None
            try:
                await asyncio.shield(run.writing)
            except OSError as exc:
                raise disk_error(exc) from exc

    def _build_versions(self, run: Run, target: int) -> None:
        """Write every missing version file up to ``target`` from the last one on disk and the
        rounds' results (worker thread): ``version j+1 = version j + decode(result j)``."""
        assert run.schema is not None
        first = target
        while first > 0 and not self.store.version_path(run.name, first).exists():
            first -= 1
        for v in range(first, target):
            self._next_version(run, v)

    def _next_version(self, run: Run, v: int) -> None:
        assert run.schema is not None
        codec, schema = run.codec, run.schema
        head, at = _header(_fp32_layout(schema), {"version": str(v + 1)})
        with contextlib.ExitStack() as files:
            current = files.enter_context(TensorFile(self.store.version_path(run.name, v)))
            result = files.enter_context(TensorFile(self.store.result_path(run.name, v)))
            version = files.enter_context(atomic_file(self.store.version_path(run.name, v + 1)))
            version.write(head)
            version.flush()  # the slices go straight to the file descriptor, at their offsets

            def add(name: str, start: int, stop: int, parts: dict[str, tuple[int, int]]) -> None:
                encoded = {
                    suffix: result.read(wire_name(name, suffix), first, first + count)
                    for suffix, (first, count) in parts.items()
                }
                new = current.read(name, start, stop)
                np.add(new, codec.decode(encoded, (stop - start,)), out=new)
                _write_at(version, new, at[name] + start * 4)

            _each_slice(self._slice_pool, codec, schema, add)

    # ---- results and models --------------------------------------------------------------
    async def wait_result(self, run_name: str, round_: int, peer_name: str | None, wait: float) -> Path | None:
        """Long poll for round ``round_``'s merged update; None if it is still open after ``wait``."""
        run = self.run(run_name)
        deadline = time.monotonic() + min(wait, self.settings.long_poll_seconds)
        while True:
            if peer_name is not None:
                self._peer(run, peer_name)
            if round_ < run.version:
                path = self.store.result_path(run.name, round_)
                if not path.exists():
                    raise Gone(f"round {round_}'s result was pruned; pull the model", current_version=run.version)
                return path
            if round_ > run.version or run.version < 0:
                raise Conflict(
                    f"round {round_} is not open; the run is at version {run.version}",
                    current_version=run.version,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.changed.wait(), remaining)

    async def model(self, run_name: str) -> tuple[int, Path]:
        run = self.run(run_name)
        if run.version < 0:
            raise Conflict(f"run {run_name!r} has no version 0 yet", current_version=-1)
        return await self.version_file(run)

    def count_download(self, run_name: str, peer_name: str | None, nbytes: int) -> None:
        run = self.runs.get(run_name)
        if run and peer_name in run.peers:
            run.peers[peer_name].bytes_down += nbytes

    def record_download(self, run_name: str, round_: int, peer_name: str | None, began: float) -> None:
        """A peer has received round ``round_``'s whole result (called once the response is sent):
        the last phase of its round, for the dashboard's timeline and the metrics."""
        run = self.runs.get(run_name)
        if run is None or peer_name not in run.peers:
            return
        assert peer_name is not None
        ended = time.time()
        run.downloads.setdefault(round_, {})[peer_name] = (began, ended)
        while len(run.downloads) > DOWNLOADS_KEPT:
            del run.downloads[min(run.downloads)]
        for observer in self.on_download:
            observer(run, round_, peer_name, ended - began)

    # ---- status --------------------------------------------------------------------------
    def peer_state(self, run: Run, peer: Peer) -> PeerState:
        if peer.left:
            return PeerState.LEFT
        if peer.name not in run.live_set:
            return PeerState.GONE
        if 0 <= peer.last_round < run.version - 1 and peer.active_from <= run.version - 1:
            return PeerState.LATE
        return PeerState.LIVE

    def status(self, run_name: str) -> dict[str, Any]:
        run = self.run(run_name)
        now = time.monotonic()
        rounds = self.store.rounds(run.name)
        return {
            "run": run.name,
            "version": run.version,
            "config": run.config.__dict__,
            "sealed": run.sealed,
            "world_size": run.world_size(),
            "tensors": len(run.schema or {}),
            "parameters": sum(math.prod(s) for s in (run.schema or {}).values()),
            "open_round": {
                "round": run.version,
                "submitted": sorted(run.acked),
                "uploading": sorted(run.uploading),
                "closing": run.closing,
                "rejected": sorted(run.rejected),
                "seconds_left": None if run.deadline is None else max(0.0, run.deadline - now),
            },
            "peers": [
                {
                    "peer": p.name,
                    "rank": p.rank,
                    "state": self.peer_state(run, p).value,
                    "last_seen_seconds": round(now - p.last_seen, 3),
                    "active_from": p.active_from,
                    "samples": p.samples,
                    "samples_per_second": round(p.rate, 3),
                    "bytes_up": p.bytes_up,
                    "bytes_down": p.bytes_down,
                }
                for p in sorted(run.peers.values(), key=lambda p: (p.rank is None, p.rank, p.name))
            ],
            "rounds": [r.__dict__ for r in rounds],
            "updates": [u.__dict__ for u in self.store.round_metrics(run.name)],
        }

    def list_runs(self) -> list[dict[str, Any]]:
        return [
            {
                "run": r.name,
                "version": r.version,
                "peers": len(r.live_set),
                "codec": r.config.codec,
                "outer": r.config.outer,
            }
            for r in self.runs.values()
        ]


def _each_slice(
    pool: ThreadPoolExecutor,
    codec: Codec,
    schema: dict[str, tuple[int, ...]],
    work: Callable[[str, int, int, dict[str, tuple[int, int]]], None],
) -> None:
    """Run ``work(name, start, stop, parts)`` for every slice of every tensor, on ``pool``.

    Closing a round is the one time the peers all wait on the hub, and a single thread left the
    other cores idle. Slices are independent (each reads and writes only its own values and file
    offsets) and numpy, ``pread`` and ``pwrite`` release the GIL, so the threads give the same
    bytes as one thread, in any order.
    """
    jobs = [(name, *piece) for name, shape in schema.items() for piece in slices(codec, shape)]
    if SLICE_THREADS == 1 or len(jobs) == 1:
        for job in jobs:
            work(*job)
        return
    futures = [pool.submit(work, *job) for job in jobs]
    try:
        for future in futures:
            future.result()  # re-raises the first failure
    finally:
        for future in futures:
            future.cancel()  # after a failure: the rest is moot (a cancelled round starts over)
        wait(futures)  # nothing may still write to the files the caller is about to discard


def _log_version_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        # the results are durable, so nothing is lost: the next pull or commit retries
        log.error("version_write_failed: %r (will retry)", task.exception())


def _fp32_layout(schema: dict[str, tuple[int, ...]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """The layout of a version (and of a DiLoCo momentum) file: every tensor in float32."""
    return [(name, "F32", shape) for name, shape in schema.items()]


def _header(layout: list[tuple[str, str, tuple[int, ...]]], meta: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``layout`` and each tensor's byte offset in the file."""
    head, infos = encode_header(layout, meta)
    return head, {i.name: len(head) + i.start for i in infos}


def _write_at(f: Any, array: np.ndarray, position: int) -> None:
    """Write an array's bytes at ``position`` of an open file, and start their writeback."""
    view = array.reshape(-1).view(np.uint8).data
    fd = f.fileno()
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], position + done)
    start_writeback(fd, position, len(view))
