"""Receiving updates and closing rounds: admission, acknowledgement, the norm guard, the close.

An update is acknowledged once complete, verified, durable and recorded in sqlite; then folded in
acknowledgement order (a restarted hub rebuilds the same sums from the files), or by the close's
merge. The policy says when a round closes, the workers fold, merge and build, the plane publishes.
A round commits once its result is durable; version v+1 is built after (rebuilt at start if cut).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from anyio import to_thread

from syncserver.core.changes import Tasks
from syncserver.core.finite import merge_finite
from syncserver.core.interval import KEPT, Pace
from syncserver.core.planes import LocalPlane
from syncserver.core.policy import Close, Place
from syncserver.core.samedata import same_data
from syncserver.core.shape import RunShape
from syncserver.core.state import Run, Via, now
from syncserver.core.view import HubView
from syncserver.core.workers import Workers
from syncserver.errors import BadRequest, Conflict, InvalidUpdate, PoisonedUpdate, RoundClosed, StaleUpdate
from syncserver.limits import MAX_SAMPLES
from syncserver.records import RoundRecord, UpdateRecord
from syncserver.reduce import aggregate
from syncserver.reduce.engine import MergeEngine
from syncserver.settings import HubSettings
from syncserver.storage.store import ResultKey, Store, Upload, VersionKey
from syncserver.storage.uploads import Received
from syncwire import FormatError, TensorInfo, check_layout
from syncwire.runsettings import FLUSH_KEY

__all__ = ["Acknowledgement", "InitialVersion", "Rounds", "Ticket"]

log = logging.getLogger(__name__)

CLOSE_RETRY_MAX = 30.0  # seconds between two tries at a close that keeps failing
ASYNC_NORMS = 8  # the norm guard's reference in async runs: the last accepted updates' norms


@dataclass
class Ticket:
    """Permission to stream one body: its shape and destination (held already: its acknowledgement)."""

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
    """An update is durable and counted in round ``round`` (``repeat``: its first acknowledgement again)."""

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

    def __init__(self, settings: HubSettings, store: Store, view: HubView, plane: LocalPlane, workers: Workers) -> None:
        self.settings = settings
        self.store = store
        self.view = view
        self.plane = plane  # where the bytes live
        self.workers = workers  # who folds and merges
        self.tasks = Tasks()  # the closes under way

    def recover(self, run: Run) -> None:
        """Reload the open round's acknowledged updates (a restart), the interval picked last, and
        rebuild missing versions."""
        if run.version < 0:
            return
        run.pacer.restore(self.store.rounds(run.name, KEPT))
        if run.pacer.current is not None:  # a samples run's next round: the size picked last
            run.policy.resize(run.pacer.current.every)
        for update in self.store.updates(run.name, run.version):
            run.acked[update.peer] = update
            run.policy.restore_update(update.peer, now(), update.samples)  # its deadline starts afresh
        run.opened = min((u.received for u in run.acked.values()), default=None)
        if run.version > 0 and not self.store.exists(VersionKey(run.name, run.version)):
            self.workers.start_versions(run)  # killed between a commit and its version's rename

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
        """Check an update may be sent before its body is read (a repeat gets its old ack); its partial
        is named by ``key``, else ``digest``. ``supersede`` (a PUT): the peer's other partials go."""
        if not 1 <= samples <= MAX_SAMPLES:
            raise InvalidUpdate(f"samples must be a count from 1 to {MAX_SAMPLES}, got {samples}")
        repeat = self.acknowledged(run, round_, peer, digest)
        if repeat is not None:
            return Ticket(run.name, round_, peer, digest, samples, metrics, 0, _refuse_body, acknowledged=repeat)
        await self.check_open(run, round_)
        assert run.shape is not None  # set with the schema: O(schema) once, not per request
        check = functools.partial(check_layout, expected=run.shape.layout)  # in a worker thread
        name = f"key-{key}" if key is not None else digest
        assert name is not None
        upload = self.store.resumable_upload(run.name, round_, peer, name, supersede=supersede)
        return Ticket(
            run.name, round_, peer, digest, samples, metrics, run.shape.max_update_bytes, check, upload, final=final
        )

    def acknowledged(self, run: Run, round_: int, peer: str, digest: str | None) -> Acknowledgement | None:
        """Idempotency: the same update again is harmless, a different one a conflict. An update is
        named by its base version (``round_``: its round but in async runs). No digest yet: None."""
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

    async def check_open(self, run: Run, round_: int) -> None:
        """Raise unless the open round takes an update computed from version ``round_``."""
        if run.version < 0 or not run.sealed:
            raise Conflict(f"run {run.name!r} has not started yet", current_version=run.version)
        if run.closing and run.policy.place(round_) is Place.OPEN:
            # closing without it: answer once the new version exists (a late peer's catch-up finds it)
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
            norm = await to_thread.run_sync(self._norm, run, received) if run.checks_norm else None
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
        """Acknowledge an update uploaded to the store as ``name``, its body checked already: as a PUT,
        the record naming the object (a ``repeat`` acknowledgement: ``name`` not recorded)."""
        update = await self._admit(run, ticket, nbytes, seconds, norm, name)
        if isinstance(update, Acknowledgement):
            return update
        self.store.record_update(run.name, update)  # the acknowledgement's commit point
        return await self._counted(run, ticket, update, norm)

    async def _admit(
        self, run: Run, ticket: Ticket, nbytes: int, seconds: float, norm: float | None, name: str | None = None
    ) -> UpdateRecord | Acknowledgement:
        """The round takes it, the norm guard passes: its record, or the same update's acknowledgement."""
        assert ticket.digest is not None
        repeat = self.acknowledged(run, ticket.round, ticket.peer, ticket.digest)
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
        if run.same_data is None and (found := same_data(update, run.acked.values(), run.norms)) is not None:
            run.same_data = found  # once per run: the dashboard and status keep showing it
            log.warning(
                "same_data run=%s round=%d peers=%s,%s equal=%s: %s",
                run.name,
                found.round,
                *found.peers,
                found.by,
                found.message,
            )
        peer = run.peers[ticket.peer]
        last = peer.last_update_at  # the rate between two updates, unless the peer reports progress
        if peer.last_progress is None and last is not None and update.received > last:
            peer.rate = ticket.samples / (update.received - last)
        peer.last_update_at = update.received
        peer.samples += ticket.samples
        run.ledger.acknowledged(ticket.peer, update.base, 0 if FLUSH_KEY in update.metrics else ticket.samples)
        peer.bytes_up += update.nbytes
        via: Via = "hub" if update.object is None else "store"
        run.traffic.up[via] += update.nbytes
        log.info(
            "update_acked run=%s round=%d base=%d peer=%s samples=%d mb=%.3f upload_s=%.3f via=%s",
            run.name,
            update.round,
            update.base,
            ticket.peer,
            ticket.samples,
            update.nbytes / 1e6,
            update.seconds,
            via,
        )
        # a close starts at once and its merge folds the rest; else this update is folded now
        self.carry_out(run, run.policy.acknowledged(ticket.peer, now(), ticket.samples))
        self.view.updated(run, update)
        await self.workers.fold(run)
        self.decide(run)  # the fold took time: a deadline may have passed meanwhile
        return Acknowledgement.of(update)

    def _norm(self, run: Run, received: Received) -> float:
        """Worker thread: the update's L2 norm as decoded. (NaN/Inf were refused as it streamed in.)"""
        assert run.schema is not None
        with received.staged.reader() as wire:
            try:
                return MergeEngine.norm(wire, run.codec, run.schema)
            except FormatError as exc:
                raise InvalidUpdate(str(exc)) from None

    def _guard(self, run: Run, peer: str, norm: float | None) -> None:
        """Refuse an update far above the usual norm before it counts; the round stops waiting for it."""
        factor = run.config.norm_guard
        if factor is None or norm is None:
            return
        if (median := aggregate.norm_outlier(norm, [*run.previous_norms, *run.norms.values()], factor)) is None:
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

    # ---- closing ------------------------------------------------------------------------
    def decide(self, run: Run) -> None:
        """Ask the policy again (time passed); not while a failed close waits to retry."""
        if now() >= run.close_retry_at:
            self.carry_out(run, run.policy.decide(now()))

    def carry_out(self, run: Run, close: Close | None) -> None:
        if close is not None:
            self.tasks.spawn(self._close(run, close))

    async def _close(self, run: Run, close: Close) -> None:
        started = time.monotonic()
        try:
            await self.workers.settle(run)
            async with run.fold_lock:  # a fold under way ends (a first fold stops); the merge folds the rest
                folded = time.monotonic()
                await self.workers.base(run, close.round)  # the merge checks version v + its result
                result_bytes, left_out, copies, peaks = await merge_finite(
                    self.workers.engine, run, close.round, close.participants, self.workers.merge
                )
            merged = time.monotonic()
            copies, publish = await self.plane.publish(run, ResultKey(run.name, close.round), copies)
            participants = [name for name in close.participants if name not in left_out]
            updates = [run.acked[name] for name in participants]
            assert run.opened is not None
            interval = run.pacer.decide(close.round, _paces(run, updates), time.monotonic() - started)
            record = RoundRecord(
                round=close.round,
                opened=run.opened,
                closed=time.time(),
                participants=participants,
                dropped=[*close.dropped, *left_out],
                samples=sum(u.samples for u in updates),
                bytes_in=sum(u.nbytes for u in updates),
                result_bytes=result_bytes,
                timings={"fold": folded - started, "merge": merged - folded, **publish},
                interval=None if interval is None else interval.as_dict(),
            )
            next_round = close.round + 1  # an update from a base it does not take never comes: lost
            lost = run.ledger.lost(lambda base: run.policy.place(base, next_round) is Place.OPEN)
            self.store.commit_round(run.name, record, copies, lost)
        except Exception as exc:
            self._close_failed(run, close, exc)
            return
        run.close_failures, run.close_retry_at = 0, 0.0
        run.ledger.book(lost)
        run.policy.committed(close)
        if interval is not None:
            run.policy.resize(interval.every)
        run.version = close.round + 1
        run.peaks = (run.version, peaks) if peaks else None
        run.acked, run.acc, run.opened = {}, None, None
        if run.norms:
            # the guard's reference: this round's norms and the previous round's (async: the last ASYNC_NORMS)
            kept = [*run.previous_norms, *run.norms.values()][-ASYNC_NORMS:] if run.config.policy == "async" else []
            run.previous_norms = kept or list(run.norms.values())
        run.norms = {}
        for name in close.dropped:
            log.warning("straggler_dropped run=%s round=%d peer=%s", run.name, close.round, name)
        for loss in lost:
            said = "samples_lost run=%s round=%d peer=%s samples=%d"
            log.warning(said, run.name, loss.round, loss.peer, loss.samples)
        if interval is not None:
            log.info("interval run=%s round=%d %s", run.name, close.round, interval.why(run.policy.unit))
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
        self.workers.start_versions(run)
        self.view.closed(run, record)

    def _close_failed(self, run: Run, close: Close, exc: Exception) -> None:
        """The round stays open (say the disk is full), decided again after a backoff (1 s, doubling,
        at most CLOSE_RETRY_MAX) so as not to spin; its traceback logged once, then one line."""
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


def _paces(run: Run, updates: list[UpdateRecord]) -> list[Pace]:
    """What a close's interval decision reads: each update's pace, with its upload and the download
    of the result before (the hub measured both)."""
    paces = []
    for u in updates:
        previous = run.downloads.get(u.round - 1, {}).get(u.peer)
        pace = Pace.of(u.peer, u.metrics, u.seconds, None if previous is None else previous[1] - previous[0])
        if pace is not None:
            paces.append(pace)
    return paces
