"""Reducers share the merge: the hub's board of merge leases (no HTTP here; the routes in
:mod:`syncserver.api.reduce` only translate).

With ``SYNC_REDUCERS`` set, a round's close opens its merge once (:meth:`MergeEngine.open_merge
<syncserver.reduce.engine.MergeEngine.open_merge>`), cuts its slices into at most K spans
(:func:`syncserver.reduce.lease.jobs`) and puts one lease per span on the board. Reducers
long-poll for a lease (:meth:`Board.take`), renew it while they work (:meth:`Board.renew`) and
report it (:meth:`Board.done`). With no reducer at all for a lease length (none asking, none
holding a lease: all dead, or ``--local-reducers 0`` and none started), the hub works the
leases on offer itself, through the same function. A lease not renewed within ``SYNC_REDUCE_LEASE_SECONDS`` is
offered again under a new id, so a reducer that died mid-slice costs one lease length and
its slices are redone, to the same bits, by another; the old id's report is refused
(:class:`~syncserver.errors.LeaseLost`, 409) and changes nothing. Once every lease of the
round is done, the hub fsyncs and publishes the staged outputs and commits the round exactly
as an in-process merge does (record last). A lease that reports the round not finite fails the
merge with :class:`~syncserver.reduce.engine.NonFinite`, which the close handles as it
always does (:mod:`syncserver.core.finite`); any other failure fails the close, which is
tried again after its backoff.

The same board carries **check leases** (``SYNC_STORE`` too): the body check of an update a peer
uploaded to the bucket (:mod:`syncserver.reduce.checklease`), so that the hub reads no update
body. A check is offered before any merge lease (a peer waits on it), renewed like one, reported
by ``/checked``; one that expires is offered again, at most :data:`CHECK_TRIES` times; with no
reducer alive (as above) :meth:`Board.check` answers None and the hub checks the body itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from anyio import to_thread

from syncserver.errors import LeaseLost, NotFound
from syncserver.reduce.checklease import CheckJob, CheckReport
from syncserver.reduce.engine import Accumulator, MergeEngine, NonFinite, Resident, RoundMerge, version_layout
from syncserver.reduce.lease import (
    BuildJob,
    Done,
    FoldJob,
    Job,
    ObjectOutput,
    UpdateSource,
    build_jobs,
    fold_jobs,
    highest,
    jobs,
    work,
    work_build,
    work_fold,
)
from syncserver.storage.bucket import object_name
from syncserver.storage.objectfile import ObjectTensorFile
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
    "merge_leased",
]

log = logging.getLogger(__name__)

#: ids of leases gone (expired, or their round's merge ended) that are remembered, to answer a
#: late report with 409 rather than 404
GONE_KEPT = 4096
#: the name under which the hub works a lease itself (no reducer for a lease length)
HUB = "hub"
#: the longest a reducer's request for a lease is held (its long poll), in seconds
LEASE_POLL_MAX = 60.0
#: a check lease taken and lost this many times (reducers dying on that body?) is checked by the hub
CHECK_TRIES = 3
#: a lease over a mean's slices waits this long for the reducer that holds them (heard from
#: within it, or holding a lease) before another takes it and folds those slices again
AFFINITY_SECONDS = 2.0


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


@dataclass
class _Lease:
    job: Job | BuildJob | FoldJob
    merge: _Merge
    holder: str | None = None
    deadline: float = 0.0
    taken: float = 0.0
    report: Done | None = None  # once done
    prefer: str | None = None  # the reducer that holds its slices of the round's mean, offered it first


@dataclass
class _Merge:
    """One round's leases being worked."""

    run: str
    round: int
    leases: list[_Lease] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    failure: BaseException | None = None


@dataclass
class _Check:
    """One update's body check on the board: offered, held, or answered (``answer``)."""

    job: CheckJob
    answer: asyncio.Future[CheckReport]
    holder: str | None = None
    deadline: float = 0.0
    offered: float = field(default_factory=time.monotonic)


class Board:
    """Every merge lease of one hub: offered, held, done."""

    def __init__(self, lease_seconds: float, objects: Callable[[], ObjectStore] | None = None) -> None:
        self.lease_seconds = lease_seconds
        self.objects = objects  # SYNC_STORE: where the hub reads updates in the bucket, working a lease itself
        self._pending: deque[_Lease] = deque()
        self._held: dict[str, _Lease] = {}  # by lease id
        self._checks: deque[_Check] = deque()  # check leases on offer (before any merge lease)
        self._checks_held: dict[str, _Check] = {}  # by lease id
        self._gone: dict[str, None] = {}  # ids no longer valid (insertion-ordered, bounded)
        self._offered = asyncio.Condition()
        self._changed = asyncio.Event()  # a lease was done or failed: the merges look again
        self._polling = 0  # reducers waiting for a lease right now
        self._waiting: dict[str, int] = {}  # the same, by name
        self._stopping = False  # the server is shutting down: polls answer at once (end_polls)
        self._waking: asyncio.Task[None] | None = None  # end_polls' wake-up
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
        """The server is shutting down: the reducers' polls answer "no lease" now (see
        :meth:`Coordinator.end_polls`)."""
        self._stopping = True

        async def wake() -> None:
            async with self._offered:
                self._offered.notify_all()

        self._waking = asyncio.get_running_loop().create_task(wake())  # held: a task nobody holds may vanish

    async def take(self, reducer: str, wait: float) -> Job | BuildJob | FoldJob | CheckJob | None:
        """The next lease offered (a check first), held by ``reducer`` from now; None after ``wait`` seconds."""
        self._seen(reducer)
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        self._polling += 1
        self._waiting[reducer] = self._waiting.get(reducer, 0) + 1
        try:
            async with self._offered:
                while (lease := self._next(reducer)) is None and not self._checks:
                    left = until - loop.time()
                    if left <= 0 or self._stopping:
                        self._seen(reducer)  # it was there all along
                        return None
                    with contextlib.suppress(TimeoutError):  # a holder that goes quiet frees its leases
                        await asyncio.wait_for(self._offered.wait(), min(left, AFFINITY_SECONDS / 4))
                if self._checks:
                    return self._take_check(reducer, self._checks.popleft())
                assert lease is not None
                self._pending.remove(lease)
        finally:
            self._polling -= 1
            self._waiting[reducer] -= 1
            if not self._waiting[reducer]:
                del self._waiting[reducer]
        stats = self._seen(reducer)
        lease.job = lease.job.model_copy(update={"lease": uuid.uuid4().hex, "seconds": self.lease_seconds})
        lease.holder, lease.taken = reducer, time.monotonic()
        lease.deadline = lease.taken + self.lease_seconds
        self._held[lease.job.lease] = lease
        stats.holding = lease.job.lease
        self._changed.set()  # the merge waits on the new deadline
        job = lease.job
        log.info(
            "lease_taken run=%s round=%d kind=%s lease=%s reducer=%s slices=%d mb=%.1f",
            lease.merge.run,
            lease.merge.round,
            job.kind if isinstance(job, BuildJob | FoldJob) else "merge",
            job.lease,
            reducer,
            len(job.slices),
            (job.reads if isinstance(job, BuildJob) else job.reads * len(job.updates)) / 1e6,
        )
        return lease.job

    def _next(self, reducer: str) -> _Lease | None:
        """The lease to give ``reducer``: the first on offer that prefers it, else the first that
        prefers nobody or a reducer not around (not asking, holding nothing, not heard from
        within :data:`AFFINITY_SECONDS`): that one folds the slices again from the updates."""
        mine = next((x for x in self._pending if x.prefer == reducer), None)
        if mine is not None:
            return mine
        return next((x for x in self._pending if x.prefer is None or not self._around(x.prefer)), None)

    def _around(self, reducer: str) -> bool:
        stats = self.reducers.get(reducer)
        return (
            reducer in self._waiting
            or any(x.holder == reducer for x in self._held.values())
            or (stats is not None and time.time() - stats.last_seen <= AFFINITY_SECONDS)
        )

    def _take_check(self, reducer: str, check: _Check) -> CheckJob:
        stats = self._seen(reducer)
        check.job = check.job.model_copy(update={"lease": uuid.uuid4().hex, "seconds": self.lease_seconds})
        check.holder, check.deadline = reducer, time.monotonic() + self.lease_seconds
        self._checks_held[check.job.lease] = check
        stats.holding = check.job.lease
        log.info(
            "check_taken run=%s round=%d peer=%s lease=%s reducer=%s mb=%.1f",
            check.job.run,
            check.job.round,
            check.job.peer,
            check.job.lease,
            reducer,
            check.job.size / 1e6,
        )
        return check.job

    def checked(self, lease_id: str, report: CheckReport) -> None:
        """``report.reducer`` checked the body of its check lease (passed, refused or failed)."""
        stats = self._seen(report.reducer)
        check = self._checks_held.get(lease_id)
        if check is None or check.holder != report.reducer or time.monotonic() > check.deadline:
            if check is None and lease_id not in self._gone:
                raise NotFound(f"no check lease {lease_id!r}")
            raise LeaseLost(f"lease {lease_id!r} is not {report.reducer!r}'s any more (expired, or answered)")
        del self._checks_held[lease_id]
        self._forget(lease_id)
        stats.holding = None
        stats.checks += 1
        stats.check_seconds += report.seconds
        if not check.answer.done():
            check.answer.set_result(report)

    def check_failed(self, reducer: str, run: str, name: str, why: str) -> None:
        """``reducer``'s report of the check of object ``name`` was not taken (it failed, it does
        not hold up, or the hub's own check of the body says otherwise): counted as its failure,
        for /metrics and status. The peer's answer is the hub's own check's."""
        stats = self.reducers.get(reducer)
        if stats is not None:
            stats.check_failures += 1
        log.warning("check_report_not_taken run=%s object=%s reducer=%s: %s", run, name, reducer, why)

    def _holding(self, lease_id: str, reducer: str) -> _Lease:
        lease = self._held.get(lease_id)
        if lease is None or lease.holder != reducer or time.monotonic() > lease.deadline:
            if lease is None and lease_id not in self._gone:
                raise NotFound(f"no lease {lease_id!r}")
            raise LeaseLost(f"lease {lease_id!r} is not {reducer!r}'s any more (expired, or its round moved on)")
        return lease

    def renew(self, lease_id: str, reducer: str) -> float:
        """Extend ``reducer``'s lease; the seconds it now has. :class:`LeaseLost` once lost."""
        self._seen(reducer)
        check = self._checks_held.get(lease_id)
        if check is not None and check.holder == reducer and time.monotonic() <= check.deadline:
            check.deadline = time.monotonic() + self.lease_seconds
            return self.lease_seconds
        lease = self._holding(lease_id, reducer)
        lease.deadline = time.monotonic() + self.lease_seconds
        return self.lease_seconds

    def done(self, lease_id: str, report: Done) -> None:
        """``report.reducer`` finished its lease (or found the round not finite, or failed)."""
        stats = self._seen(report.reducer)
        lease = self._holding(lease_id, report.reducer)
        del self._held[lease_id]
        self._forget(lease_id)
        stats.holding = None
        _settle(lease, stats, report, f"reducer {report.reducer}")
        self._changed.set()

    def _forget(self, lease_id: str) -> None:
        self._gone[lease_id] = None
        while len(self._gone) > GONE_KEPT:
            del self._gone[next(iter(self._gone))]

    # ---- the uploads' side ----------------------------------------------------------------
    def _alive(self, now: float) -> bool:
        """A reducer asks, holds a lease, or was heard from within a lease length."""
        return bool(self._polling or self._held or self._checks_held or now - self._active <= self.lease_seconds)

    async def check(self, job: CheckJob) -> CheckReport | None:
        """Have a reducer check an uploaded body: its report, or None when the hub must check it
        itself (no reducer alive; or the lease lost :data:`CHECK_TRIES` times). An expired lease is
        offered again, first in line. Cancelled (the peer went away): withdrawn from the board."""
        if not self._alive(time.monotonic()):
            return None
        check = _Check(job, asyncio.get_running_loop().create_future())
        tries = 0
        await self._offer_check(check)
        try:
            while True:
                now = time.monotonic()
                if check.holder is not None and check.deadline < now:
                    tries += 1
                    self._expire_check(check)
                    if tries >= CHECK_TRIES:
                        return None
                    await self._offer_check(check, first=True)
                elif check.holder is None and not self._alive(now) and now - check.offered > self.lease_seconds:
                    return None
                until = check.deadline if check.holder is not None else max(self._active, check.offered)
                timeout = max(0.01, until + (0 if check.holder is not None else self.lease_seconds) - now)
                done, _ = await asyncio.wait({check.answer}, timeout=min(timeout, 1.0))
                if done:
                    return check.answer.result()
        finally:
            with contextlib.suppress(ValueError):
                self._checks.remove(check)
            if check.holder is not None and self._checks_held.get(check.job.lease) is check:
                self._expire_check(check, quiet=True)

    async def _offer_check(self, check: _Check, *, first: bool = False) -> None:
        check.offered = time.monotonic()
        async with self._offered:
            if first:
                self._checks.appendleft(check)
            else:
                self._checks.append(check)
            self._offered.notify_all()

    def _expire_check(self, check: _Check, *, quiet: bool = False) -> None:
        del self._checks_held[check.job.lease]
        self._forget(check.job.lease)
        stats = self.reducers.get(check.holder or "")
        if stats is not None and stats.holding == check.job.lease:
            stats.holding = None
            stats.expired += not quiet
        if not quiet:
            log.warning(
                "check_lease_expired run=%s round=%d peer=%s lease=%s reducer=%s (offered again)",
                check.job.run,
                check.job.round,
                check.job.peer,
                check.job.lease,
                check.holder,
            )
        check.holder = None

    # ---- the merge's side ----------------------------------------------------------------
    async def run(
        self,
        run: str,
        round_: int,
        offered: Sequence[Job | BuildJob | FoldJob],
        prefer: Sequence[str | None] | None = None,
    ) -> list[Done]:
        """Offer these leases and wait until every lease of it is done; their reports, in order.
        ``prefer``: per lease, the reducer it is offered to first (it holds the lease's slices of
        the round's mean). An expired lease is offered again (first in line). Raises what a lease
        reported (:class:`NonFinite`, :class:`LeaseFailed`); either way, or cancelled, nothing of
        these leases stays on the board."""
        merge = _Merge(run, round_)
        merge.leases = [
            _Lease(job.model_copy(update={"run": run}), merge, prefer=who)
            for job, who in zip(offered, prefer or [None] * len(offered), strict=True)
        ]
        await self._offer(merge.leases)
        try:
            while merge.failure is None and not all(lease.report is not None for lease in merge.leases):
                self._changed.clear()
                now = time.monotonic()
                expired = [x for x in self._held.values() if x.merge is merge and x.deadline < now]
                for lease in expired:
                    self._expire(lease)
                if expired:
                    await self._offer(expired, first=True)
                if self._deserted(merge, now):
                    await self._work_here(merge)
                    continue
                deadlines = [x.deadline for x in self._held.values() if x.merge is merge]
                if any(x.merge is merge for x in self._pending):  # when to give up on the reducers
                    deadlines.append(max(self._active, merge.started) + self.lease_seconds)
                timeout = max(0.01, min(deadlines) - now) if deadlines else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout)
            if merge.failure is not None:
                raise merge.failure
        finally:
            self._withdraw(merge)
        return [lease.report for lease in merge.leases if lease.report is not None]

    def _deserted(self, merge: _Merge, now: float) -> bool:
        """No reducer for a lease length (none waiting, none holding a lease, none heard from)
        while this merge has leases on offer: the hub works them itself."""
        return (
            any(x.merge is merge for x in self._pending)
            and not self._polling
            and not self._held
            and now - max(self._active, merge.started) > self.lease_seconds
        )

    async def _work_here(self, merge: _Merge) -> None:
        """Work the merge's next lease on offer in the hub, as a reducer would (the same function,
        the same files): rounds go on when every reducer is dead or none was started."""
        lease = next(x for x in self._pending if x.merge is merge)
        self._pending.remove(lease)
        job = lease.job.model_copy(update={"lease": uuid.uuid4().hex, "seconds": self.lease_seconds})
        log.warning(
            "lease_worked_by_hub run=%s round=%d slices=%d (no reducer for %.0f s)",
            merge.run,
            merge.round,
            len(job.slices),
            self.lease_seconds,
        )
        try:
            if isinstance(job, BuildJob):
                report = await to_thread.run_sync(functools.partial(work_build, job, HUB, objects=self.objects))
            elif isinstance(job, FoldJob):
                report = await to_thread.run_sync(functools.partial(work_fold, job, HUB, objects=self.objects))
            else:
                report = await to_thread.run_sync(functools.partial(work, job, HUB, objects=self.objects))
        except Exception as exc:
            report = Done(reducer=HUB, seconds=0, bytes=0, error="failed", detail=repr(exc)[:2000])
        stats = self.reducers.setdefault(HUB, ReducerStats(HUB, time.time(), time.time()))
        stats.last_seen = time.time()
        _settle(lease, stats, report, HUB)

    async def _offer(self, leases: list[_Lease], *, first: bool = False) -> None:
        async with self._offered:
            if first:
                self._pending.extendleft(reversed(leases))
            else:
                self._pending.extend(leases)
            self._offered.notify_all()

    def _expire(self, lease: _Lease) -> None:
        del self._held[lease.job.lease]
        self._forget(lease.job.lease)
        stats = self.reducers.get(lease.holder or "")
        if stats is not None:
            stats.expired += 1
            stats.holding = None
        log.warning(
            "lease_expired run=%s round=%d lease=%s reducer=%s (offered again)",
            lease.merge.run,
            lease.merge.round,
            lease.job.lease,
            lease.holder,
        )
        lease.holder = None

    def _withdraw(self, merge: _Merge) -> None:
        self._pending = deque(x for x in self._pending if x.merge is not merge)
        for lease_id in [i for i, x in self._held.items() if x.merge is merge]:
            del self._held[lease_id]
            self._forget(lease_id)
        for stats in self.reducers.values():
            if stats.holding is not None and stats.holding in self._gone:
                stats.holding = None

    def offered(self, run: str, kind: type[Job | BuildJob | FoldJob]) -> bool:
        """Has ``run`` a lease of this kind on offer, taken by no reducer yet?"""
        return any(x.merge.run == run and isinstance(x.job, kind) for x in self._pending)

    def live(self, within: float) -> list[ReducerStats]:
        """Reducers heard from in the last ``within`` seconds, by name."""
        t = time.time()
        return sorted((r for r in self.reducers.values() if t - r.last_seen <= within), key=lambda r: r.name)


def _settle(lease: _Lease, stats: ReducerStats, report: Done, who: str) -> None:
    """Take a lease's report, from a reducer or the hub: done (counted in ``stats``), or the
    round's merge failed with the first failure reported (non-finite or not)."""
    if report.error is None:
        lease.report = report
        stats.leases += 1
        stats.seconds += report.seconds
        stats.last_seconds = report.seconds
        stats.bytes += report.bytes
    elif lease.merge.failure is None:
        failure = NonFinite if report.error == "non_finite" else LeaseFailed
        lease.merge.failure = failure(f"{who}: {report.detail}")


async def merge_leased(
    board: Board, reducers: int, engine: MergeEngine, m: RoundMerge
) -> tuple[int, list[ObjectRecord], dict[str, float]]:
    """:meth:`MergeEngine.merge`'s work, shared by the reducers: open the merge, hand out its
    leases, wait for them, publish the outputs; the result's size, the records of the objects
    the reducers wrote (none on local disk) and their bound on ``|version v+1|`` per tensor
    (``m.bound``: the one on ``|version v|``, if known, see :meth:`MergeEngine.open_merge`). The
    hub holds no mean in its memory: the reducers folded the updates acknowledged before the
    close into ``m.acc.partial``, which they hold (:class:`FoldAhead`), and each merge lease,
    offered first to the reducer holding its slices, folds the rest (``m.unfolded``) after it,
    in acknowledgement order: the same folds in the same order, the same bits as the hub alone
    (a slice held by no reducer that takes it is folded from the first update).

    With an object store (the board's ``objects``) the result, and DiLoCo's momentum and the
    hub's residual if any, are multipart uploads that each lease writes its run of parts of
    (:func:`_into_bucket`), completed here once every lease is done; the caller records them in
    the round's commit (record last), so the hub uploads none, and has version v+1 built after
    the commit (:func:`build_leased`). On local disk: the staged files, fsynced and published
    (rename)."""
    if m.acc.mean is not None:
        raise ValueError("a leased merge reads the reducers' mean: the hub's accumulator must be empty")
    files = contextlib.ExitStack()
    outputs: list[tuple[Stored, ObjectOutput]] = []
    try:
        objects = board.objects
        into = _into_bucket(objects(), outputs) if objects is not None else None
        merge = await to_thread.run_sync(engine.open_merge, files, m, into)
        leases = await to_thread.run_sync(jobs, merge, m.acc.schema, reducers)
        reports = await board.run(m.run, m.round, leases, _holders(leases, m.acc.partial))
        records = [await to_thread.run_sync(_complete, objects, key, out) for key, out in outputs] if objects else []
    except BaseException as exc:
        await to_thread.run_sync(files.__exit__, type(exc), exc, exc.__traceback__)
        if outputs and board.objects is not None:
            await to_thread.run_sync(_abort, board.objects(), [out for _, out in outputs])
        raise
    await to_thread.run_sync(files.close)
    return merge.result_size, records, _peaks(reports)


async def build_leased(
    board: Board, reducers: int, run: str, v: int, schema: Schema, codec: Codec
) -> tuple[ObjectRecord, dict[str, float]]:
    """Have the reducers build version ``v``+1 in the bucket from version v and round v's result
    (both objects there: the reducers wrote them), as at most ``reducers`` build leases, each
    its run of parts of one multipart upload, completed here; its record (the caller records it: the
    version counts from then on) and each tensor's largest ``|value|``. ``codec``: the run's
    (the reducers read a final round's fp32 from the result's header). The hub reads and writes
    no byte of it."""
    objects = board.objects
    if objects is None:
        raise ValueError("versions are built by leases only in an object store")
    store = objects()
    key = VersionKey(run, v + 1)
    name = object_name(key)
    head, at, size = version_layout(schema, v + 1)
    result = object_name(ResultKey(run, v))
    upload_id = await to_thread.run_sync(store.create_multipart, name)
    out = ObjectOutput(name, size, upload_id, functools.partial(store.presign_part, name, upload_id))
    try:
        out.write(head)
        leases = build_jobs(schema, codec, object_name(VersionKey(run, v)), result, out, at, reducers)
        reports = await board.run(run, v, leases)
        record = await to_thread.run_sync(_complete, objects, key, out)
    except BaseException:
        await to_thread.run_sync(_abort, store, [out])
        raise
    return record, _peaks(reports)


def _peaks(reports: Sequence[Done]) -> dict[str, float]:
    """Each tensor's largest peak over the leases' reports."""
    return highest(pair for report in reports for pair in report.peaks.items())


def _into_bucket(
    objects: ObjectStore, outputs: list[tuple[Stored, ObjectOutput]]
) -> Callable[[Key, int], contextlib.AbstractContextManager[ObjectOutput]]:
    """:meth:`MergeEngine.open_merge`'s ``into`` for a hub with an object store: each output
    (the result; DiLoCo's next momentum and the hub's next residual, which the next round's
    leases read by ranges) a multipart upload opened at its name, collected in ``outputs``."""

    @contextlib.contextmanager
    def into(key: Key, size: int) -> Iterator[ObjectOutput]:
        if isinstance(key, UpdateKey):
            raise TypeError(f"updates go to the bucket from the peers, not as a merge's parts: {key}")
        name = object_name(key)
        upload_id = objects.create_multipart(name)
        out = ObjectOutput(name, size, upload_id, functools.partial(objects.presign_part, name, upload_id))
        outputs.append((key, out))
        yield out

    return into


def _complete(objects: Callable[[], ObjectStore], key: Stored, out: ObjectOutput) -> ObjectRecord:
    """Worker thread: publish ``out`` (:func:`_completed`); its record, for the commit."""
    return ObjectRecord(key, *_completed(objects(), out))


def _completed(store: ObjectStore, out: ObjectOutput) -> tuple[int, str]:
    """Worker thread: publish ``out`` from the parts its leases uploaded, once each is there with
    the size its lease was given (:class:`LeaseFailed` otherwise); its size and ETag."""
    held = store.list_parts(out.name, out.upload_id)
    for number, size in out.parts.items():
        if number not in held or held[number].size != size:
            got = held[number].size if number in held else None
            raise LeaseFailed(f"{out.name}: part {number} holds {got} bytes, not {size}")
    info = store.complete_multipart(out.name, out.upload_id, {n: held[n].etag for n in out.parts})
    if info.size != out.size:
        raise LeaseFailed(f"{out.name}: completed with {info.size} bytes, not {out.size}")
    return info.size, info.etag


def _abort(objects: ObjectStore, outputs: list[ObjectOutput]) -> None:
    """Worker thread: drop the multipart uploads of a merge that failed (a store that fails here
    leaves them to the next start's clean-up)."""
    for out in outputs:
        try:
            objects.abort_multipart(out.name, out.upload_id)
        except StoreError as exc:
            log.warning("abort_multipart_failed object=%s: %s (cleaned up at the next start)", out.name, exc)


def _holders(leases: Sequence[Job | FoldJob], mean: Resident | None) -> list[str | None]:
    """Per lease, the reducer holding most of its slices of ``mean`` (None: no mean, or none known)."""
    if mean is None:
        return [None] * len(leases)
    out: list[str | None] = []
    for job in leases:
        counts = Counter(mean.holders.get((s.name, s.start)) for s in job.slices)
        counts.pop(None, None)
        out.append(counts.most_common(1)[0][0] if counts else None)
    return out


class FoldAhead:
    """The reducers fold each round's updates **ahead**, as they are acknowledged, as the hub
    alone folds them into its accumulator: the close's merge leases then fold only what came
    after the last step (the last update, when peers finish apart).

    A step folds every update acknowledged and not folded yet, in acknowledgement order, after
    the round's mean so far (none before the first) into a **new** mean, cut into K fold leases
    as the merge's leases are cut (:func:`~syncserver.reduce.lease.fold_jobs`). The mean is kept
    in the memory of the reducers that fold it (:data:`~syncserver.reduce.lease.MEANS`), slice
    by slice, as the hub alone keeps its accumulator: nothing is written to a disk or a bucket,
    so a step reads only the new updates' bytes and the close reads no mean back. Each lease of
    the next step, and each merge lease, is offered first to the reducer that holds its slices.

    Only once every lease of a step is done does the accumulator name the new mean, its updates,
    who holds which slices and its weight (record before it counts). A mean is a cache of its
    updates' fold: a reducer that lacks a slice (it was killed and restarted, another reducer
    took its lease, the hub restarted) folds it again from the updates, to the same bits, so a
    reducer or a hub killed mid-fold loses nothing acknowledged; a step that fails leaves the
    accumulator as it was, and the merge folds the rest."""

    def __init__(self, board: Board, reducers: int, engine: MergeEngine) -> None:
        self.board, self.reducers, self.engine = board, reducers, engine

    async def fold(
        self, run: str, round_: int, acc: Accumulator, codec: Codec, updates: Sequence[tuple[str, UpdateKey, float]]
    ) -> None:
        """One step: fold ``updates`` ((peer, key, weight), in acknowledgement order) after
        ``acc``'s mean; ``acc`` names the new mean once every lease is done (then it counts)."""
        if acc.mean is not None:
            raise ValueError("the reducers fold ahead in their memory: the hub's accumulator must stay empty")
        base = acc.partial
        folds = (*(base.updates if base is not None else ()), *((key, weight) for _, key, weight in updates))
        sources = await to_thread.run_sync(self._sources, list(folds))
        mean = uuid.uuid4().hex
        held = len(base.updates) if base is not None else 0
        leases = fold_jobs(acc.schema, codec, self.reducers, mean, base.id if base else None, held, acc.weight, sources)
        for lease in leases:
            lease.round = round_
        reports = await self.board.run(run, round_, leases, _holders(leases, base))
        holders = {
            (s.name, s.start): done.reducer for job, done in zip(leases, reports, strict=True) for s in job.slices
        }
        acc.partial = Resident(mean, folds, holders)  # the new mean counts from here
        for peer, _, weight in updates:
            acc.folded.append(peer)
            acc.weight += weight  # summed fold by fold, as the merge sums them

    def _sources(self, updates: list[tuple[UpdateKey, float]]) -> list[UpdateSource]:
        """Worker thread: where each update lies, as its record names it (a file of the hub's, or
        its object in the bucket), as the merge's leases name it."""
        out = []
        for key, weight in updates:
            with self.engine.open_update(key) as wire:
                if isinstance(wire, ObjectTensorFile):
                    out.append(UpdateSource(object=wire.name, weight=weight))
                else:
                    out.append(UpdateSource(path=wire.path, weight=weight))
        return out
