"""The hub's board of **work leases** (no HTTP: :mod:`syncserver.api.reduce` translates), units of
work that reducers (``SYNC_REDUCERS``) take, renew and report; "lease" alone is a peer's liveness.

One record (:class:`_Work`), one queue, one expiry, for every kind of work
(:data:`~syncserver.reduce.lease.KINDS`): a merge cut into at most K spans (:func:`merge_leased`),
a fold step (:class:`FoldAhead`), a version's build (:func:`build_leased`), an uploaded body's
check (:meth:`Board.check`, first in line: a peer waits on it). A lease not renewed within
``SYNC_REDUCE_LEASE_SECONDS`` is offered again, first, under a new id (redone to the same bits; the
old id's report is :class:`~syncserver.errors.LeaseLost`). With no reducer for a lease length the
hub works the slice leases itself and gives a check back to its caller. docs/object-store.md and
docs/RELIABILITY.md tell the rest.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from anyio import to_thread

from syncserver.core.changes import Changes, until
from syncserver.errors import LeaseLost, NotFound
from syncserver.reduce.checklease import CheckJob, CheckReport
from syncserver.reduce.engine import Accumulator, Into, MergeEngine, NonFinite, Resident, RoundMerge, version_layout
from syncserver.reduce.lease import (
    Done,
    FoldJob,
    MergeJob,
    ObjectOutput,
    UpdateSource,
    WorkJob,
    build_jobs,
    fold_jobs,
    highest,
    jobs,
    work,
)
from syncserver.storage.bucket import object_name
from syncserver.storage.s3 import ObjectStore, StoreError
from syncserver.storage.store import Key, ObjectRecord, ResultKey, Stored, UpdateKey, VersionKey
from syncwire import Codec, Schema

__all__ = [
    "CHECK_TRIES",
    "LEASE_POLL_MAX",
    "Board",
    "FoldAhead",
    "LeaseFailed",
    "ReducerStats",
    "build_leased",
    "merge_into_bucket",
    "merge_leased",
]

log = logging.getLogger(__name__)

GONE_KEPT = 4096  # ids of leases gone remembered, to answer a late report 409, not 404
HUB = "hub"  # the name under which the hub works a lease itself (no reducer for a lease length)
LEASE_POLL_MAX = 60.0  # the longest a reducer's poll for a lease is held, in seconds
CHECK_TRIES = 3  # a check lease lost this many times (reducers dying on that body?) is checked by the hub
AFFINITY_SECONDS = 2.0  # a lease over a mean's slices waits this long for their holder before another folds them


class LeaseFailed(RuntimeError):
    """A reducer could not do its lease (an I/O error, say): the close fails and is retried."""


@dataclass
class ReducerStats:
    """What the hub knows of one reducer, by the name it gives (for /metrics, status)."""

    name: str
    first_seen: float
    last_seen: float
    leases: int = 0  # done and used
    expired: int = 0  # taken, then not renewed in time
    seconds: float = 0.0  # the done leases' work, summed
    last_seconds: float | None = None  # the last done lease's
    bytes: int = 0
    holding: str | None = None  # the lease it works on
    checks: int = 0  # check leases reported
    check_seconds: float = 0.0
    check_failures: int = 0  # check reports the hub could not take (its own check ruled instead)


@dataclass(eq=False)
class _Batch:
    """Work offered together, awaited by one caller; ``urgent`` (a check) goes first, and is given back."""

    run: str
    urgent: bool = False
    work: list[_Work] = field(default_factory=list)
    offered: float = field(default_factory=time.monotonic)  # when its work was last put on offer
    changed: Changes = field(default_factory=Changes)  # taken, reported: its caller looks again
    failure: BaseException | None = None
    expired: int = 0


@dataclass(eq=False)
class _Work:
    """One work lease: offered (queued), held (``holder``, until ``deadline``), or reported."""

    job: WorkJob
    batch: _Batch
    prefer: str | None = None  # the reducer that holds its slices of the round's mean, offered it first
    holder: str | None = None
    deadline: float = 0.0
    report: Done | CheckReport | None = None


class Board:
    """Every work lease of one hub: offered, held, reported; and the reducers heard from."""

    def __init__(self, lease_seconds: float, objects: Callable[[], ObjectStore] | None = None) -> None:
        self.lease_seconds = lease_seconds
        self.objects = objects  # SYNC_STORE: where the hub reads updates in the bucket, working a lease itself
        self._queue: deque[_Work] = deque()  # offered
        self._held: dict[str, _Work] = {}  # by lease id
        self._gone: dict[str, None] = {}  # ids no longer valid (insertion-ordered, bounded)
        self._offered = Changes()  # work offered: the polls look again
        self._waiting: Counter[str] = Counter()  # reducers waiting for a lease right now, by name
        self._stopping = False  # the server is shutting down: polls answer at once (end_polls)
        self._active = time.monotonic()  # when a reducer last asked, renewed or reported
        self.reducers: dict[str, ReducerStats] = {}

    # ---- the reducers' side --------------------------------------------------------------
    def _seen(self, reducer: str) -> ReducerStats:
        t = time.time()
        self._active = time.monotonic()
        stats = self.reducers.get(reducer)
        if stats is None:
            stats = self.reducers[reducer] = ReducerStats(reducer, t, t)
            log.info("reducer_seen reducer=%s", reducer)
        stats.last_seen = t
        return stats

    def end_polls(self) -> None:
        """The server is shutting down: the reducers' polls answer "no lease" now."""
        self._stopping = True
        self._offered.notify()

    async def take(self, reducer: str, wait: float) -> WorkJob | None:
        """The next work lease offered (:meth:`_next`), held by ``reducer`` from now; None after ``wait`` seconds."""
        self._seen(reducer)
        self._waiting[reducer] += 1
        try:  # looked at every AFFINITY_SECONDS / 4 too: a holder that goes quiet frees its leases
            await until(
                lambda: self._stopping or bool(self._next(reducer)), self._offered, wait, every=AFFINITY_SECONDS / 4
            )
        finally:
            self._waiting -= Counter({reducer: 1})  # drops it at zero
        stats = self._seen(reducer)  # it was there all along
        work = self._next(reducer)
        if work is None:
            return None
        self._queue.remove(work)
        job = work.job = work.job.model_copy(update={"lease": uuid.uuid4().hex, "seconds": self.lease_seconds})
        work.holder, work.deadline = reducer, time.monotonic() + self.lease_seconds
        self._held[job.lease] = work
        stats.holding = job.lease
        work.batch.changed.notify()  # its caller waits on the new deadline
        log.info("work_lease_taken kind=%s run=%s round=%d lease=%s reducer=%s", *_said(job), reducer)
        return job

    def _next(self, reducer: str) -> _Work | None:
        """Urgent work first, then work that prefers ``reducer``, then work whose holder is not around
        (not asking or holding, unheard for :data:`AFFINITY_SECONDS`): it folds those slices again."""
        free = (w for w in self._queue if w.prefer in (None, reducer) or not self._around(w.prefer))
        return min(free, key=lambda w: (not w.batch.urgent, w.prefer != reducer), default=None)

    def _around(self, reducer: str) -> bool:
        stats = self.reducers.get(reducer)
        return (
            reducer in self._waiting
            or any(x.holder == reducer for x in self._held.values())
            or (stats is not None and time.time() - stats.last_seen <= AFFINITY_SECONDS)
        )

    def renew(self, lease_id: str, reducer: str) -> float:
        """Extend ``reducer``'s lease; the seconds it now has. :class:`LeaseLost` once lost."""
        self._seen(reducer)
        self._holding(lease_id, reducer).deadline = time.monotonic() + self.lease_seconds
        return self.lease_seconds

    def done(self, lease_id: str, report: Done) -> None:
        """``report.reducer`` finished its slice lease (or found the round not finite, or failed)."""
        work, stats = self._returned(lease_id, report.reducer, "done")
        _settle(work, stats, report, f"reducer {report.reducer}")

    def checked(self, lease_id: str, report: CheckReport) -> None:
        """``report.reducer`` checked the body of its check lease (passed, refused or failed)."""
        work, stats = self._returned(lease_id, report.reducer, "checked")
        stats.checks += 1
        stats.check_seconds += report.seconds
        work.report = report
        work.batch.changed.notify()

    def check_failed(self, reducer: str, run: str, name: str, why: str) -> None:
        """``reducer``'s check report on ``name`` was not taken (the hub's check answered): its failure."""
        if (stats := self.reducers.get(reducer)) is not None:
            stats.check_failures += 1
        log.warning("check_report_not_taken run=%s object=%s reducer=%s: %s", run, name, reducer, why)

    def _holding(self, lease_id: str, reducer: str) -> _Work:
        work = self._held.get(lease_id)
        if work is None or work.holder != reducer or time.monotonic() > work.deadline:
            if work is None and lease_id not in self._gone:
                raise NotFound(f"no lease {lease_id!r}")
            raise LeaseLost(f"lease {lease_id!r} is not {reducer!r}'s any more (expired, or its round moved on)")
        return work

    def _returned(self, lease_id: str, reducer: str, report: str) -> tuple[_Work, ReducerStats]:
        """``reducer``'s lease, reported to ``/report``: off the board (a second report is refused)."""
        stats = self._seen(reducer)
        work = self._holding(lease_id, reducer)
        if work.job.report != report:
            raise NotFound(f"lease {lease_id!r} is a {work.job.kind} lease: report it to /{work.job.report}")
        self._release(work)
        return work, stats

    def _release(self, work: _Work) -> None:
        """Take held ``work`` off its holder: its id is gone (a report to it is refused from now on)."""
        del self._held[work.job.lease]
        self._gone[work.job.lease] = None
        while len(self._gone) > GONE_KEPT:
            del self._gone[next(iter(self._gone))]
        if (stats := self.reducers.get(work.holder or "")) is not None and stats.holding == work.job.lease:
            stats.holding = None
        work.holder = None

    # ---- the callers' side ---------------------------------------------------------------
    async def check(self, job: CheckJob) -> CheckReport | None:
        """A reducer's report on an uploaded body, or None: the hub checks it itself (no reducer
        alive, or the lease lost :data:`CHECK_TRIES` times). Cancelled: withdrawn from the board."""
        if not self._alive(time.monotonic()):
            return None
        batch = _Batch(job.run, urgent=True)
        batch.work = [_Work(job, batch)]
        await self._settled(batch)
        report = batch.work[0].report  # None: given back
        return report if isinstance(report, CheckReport) else None

    async def run(
        self, run: str, round_: int, offered: Sequence[WorkJob], prefer: Sequence[str | None] | None = None
    ) -> list[Done]:
        """Offer these leases (each first to its ``prefer``, holding its slices) and wait: their reports."""
        batch = _Batch(run)
        batch.work = [
            _Work(job.model_copy(update={"run": run, "round": round_}), batch, prefer=who)
            for job, who in zip(offered, prefer or [None] * len(offered), strict=True)
        ]
        await self._settled(batch)
        return [w.report for w in batch.work if isinstance(w.report, Done)]

    async def _settled(self, batch: _Batch) -> None:
        """Offer ``batch``'s work and wait until all is reported (raising a failure), or urgent work is
        given back (no reducer alive, or :data:`CHECK_TRIES` expiries). An expired lease is offered
        again, first; with no reducer for a lease length the hub works the rest: dead reducers cost a
        merge one lease length. Not :func:`until`: a look may expire, offer or work leases."""
        self._queue.extend(batch.work)
        self._offered.notify()
        try:
            while batch.failure is None and any(w.report is None for w in batch.work):
                now = time.monotonic()
                late = [w for w in batch.work if w.holder is not None and w.deadline < now]
                for w in late:
                    self._expire(w)
                batch.expired += len(late)
                if batch.urgent and batch.expired >= CHECK_TRIES:
                    return
                if late:
                    self._queue.extendleft(reversed(late))
                    self._offered.notify()
                    if batch.urgent:  # a peer waits on a check: another reducer gets a lease length for it
                        batch.offered = now
                offered = any(w.batch is batch for w in self._queue)
                if offered and not self._alive(now, since=batch.offered):
                    if batch.urgent:
                        return
                    await self._work_here(batch)
                    continue
                deadlines = [w.deadline for w in batch.work if w.holder is not None]
                if offered:  # when to give up on the reducers
                    deadlines.append(max(self._active, batch.offered) + self.lease_seconds)
                await batch.changed.wait(max(0.01, min(deadlines) - now) if deadlines else None)
            if batch.failure is not None:
                raise batch.failure
        finally:
            self._queue = deque(w for w in self._queue if w.batch is not batch)
            for w in batch.work:
                if w.holder is not None:
                    self._release(w)

    def _alive(self, now: float, since: float = 0.0) -> bool:
        """A reducer asks, holds a lease, or was heard from within a lease length (of ``since``)."""
        return bool(self._waiting or self._held) or now - max(self._active, since) <= self.lease_seconds

    async def _work_here(self, batch: _Batch) -> None:
        """Work the batch's next lease as a reducer would: rounds go on with no reducer alive."""
        work_ = next(w for w in self._queue if w.batch is batch)
        self._queue.remove(work_)
        job = work_.job.model_copy(update={"lease": uuid.uuid4().hex, "seconds": self.lease_seconds})
        log.warning(
            "work_lease_worked_by_hub kind=%s run=%s round=%d lease=%s (no reducer for a lease length)", *_said(job)
        )
        report = await to_thread.run_sync(functools.partial(work, job, HUB, objects=self.objects))
        stats = self.reducers.setdefault(HUB, ReducerStats(HUB, time.time(), time.time()))
        stats.last_seen = time.time()
        assert isinstance(report, Done)  # urgent work (a check) is given back, never worked here
        _settle(work_, stats, report, HUB)

    def _expire(self, work: _Work) -> None:
        if (stats := self.reducers.get(work.holder or "")) is not None:
            stats.expired += 1
        log.warning(
            "work_lease_expired kind=%s run=%s round=%d lease=%s reducer=%s (offered again)",
            *_said(work.job),
            work.holder,
        )
        self._release(work)

    def offered(self, run: str, kind: type[WorkJob]) -> bool:
        """Has ``run`` a lease of this kind on offer, taken by no reducer yet?"""
        return any(w.batch.run == run and isinstance(w.job, kind) for w in self._queue)

    def live(self, within: float) -> list[ReducerStats]:
        """Reducers heard from in the last ``within`` seconds, by name."""
        t = time.time()
        return sorted((r for r in self.reducers.values() if t - r.last_seen <= within), key=lambda r: r.name)


def _said(job: WorkJob) -> tuple[str, str, int, str]:
    return job.kind, job.run, job.round, job.lease


def _settle(work: _Work, stats: ReducerStats, report: Done, who: str) -> None:
    """Take a slice lease's report (a reducer's or the hub's): done and counted, or the batch's failure."""
    if report.error is None:
        work.report = report
        stats.leases += 1
        stats.seconds += report.seconds
        stats.last_seconds = report.seconds
        stats.bytes += report.bytes
    elif work.batch.failure is None:
        failure = NonFinite if report.error == "non_finite" else LeaseFailed
        work.batch.failure = failure(f"{who}: {report.detail}")
    work.batch.changed.notify()


async def merge_leased(
    board: Board, reducers: int, engine: MergeEngine, m: RoundMerge, into: Into | None = None
) -> tuple[int, dict[str, float]]:
    """:meth:`MergeEngine.merge`'s work, shared by the reducers (the same folds in the same order): the
    result's size and their bound on |v+1|. The outputs go where ``into`` puts them (None: staged files)."""
    if m.acc.mean is not None:
        raise ValueError("a leased merge reads the reducers' mean: the hub's accumulator must be empty")
    files = contextlib.ExitStack()
    try:
        merge = await to_thread.run_sync(engine.open_merge, files, m, into)
        leases = await to_thread.run_sync(jobs, merge, m.acc.schema, reducers)
        reports = await board.run(m.run, m.round, leases, _holders(leases, m.acc.partial))
    except BaseException as exc:
        await to_thread.run_sync(files.__exit__, type(exc), exc, exc.__traceback__)
        raise
    await to_thread.run_sync(files.close)
    return merge.result_size, _peaks(reports)


async def merge_into_bucket(
    board: Board, reducers: int, engine: MergeEngine, m: RoundMerge, objects: ObjectStore
) -> tuple[int, list[ObjectRecord], dict[str, float]]:
    """:func:`merge_leased` with the outputs written as parts of multipart uploads, completed here (the
    objects' records) or aborted if the merge fails."""
    outputs: list[tuple[Stored, ObjectOutput]] = []
    try:
        size, peaks = await merge_leased(board, reducers, engine, m, _into_bucket(objects, outputs))
        records = [await to_thread.run_sync(_complete, objects, key, out) for key, out in outputs]
    except BaseException:
        if outputs:
            await to_thread.run_sync(_abort, objects, [out for _, out in outputs])
        raise
    return size, records, peaks


async def build_leased(
    board: Board, reducers: int, run: str, v: int, schema: Schema, codec: Codec, store: ObjectStore
) -> tuple[ObjectRecord, dict[str, float]]:
    """Have at most ``reducers`` leases build version ``v``+1 in the bucket (the hub moves no byte of
    it): its record (the version counts once the caller records it) and each tensor's peak."""
    key = VersionKey(run, v + 1)
    head, at, size = version_layout(schema, v + 1)
    out = await to_thread.run_sync(_upload, store, key, size)
    try:
        out.write(head)
        base, result = object_name(VersionKey(run, v)), object_name(ResultKey(run, v))
        reports = await board.run(run, v, build_jobs(schema, codec, base, result, out, at, reducers))
        record = await to_thread.run_sync(_complete, store, key, out)
    except BaseException:
        await to_thread.run_sync(_abort, store, [out])
        raise
    return record, _peaks(reports)


def _peaks(reports: Sequence[Done]) -> dict[str, float]:
    return highest(pair for report in reports for pair in report.peaks.items())


def _into_bucket(objects: ObjectStore, outputs: list[tuple[Stored, ObjectOutput]]) -> Into:
    """:meth:`MergeEngine.open_merge`'s ``into`` with a store: each output (the result; DiLoCo's
    momentum and the hub's residual) a multipart upload at its name, collected in ``outputs``."""

    @contextlib.contextmanager
    def into(key: Key, size: int) -> Iterator[ObjectOutput]:
        if isinstance(key, UpdateKey):
            raise TypeError(f"updates go to the bucket from the peers, not as a merge's parts: {key}")
        outputs.append((key, _upload(objects, key, size)))
        yield outputs[-1][1]

    return into


def _upload(store: ObjectStore, key: Stored, size: int) -> ObjectOutput:
    """Worker thread: a multipart upload opened at ``key``'s name, for the leases to write parts of."""
    name = object_name(key)
    upload_id = store.create_multipart(name)
    return ObjectOutput(name, size, upload_id, functools.partial(store.presign_part, name, upload_id))


def _complete(store: ObjectStore, key: Stored, out: ObjectOutput) -> ObjectRecord:
    """Worker thread: publish ``out`` if each part has its lease's size (else :class:`LeaseFailed`)."""
    held = store.list_parts(out.name, out.upload_id)
    for number, size in out.parts.items():
        if (got := held[number].size if number in held else None) != size:
            raise LeaseFailed(f"{out.name}: part {number} holds {got} bytes, not {size}")
    info = store.complete_multipart(out.name, out.upload_id, {n: held[n].etag for n in out.parts})
    if info.size != out.size:
        raise LeaseFailed(f"{out.name}: completed with {info.size} bytes, not {out.size}")
    return ObjectRecord(key, info.size, info.etag)


def _abort(objects: ObjectStore, outputs: list[ObjectOutput]) -> None:
    """Worker thread: drop a failed merge's multipart uploads (if the store fails, the next start does)."""
    for out in outputs:
        try:
            objects.abort_multipart(out.name, out.upload_id)
        except StoreError as exc:
            log.warning("abort_multipart_failed object=%s: %s (cleaned up at the next start)", out.name, exc)


def _holders(leases: Sequence[MergeJob | FoldJob], mean: Resident | None) -> list[str | None]:
    """Per lease, the reducer holding most of its slices of ``mean`` (None: no mean, or none known)."""
    held = mean.holders if mean is not None else {}
    counts = [Counter(h for s in job.slices if (h := held.get((s.name, s.start))) is not None) for job in leases]
    return [c.most_common(1)[0][0] if c else None for c in counts]


class FoldAhead:
    """The reducers fold updates **ahead**, as acknowledged, into a mean in their memory, so the close
    folds only the rest (docs/object-store.md, "The reducers fold ahead"). The accumulator names a
    step's mean once all its leases are done; a mean is a cache, a slice lacking is folded again."""

    def __init__(self, board: Board, reducers: int, engine: MergeEngine) -> None:
        self.board, self.reducers, self.engine = board, reducers, engine

    async def fold(
        self, run: str, round_: int, acc: Accumulator, codec: Codec, updates: Sequence[tuple[str, UpdateKey, float]]
    ) -> None:
        """One step: fold ``updates`` ((peer, key, weight), in order) after ``acc``'s mean."""
        if acc.mean is not None:
            raise ValueError("the reducers fold ahead in their memory: the hub's accumulator must stay empty")
        base = acc.partial
        folds = (*(base.updates if base is not None else ()), *((key, weight) for _, key, weight in updates))
        sources = await to_thread.run_sync(self._sources, list(folds))
        mean = uuid.uuid4().hex
        leases = fold_jobs(acc.schema, codec, self.reducers, mean, base, acc.weight, sources)
        reports = await self.board.run(run, round_, leases, _holders(leases, base))
        holders = {
            (s.name, s.start): done.reducer for job, done in zip(leases, reports, strict=True) for s in job.slices
        }
        acc.partial = Resident(mean, folds, holders)  # the new mean counts from here
        for peer, _, weight in updates:
            acc.folded.append(peer)
            acc.weight += weight  # summed fold by fold, as the merge sums them

    def _sources(self, updates: list[tuple[UpdateKey, float]]) -> list[UpdateSource]:
        """Worker thread: where each update lies (a file of the hub's, or its object in the bucket)."""
        out = []
        for key, weight in updates:
            with self.engine.open_update(key) as wire:
                out.append(UpdateSource.of(wire, weight))
        return out
