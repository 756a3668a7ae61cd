"""Receiving updates and closing rounds: admission, acknowledgement, the norm guard, folding,
the close itself and the version files written after it.

An update is acknowledged once its body is complete, verified (digest, layout, finite values;
the norm guard when on), durable and recorded in sqlite; it is then folded into the round's
float32 accumulator in acknowledgement order (so a hub restarted after a crash rebuilds the
very same sums from the files), or, once the round is closing, by the close's merge itself.
The policy (:mod:`syncserver.core.policy`) says when a round closes; the engine
(:mod:`syncserver.reduce.engine`) does the tensor work; a round commits once its result (the encoded
merged update) is durable, and the file of version v+1 is written after that, since it is
``version v + decode(result)``: a restarted hub rebuilds what a crash left unwritten, and pulls
wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from anyio import to_thread

from syncserver.core.finite import Leased, merge_finite
from syncserver.core.leases import FoldAhead
from syncserver.core.policy import Close, Place
from syncserver.core.shape import RunShape
from syncserver.core.state import Run, now
from syncserver.core.view import HubView
from syncserver.errors import (
    BadRequest,
    Conflict,
    Gone,
    InvalidUpdate,
    PoisonedUpdate,
    RoundClosed,
    StaleUpdate,
    Unavailable,
)
from syncserver.limits import MAX_SAMPLES
from syncserver.records import RoundRecord, UpdateRecord
from syncserver.reduce import aggregate
from syncserver.reduce.engine import MergeEngine
from syncserver.reduce.lease import FoldJob
from syncserver.settings import HubSettings
from syncserver.storage.bucket import Bucket
from syncserver.storage.store import ObjectRecord, ResultKey, Store, UpdateKey, Upload, VersionKey
from syncserver.storage.uploads import Received
from syncwire import Codec, FormatError, Schema, TensorInfo, check_layout

__all__ = ["Acknowledgement", "InitialVersion", "Rounds", "Ticket"]

log = logging.getLogger(__name__)

CLOSE_RETRY_MAX = 30.0  # seconds between two tries at a close that keeps failing
ASYNC_NORMS = 8  # the norm guard's reference in async runs: the last accepted updates' norms

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]
#: Has version v+1 built in the bucket (run, v, schema, codec): its record and the bound on its
#: values per tensor (:func:`syncserver.core.leases.build_leased` bound to the board)
Built = Callable[[str, int, Schema, Codec], Awaitable[tuple[ObjectRecord, dict[str, float]]]]


@dataclass
class Ticket:
    """Permission to stream one body: what it must look like and where it goes. A ticket for an
    update the hub already holds carries that update's acknowledgement and needs no body."""

    run: str
    round: int  # -1: version 0
    peer: str
    digest: str | None  # hex sha-256 of the body; None: it comes in a later request (a held body)
    samples: int
    metrics: dict[str, float]
    max_bytes: int
    check_header: Callable[[dict[str, TensorInfo]], None]
    upload: Upload | None = None
    acknowledged: Acknowledgement | None = None
    final: bool = False  # the peer's last update (X-Sync-Final)


@dataclass(frozen=True)
class Acknowledgement:
    """An update is durable and counted in round ``round`` (``repeat``: it was already, this is
    its first acknowledgement again)."""

    round: int
    peer: str
    seq: int  # order of acknowledgement within the run
    samples: int
    nbytes: int
    repeat: bool = False

    @classmethod
    def of(cls, update: UpdateRecord, repeat: bool = False) -> Acknowledgement:
        return cls(update.round, update.peer, update.seq, update.samples, update.nbytes, repeat)


@dataclass(frozen=True)
class InitialVersion:
    """Version 0 is stored: the run's schema is its ``tensors`` tensors."""

    tensors: int
    nbytes: int


def _check_initial(infos: dict[str, TensorInfo]) -> None:
    """Version 0: any float32 tensors will do, they define the run's schema."""
    if not infos:
        raise FormatError("version 0 holds no tensors")
    for name, info in infos.items():
        if info.dtype != "F32":
            raise FormatError(f"version 0 must be float32; tensor {name!r} is {info.dtype}")
        if ":" in name or not name or len(name) > 512:
            raise FormatError(f"tensor name {name!r} is not allowed (no ':', 1-512 characters)")


def _refuse_body(infos: dict[str, TensorInfo]) -> None:
    raise FormatError("this update is acknowledged already: send no body")


class Rounds:
    """The open round of every run: tickets, acknowledgements, folds, closes, version files."""

    def __init__(
        self,
        settings: HubSettings,
        store: Store,
        engine: MergeEngine,
        view: HubView,
        bucket: Bucket | None = None,
        leased: Leased | None = None,
        built: Built | None = None,
        ahead: FoldAhead | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self.view = view
        self.bucket = bucket
        self.leased = leased  # SYNC_REDUCERS: reducers share each merge (syncserver.core.leases)
        self.ahead = ahead  # and fold each round's updates ahead of its close
        self._folding: dict[str, asyncio.Task[None]] = {}  # run -> its fold ahead under way
        self._tasks: set[asyncio.Task[None]] = set()
        self.versions = VersionFiles(settings, store, engine, self._spawn, bucket, built)

    def recover(self, run: Run) -> None:
        """Reload the open round's acknowledged updates (a restart) and rebuild missing versions."""
        if run.version < 0:
            return
        for update in self.store.updates(run.name, run.version):
            run.acked[update.peer] = update
            run.policy.restore_update(update.peer, now(), update.samples)  # its deadline starts afresh
        if run.acked:
            run.opened = min(u.received for u in run.acked.values())
        if run.version > 0 and not self.store.exists(VersionKey(run.name, run.version)):
            self.versions.start(run)  # killed between a commit and its version's rename

    async def stop(self) -> None:
        for task in self._folding.values():  # a fold ahead is dropped, not waited for: nothing of it counts yet
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(Exception, asyncio.CancelledError):  # a fold ahead that a close stopped
                await task

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- version 0 -----------------------------------------------------------------------
    def init_ticket(self, run: Run, peer: str) -> Ticket:
        """May this peer upload version 0?"""
        if run.version >= 0:
            raise Conflict(f"run {run.name!r} already has version 0", current_version=run.version)
        if run.init_claim != peer:
            raise Conflict(f"peer {run.init_claim!r} is initialising run {run.name!r}, not {peer!r}")
        return Ticket(
            run.name, -1, peer, "", 0, {}, self.settings.max_body_bytes, _check_initial, self.store.fresh_upload()
        )

    def commit_init(self, run: Run, ticket: Ticket, received: Received, shape: RunShape) -> InitialVersion:
        """Version 0 is ``received``; ``shape`` is its schema's (:meth:`RunShape.of_infos`)."""
        if run.version >= 0 or run.init_claim != ticket.peer:
            received.staged.discard()
            raise Conflict(f"run {run.name!r} was initialised by another peer", current_version=run.version)
        schema = shape.schema
        try:
            self.store.publish_initial(received.staged, run.name, schema)
        finally:
            received.staged.discard()
        run.schema, run.shape, run.version, run.init_claim = schema, shape, 0, None
        run.policy.begin(0)
        log.info("version0 run=%s peer=%s tensors=%d bytes=%d", run.name, ticket.peer, len(schema), received.nbytes)
        return InitialVersion(len(schema), received.nbytes)

    # ---- updates -------------------------------------------------------------------------
    async def update_ticket(
        self,
        run: Run,
        round_: int,
        peer: str,
        digest: str | None,
        samples: int,
        metrics: dict[str, float],
        *,
        key: str | None = None,
        supersede: bool = False,
        final: bool = False,
    ) -> Ticket:
        """Check an update may be sent before its body is read; a repeat gets its old ack.
        The body's partial is named by ``key`` (``Upload-Key``) if given, else by ``digest``;
        one of them is. With ``supersede`` (a PUT, not a HEAD), what the peer held of other
        updates for this round goes: it gave up on them."""
        if not 1 <= samples <= MAX_SAMPLES:
            raise InvalidUpdate(f"samples must be a count from 1 to {MAX_SAMPLES}, got {samples}")
        repeat = self._acknowledged(run, round_, peer, digest)
        if repeat is not None:
            return Ticket(run.name, round_, peer, digest, samples, metrics, 0, _refuse_body, acknowledged=repeat)
        await self.check_open(run, round_)
        assert run.shape is not None  # set with the schema: O(schema) once, not per request
        layout = run.shape.layout

        def check(infos: dict[str, TensorInfo]) -> None:  # in a worker thread (uploads.receive)
            check_layout(infos, layout)

        name = f"key-{key}" if key is not None else digest
        assert name is not None
        upload = self.store.resumable_upload(run.name, round_, peer, name, supersede=supersede)
        return Ticket(
            run.name, round_, peer, digest, samples, metrics, run.shape.max_update_bytes, check, upload, final=final
        )

    def _acknowledged(self, run: Run, round_: int, peer: str, digest: str | None) -> Acknowledgement | None:
        """Idempotency: the same update again is harmless, a different one is a conflict. An
        update is named by the version it was computed from (``round_``), which is also the round
        it is merged in but in async runs. A body without its digest yet cannot tell: None."""
        if digest is None:
            return None
        previous = run.acked.get(peer)
        if previous is None or previous.base != round_:
            previous = self.store.update_from(run.name, peer, round_)
        if previous is None:
            return None
        if previous.digest != digest:
            raise Conflict(
                f"peer {peer!r} already has a different update acknowledged for round {round_}",
                current_version=run.version,
            )
        return Acknowledgement.of(previous, repeat=True)

    def acknowledged_before(self, run: Run, round_: int, peer: str, digest: str) -> Acknowledgement | None:
        """The acknowledgement of this very update if it was acknowledged before (a retry)."""
        return self._acknowledged(run, round_, peer, digest)

    async def check_open(self, run: Run, round_: int) -> None:
        """Raise unless the open round takes an update computed from version ``round_``."""
        if run.version < 0 or not run.sealed:
            raise Conflict(f"run {run.name!r} has not started yet", current_version=run.version)
        if run.closing and run.policy.place(round_) is Place.OPEN:
            # the open round is closing without this update: answer once the new version exists,
            # so that a late peer's catch-up finds it (and an async update goes into the next one)
            while run.closing:
                await run.changed.wait()
        place = run.policy.place(round_)
        if place is Place.CLOSED:
            raise RoundClosed(
                f"round {round_} closed without this update; the run is at version {run.version}",
                current_version=run.version,
            )
        if place is Place.STALE:
            raise StaleUpdate(
                f"an update computed from version {round_} is {run.version - round_} versions old, over this "
                f"run's max_staleness of {run.config.max_staleness}: it was not applied; pull the model",
                current_version=run.version,
                max_staleness=run.config.max_staleness,
            )
        if place is Place.AHEAD:
            raise Conflict(
                f"round {round_} is not open; the run is at version {run.version}", current_version=run.version
            )

    @contextlib.contextmanager
    def uploading(self, run: Run, peer: str) -> Iterator[None]:
        """The peer's update body is streaming in (the dashboard shows it)."""
        run.uploading.add(peer)
        self.view.changed(run)
        try:
            yield
        finally:
            run.uploading.discard(peer)
            self.view.changed(run)

    async def commit_update(self, run: Run, ticket: Ticket, received: Received) -> Acknowledgement:
        """Acknowledge a fully received update: verify, make durable, record, fold."""
        try:
            assert ticket.digest is not None  # the route holds a body that comes without one
            if received.digest != ticket.digest:
                raise BadRequest(f"body digest sha-256 {received.digest} does not match Content-Digest {ticket.digest}")
            # a codec whose decoder can refuse well-formed, finite parts (topk's offsets) is decoded
            # once here: a bad update is a 422 now, not a fold that fails after its acknowledgement
            checked = run.config.norm_guard or run.codec.check_on_receipt
            norm = await to_thread.run_sync(self._norm, run, received) if checked else None
            update = await self._admit(run, ticket, received.nbytes, received.seconds, norm)
            if isinstance(update, Acknowledgement):
                return update
            self.store.acknowledge(received.staged, run.name, update)  # the acknowledgement's commit point
        finally:
            received.staged.discard()
        return await self._counted(run, ticket, update, norm)

    async def commit_object(
        self, run: Run, ticket: Ticket, name: str, nbytes: int, seconds: float, norm: float | None
    ) -> Acknowledgement:
        """Acknowledge an update a peer uploaded to the object store as ``name``, its body checked
        already (:func:`syncserver.reduce.check.check_update`: ``nbytes``, ``norm``): the same
        admission and record as a body PUT to the hub, the record naming the object. A ``repeat``
        acknowledgement: the same update was acknowledged before, and ``name`` is not recorded."""
        update = await self._admit(run, ticket, nbytes, seconds, norm, name)
        if isinstance(update, Acknowledgement):
            return update
        self.store.record_update(run.name, update)  # the acknowledgement's commit point
        return await self._counted(run, ticket, update, norm)

    async def _admit(
        self, run: Run, ticket: Ticket, nbytes: int, seconds: float, norm: float | None, name: str | None = None
    ) -> UpdateRecord | Acknowledgement:
        """The checks a checked body passes before it counts (the round still takes it, the norm
        guard): its record to store, or the acknowledgement of the same update stored before."""
        assert ticket.digest is not None
        repeat = self._acknowledged(run, ticket.round, ticket.peer, ticket.digest)
        if repeat is not None:
            return repeat
        await self.check_open(run, ticket.round)
        if ticket.peer in run.acked:  # async: its previous update waits for a close that failed
            raise Conflict(
                f"peer {ticket.peer!r} has an update waiting to be applied in round {run.version}; "
                "send this one once that round has closed",
                current_version=run.version,
            )
        self._guard(run, ticket.peer, norm)
        return UpdateRecord(
            ticket.peer,
            run.version,
            self.store.next_seq(run.name),
            ticket.digest,
            ticket.samples,
            ticket.metrics,
            nbytes,
            time.time(),
            seconds,
            base=ticket.round,
            final=ticket.final,
            object=name,
        )

    async def _counted(self, run: Run, ticket: Ticket, update: UpdateRecord, norm: float | None) -> Acknowledgement:
        """A recorded update counts: in the open round, the peer's figures, the policy, the fold."""
        run.acked[ticket.peer] = update
        if norm is not None:
            run.norms[ticket.peer] = norm
        if run.opened is None:
            run.opened = update.received
        peer = run.peers[ticket.peer]
        reports = peer.last_progress is not None
        if not reports and peer.last_update_at is not None and update.received > peer.last_update_at:
            peer.rate = ticket.samples / (update.received - peer.last_update_at)
        peer.last_update_at = update.received
        peer.samples += ticket.samples
        peer.bytes_up += update.nbytes
        run.traffic.up["hub" if update.object is None else "store"] += update.nbytes
        log.info(
            "update_acked run=%s round=%d base=%d peer=%s samples=%d mb=%.3f upload_s=%.3f via=%s",
            run.name,
            update.round,
            update.base,
            ticket.peer,
            ticket.samples,
            update.nbytes / 1e6,
            update.seconds,
            "hub" if update.object is None else "store",
        )
        # a close starts at once, and its merge folds what is not folded yet; otherwise this
        # update is folded now, behind the uploads still under way
        self.carry_out(run, run.policy.acknowledged(ticket.peer, now(), ticket.samples))
        self.view.updated(run, update)
        await self._fold_pending(run)
        self.decide(run)  # the fold took time: a deadline may have passed meanwhile
        return Acknowledgement.of(update)

    def _norm(self, run: Run, received: Received) -> float:
        """Worker thread: the update's L2 norm as decoded. (NaN/Inf were refused as it streamed in.)"""
        assert run.schema is not None
        with received.staged.reader() as wire:
            try:
                return self.engine.norm(wire, run.codec, run.schema)
            except FormatError as exc:
                raise InvalidUpdate(str(exc)) from None

    def _guard(self, run: Run, peer: str, norm: float | None) -> None:
        """The poisoned-update guard: refuse an update far above the usual norm, before it is
        acknowledged, so that it never reaches the average; the round stops waiting for its peer."""
        factor = run.config.norm_guard
        if factor is None or norm is None:
            return
        median = aggregate.norm_outlier(norm, [*run.previous_norms, *run.norms.values()], factor)
        if median is None:
            return
        log.warning(
            "update_rejected run=%s round=%d peer=%s norm=%.4g median=%.4g factor=%g",
            run.name,
            run.version,
            peer,
            norm,
            median,
            factor,
        )
        self.carry_out(run, run.policy.refuse(peer, now()))
        self.view.changed(run)
        raise PoisonedUpdate(
            f"update norm {norm:.4g} is over {factor:g} x the median {median:.4g} of accepted updates; "
            "it was not applied",
            norm=norm,
            median=median,
            factor=factor,
        )

    # ---- folding and closing -------------------------------------------------------------
    async def _fold_pending(self, run: Run) -> None:
        """Fold every acknowledged, not yet folded update, in acknowledgement order, until the
        round closes: from then on its merge folds the rest. With reducers they fold ahead, in
        a task of its own: an acknowledgement never waits on a reducer."""
        if self.ahead is not None:
            under_way = self._folding.get(run.name)
            if under_way is None or under_way.done():  # else it folds what came meanwhile, next
                self._folding[run.name] = self._spawn(self._fold_ahead(run, self.ahead))
            return

        def closing() -> bool:
            return run.closing

        async with run.fold_lock:
            acc = run.accumulator()
            for update in sorted(run.acked.values(), key=lambda u: u.seq):
                if run.closing:
                    return
                if update.peer not in acc.folded:
                    key = UpdateKey.of(run.name, update)
                    weight = run.policy.weight(update.samples, update.base, update.round)
                    # a first fold stops when the round closes: the merge then folds every update
                    stop = closing if not acc.folded else None
                    fold = functools.partial(self.engine.fold, acc, key, weight, run.codec, stop=stop)
                    if not await to_thread.run_sync(fold):
                        return

    async def _fold_ahead(self, run: Run, ahead: FoldAhead) -> None:
        """The reducers fold every acknowledged, not yet folded update, in acknowledgement order,
        a step at a time (:class:`~syncserver.core.leases.FoldAhead`; a step folds all that came
        meanwhile), until the round closes: its merge leases fold the rest. A step that fails
        costs nothing but time: the merge folds what it did not."""
        async with run.fold_lock:
            while not run.closing and run.schema is not None:
                acc = run.accumulator()
                pending = [u for u in sorted(run.acked.values(), key=lambda u: u.seq) if u.peer not in acc.folded]
                if not pending:
                    return  # the next acknowledgement starts the next step
                updates = [
                    (u.peer, UpdateKey.of(run.name, u), run.policy.weight(u.samples, u.base, u.round)) for u in pending
                ]
                try:
                    await ahead.fold(run.name, run.version, acc, run.codec, updates)
                except Exception as exc:
                    log.warning(
                        "fold_ahead_failed run=%s round=%d (the merge folds the rest): %r", run.name, run.version, exc
                    )
                    return

    async def _stop_folding_ahead(self, run: Run) -> None:
        """The round closes: wait for the reducers' fold step under way (the merge then folds
        less), but stop it while any of its leases waits for a reducer (none free, or none at
        all: the merge's own leases are next in line, and nothing folded is lost)."""
        task = self._folding.get(run.name)
        assert self.ahead is not None
        while task is not None and not task.done():
            if self.ahead.board.offered(run.name, FoldJob):
                task.cancel()
            await asyncio.wait({task}, timeout=0.05)

    def decide(self, run: Run) -> None:
        """Ask the policy again (time passed); not while a failed close waits to retry."""
        if now() >= run.close_retry_at:
            self.carry_out(run, run.policy.decide(now()))

    def carry_out(self, run: Run, close: Close | None) -> None:
        if close is not None:
            self._spawn(self._close(run, close))

    async def _close(self, run: Run, close: Close) -> None:
        started = time.monotonic()
        try:
            if self.ahead is not None:
                await self._stop_folding_ahead(run)
            async with run.fold_lock:  # a fold under way ends (a first fold stops); the merge folds the rest
                folded = time.monotonic()
                if self.bucket is not None and self.leased is not None:
                    await self._version_in_bucket(run, close.round)  # the reducers read it there
                elif not self.store.exists(VersionKey(run.name, close.round)):
                    await self.versions.written(run)  # the merge checks version v + its result
                result_bytes, left_out, copies, peaks = await merge_finite(
                    self.engine, run, close.round, close.participants, self.leased
                )
            merged = time.monotonic()
            # the copy peers will fetch goes up before the commit announces the result (unless the
            # reducers wrote it there); if the store fails, the round closes all the same and peers
            # get the hub's copy
            uploaded = None
            if self.bucket is not None and not copies:
                uploaded = await to_thread.run_sync(self.bucket.upload, ResultKey(run.name, close.round))
            participants = [name for name in close.participants if name not in left_out]
            updates = [run.acked[name] for name in participants]
            assert run.opened is not None
            record = RoundRecord(
                round=close.round,
                opened=run.opened,
                closed=time.time(),
                participants=participants,
                dropped=[*close.dropped, *left_out],
                samples=sum(u.samples for u in updates),
                bytes_in=sum(u.nbytes for u in updates),
                result_bytes=result_bytes,
                timings={
                    "fold": folded - started,
                    "merge": merged - folded,
                    **({"publish": time.monotonic() - merged} if self.bucket is not None else {}),
                },
            )
            self.store.commit_round(run.name, record, [uploaded] if uploaded is not None else copies)
        except Exception as exc:
            self._close_failed(run, close, exc)
            return
        run.close_failures, run.close_retry_at = 0, 0.0
        run.policy.committed(close)
        run.version = close.round + 1
        run.peaks = (run.version, peaks) if peaks else None
        run.acked, run.acc, run.opened = {}, None, None
        if run.norms:
            # the guard's reference: this round's norms and the previous round's; async rounds
            # hold one update or a few, so there the last ASYNC_NORMS accepted ones
            kept = [*run.previous_norms, *run.norms.values()][-ASYNC_NORMS:] if run.config.policy == "async" else []
            run.previous_norms = kept or list(run.norms.values())
        run.norms = {}
        for name in close.dropped:
            log.warning("straggler_dropped run=%s round=%d peer=%s", run.name, close.round, name)
        log.info(
            "round_closed run=%s round=%d version=%d peers=%d dropped=%d samples=%d mb_in=%.3f mb_out=%.3f "
            "fold_s=%.3f merge_s=%.3f wall_s=%.3f",
            run.name,
            close.round,
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
        if uploaded is not None:
            self.view.stored(run, uploaded.size)
        self.versions.start(run)
        self.view.closed(run, record)

    async def _version_in_bucket(self, run: Run, v: int) -> None:
        """Version ``v`` has a copy in the bucket, where reducers on other machines read it: the
        reducers built it after the last commit (every round but the first; waited for here, in
        the rare case that the build is still going), or the hub uploads it now (version 0).
        :class:`Unavailable` if the store fails (the close is tried again after its backoff)."""
        assert self.bucket is not None
        key = VersionKey(run.name, v)
        if self.store.stored_object(key) is None and not self.store.exists(key):
            await self.versions.written(run)
        if self.store.stored_object(key) is not None:
            return
        record = await to_thread.run_sync(self.bucket.upload, key)
        if record is None:
            raise Unavailable(f"the object store {self.bucket.url} is down: version {v} cannot reach the reducers")
        self.store.record_object(record)
        self.view.stored(run, record.size)

    def _close_failed(self, run: Run, close: Close, exc: Exception) -> None:
        """The round stays open (say the disk is full) and is decided again after a backoff
        (1 s, doubling, at most CLOSE_RETRY_MAX): a failing close must not spin, nor log a
        traceback on every tick. The traceback is logged once per round, then one line."""
        run.close_failures += 1
        delay = min(CLOSE_RETRY_MAX, 2.0 ** (run.close_failures - 1))
        run.close_retry_at = now() + delay
        if run.close_failures == 1:
            log.exception("round_close_failed run=%s round=%d (will retry in %.0fs)", run.name, close.round, delay)
        else:
            log.warning(
                "round_close_failed run=%s round=%d failures=%d (will retry in %.0fs): %r",
                run.name,
                close.round,
                run.close_failures,
                delay,
                exc,
            )
        run.policy.abandoned()
        self.view.changed(run)

    def gone(self, run: Run, round_: int) -> Gone:
        return Gone(f"round {round_}'s result was pruned; pull the model", current_version=run.version)


class VersionFiles:
    """Writes the file of each committed version after its commit (``version v + decode(result
    v)``), then prunes; pulls of a version wait for its file. With a store and reducers
    (``built``), the reducers build each version in the bucket instead (build leases) and the
    hub records it: the hub's disk holds no version but the first."""

    def __init__(
        self,
        settings: HubSettings,
        store: Store,
        engine: MergeEngine,
        spawn: Spawn,
        bucket: Bucket | None = None,
        built: Built | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self._spawn = spawn
        self.bucket = bucket
        self.built = built

    def start(self, run: Run) -> None:
        """Start writing the files of the committed versions that have none (after a commit,
        or at start after a crash between a commit and its version's rename), then prune."""
        if run.writing is None or run.writing.done():
            run.writing = self._spawn(self._write(run))
            run.writing.add_done_callback(_log_version_failure)

    async def _write(self, run: Run) -> None:
        assert run.schema is not None
        while True:
            target = run.version
            if self.built is not None:
                await self._build_in_bucket(run, target)
            elif not self.only_in_bucket(run, target):
                await to_thread.run_sync(self.engine.build_versions, run.name, target, run.codec, run.schema)
            with contextlib.suppress(Exception):  # housekeeping: a failure here loses nothing
                self.store.prune(run.name, target, self.settings.keep_versions, run.keep_results)
                if self.bucket is not None:  # the bucket keeps what the disk keeps
                    keep = self.settings.keep_versions
                    floor = target - keep + 1
                    gone = self.bucket.prune(run.name, floor, target - max(keep, run.keep_results or 0) + 1)
                    if gone:
                        await to_thread.run_sync(self.bucket.delete, run.name, gone)
            if run.version == target:  # else rounds closed meanwhile
                return

    async def _build_in_bucket(self, run: Run, target: int) -> None:
        """Have the reducers build every version up to ``target`` that the bucket lacks, from the
        last one it has and the rounds' results there, each recorded once built (it counts from
        then on; a hub killed before that builds it again at its start)."""
        assert self.built is not None and run.schema is not None
        first = target
        while first > 0 and self.store.stored_object(VersionKey(run.name, first)) is None:
            first -= 1
        for v in range(first, target):
            record, peaks = await self.built(run.name, v, run.schema, run.codec)
            self.store.record_object(record)
            run.peaks = (v + 1, peaks)  # exact: the next merge's bound
            log.info("version_built run=%s version=%d mb=%.1f by=reducers", run.name, v + 1, record.size / 1e6)

    def only_in_bucket(self, run: Run, v: int) -> bool:
        """Is version ``v`` in the bucket only (reducers wrote it there, and the hub has not the
        result it would build it from)? Then the hub has no file of it to write, nor to serve."""
        return (
            self.bucket is not None
            and v > 0
            and not self.store.exists(VersionKey(run.name, v))
            and not self.store.exists(ResultKey(run.name, v - 1))
            and self.store.stored_object(VersionKey(run.name, v)) is not None
        )

    async def written(self, run: Run) -> None:
        """Until the version files being written are (re-raising the failure of that write)."""
        self.start(run)
        assert run.writing is not None
        await asyncio.shield(run.writing)


def _log_version_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        # the results are durable, so nothing is lost: the next pull or commit retries
        log.error("version_write_failed: %r (will retry)", task.exception())
