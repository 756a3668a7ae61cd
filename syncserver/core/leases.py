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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from anyio import to_thread

from syncserver.errors import LeaseLost, NotFound
from syncserver.reduce.engine import Accumulator, MergeEngine, NonFinite, Outer
from syncserver.reduce.lease import Done, Job, ObjectOutput, jobs, work
from syncserver.storage.bucket import object_name
from syncserver.storage.s3 import ObjectStore, StoreError
from syncserver.storage.store import Key, ObjectRecord, Published, ResultKey, UpdateKey, VersionKey
from syncwire import Codec

__all__ = ["LEASE_POLL_MAX", "Board", "LeaseFailed", "ReducerStats", "merge_leased"]

log = logging.getLogger(__name__)

#: ids of leases gone (expired, or their round's merge ended) that are remembered, to answer a
#: late report with 409 rather than 404
GONE_KEPT = 4096
#: the name under which the hub works a lease itself (no reducer for a lease length)
HUB = "hub"
#: the longest a reducer's request for a lease is held (its long poll), in seconds
LEASE_POLL_MAX = 60.0


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


@dataclass
class _Lease:
    job: Job
    merge: _Merge
    holder: str | None = None
    deadline: float = 0.0
    taken: float = 0.0
    done: bool = False


@dataclass
class _Merge:
    """One round's leases being worked."""

    run: str
    round: int
    leases: list[_Lease] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    failure: BaseException | None = None


class Board:
    """Every merge lease of one hub: offered, held, done."""

    def __init__(self, lease_seconds: float, objects: Callable[[], ObjectStore] | None = None) -> None:
        self.lease_seconds = lease_seconds
        self.objects = objects  # SYNC_STORE: where the hub reads updates in the bucket, working a lease itself
        self._pending: deque[_Lease] = deque()
        self._held: dict[str, _Lease] = {}  # by lease id
        self._gone: dict[str, None] = {}  # ids no longer valid (insertion-ordered, bounded)
        self._offered = asyncio.Condition()
        self._changed = asyncio.Event()  # a lease was done or failed: the merges look again
        self._polling = 0  # reducers waiting for a lease right now
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

    async def take(self, reducer: str, wait: float) -> Job | None:
        """The next lease offered, held by ``reducer`` from now; None after ``wait`` seconds."""
        self._seen(reducer)
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        self._polling += 1
        try:
            async with self._offered:
                while not self._pending:
                    left = until - loop.time()
                    if left <= 0:
                        self._seen(reducer)  # it was there all along
                        return None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._offered.wait(), left)
                lease = self._pending.popleft()
        finally:
            self._polling -= 1
        stats = self._seen(reducer)
        lease.job = lease.job.model_copy(update={"lease": uuid.uuid4().hex, "seconds": self.lease_seconds})
        lease.holder, lease.taken = reducer, time.monotonic()
        lease.deadline = lease.taken + self.lease_seconds
        self._held[lease.job.lease] = lease
        stats.holding = lease.job.lease
        self._changed.set()  # the merge waits on the new deadline
        log.info(
            "lease_taken run=%s round=%d lease=%s reducer=%s slices=%d mb=%.1f",
            lease.merge.run,
            lease.merge.round,
            lease.job.lease,
            reducer,
            len(lease.job.slices),
            lease.job.reads * len(lease.job.updates) / 1e6,
        )
        return lease.job

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
        merge = lease.merge
        if report.error is None:
            lease.done = True
            stats.leases += 1
            stats.seconds += report.seconds
            stats.last_seconds = report.seconds
            stats.bytes += report.bytes
        elif merge.failure is None:
            failure = NonFinite if report.error == "non_finite" else LeaseFailed
            merge.failure = failure(f"reducer {report.reducer}: {report.detail}")
        self._changed.set()

    def _forget(self, lease_id: str) -> None:
        self._gone[lease_id] = None
        while len(self._gone) > GONE_KEPT:
            del self._gone[next(iter(self._gone))]

    # ---- the merge's side ----------------------------------------------------------------
    async def run(self, run: str, round_: int, offered: Sequence[Job]) -> None:
        """Offer these leases and wait until every lease of it is done; an expired lease is offered
        again (first in line). Raises what a lease reported (:class:`NonFinite`, :class:`LeaseFailed`);
        either way, or cancelled, nothing of this merge stays on the board."""
        merge = _Merge(run, round_)
        merge.leases = [_Lease(job.model_copy(update={"run": run}), merge) for job in offered]
        await self._offer(merge.leases)
        try:
            while merge.failure is None and not all(lease.done for lease in merge.leases):
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
            report = await to_thread.run_sync(functools.partial(work, job, HUB, objects=self.objects))
        except Exception as exc:
            report = Done(reducer=HUB, seconds=0, bytes=0, error="failed", detail=repr(exc)[:2000])
        stats = self.reducers.setdefault(HUB, ReducerStats(HUB, time.time(), time.time()))
        stats.last_seen = time.time()
        if report.error is None:
            lease.done = True
            stats.leases += 1
            stats.seconds += report.seconds
            stats.last_seconds = report.seconds
            stats.bytes += report.bytes
        elif merge.failure is None:
            failure = NonFinite if report.error == "non_finite" else LeaseFailed
            merge.failure = failure(f"{HUB}: {report.detail}")

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

    def live(self, within: float) -> list[ReducerStats]:
        """Reducers heard from in the last ``within`` seconds, by name."""
        t = time.time()
        return sorted((r for r in self.reducers.values() if t - r.last_seen <= within), key=lambda r: r.name)


async def merge_leased(
    board: Board,
    reducers: int,
    engine: MergeEngine,
    run: str,
    round_: int,
    acc: Accumulator,
    codec: Codec,
    outer: Outer,
    *,
    total: float,
    fraction: float,
    final: bool = False,
    unfolded: Sequence[tuple[UpdateKey, float]] = (),
) -> tuple[int, list[ObjectRecord]]:
    """:meth:`MergeEngine.merge`'s work, shared by the reducers: open the merge, hand out its
    leases, wait for them, publish the outputs; the result's size, and the records of the
    objects the reducers wrote (none on local disk). The hub folds nothing before a leased merge
    (``acc`` is empty): the reducers fold every update in acknowledgement order, which gives the
    same bits as folding some first.

    With an object store (the board's ``objects``) the result and version v+1 are multipart
    uploads that the reducers write a part each of (:func:`_into_bucket`), completed here once
    every lease is done; the caller records them in the round's commit (record last), so the hub
    uploads neither. On local disk: the staged files, fsynced and published (rename)."""
    if acc.mean is not None:
        raise ValueError("a leased merge folds every update itself: the accumulator must be empty")
    files = contextlib.ExitStack()
    outputs: list[tuple[Published, ObjectOutput]] = []
    try:
        objects = board.objects
        into = _into_bucket(objects(), outputs) if objects is not None else None
        opened = functools.partial(
            engine.open_merge,
            files,
            run,
            round_,
            acc,
            codec,
            outer,
            total=total,
            fraction=fraction,
            final=final,
            unfolded=unfolded,
            into=into,
        )
        merge = await to_thread.run_sync(opened)
        leases = await to_thread.run_sync(jobs, merge, acc.schema, reducers)
        await board.run(run, round_, leases)
        records = [await to_thread.run_sync(_complete, objects, key, out) for key, out in outputs] if objects else []
    except BaseException as exc:
        await to_thread.run_sync(files.__exit__, type(exc), exc, exc.__traceback__)
        if outputs and board.objects is not None:
            await to_thread.run_sync(_abort, board.objects(), [out for _, out in outputs])
        raise
    await to_thread.run_sync(files.close)
    return merge.result_size, records


def _into_bucket(
    objects: ObjectStore, outputs: list[tuple[Published, ObjectOutput]]
) -> Callable[[Key, int], contextlib.AbstractContextManager[ObjectOutput]]:
    """:meth:`MergeEngine.open_merge`'s ``into`` for a hub with an object store: each output
    (the result, version v+1) a multipart upload opened at its name, collected in ``outputs``."""

    @contextlib.contextmanager
    def into(key: Key, size: int) -> Iterator[ObjectOutput]:
        if not isinstance(key, ResultKey | VersionKey):
            raise TypeError(f"only results and versions go to the bucket as parts, not {key}")
        name = object_name(key)
        upload_id = objects.create_multipart(name)
        out = ObjectOutput(name, size, upload_id, functools.partial(objects.presign_part, name, upload_id))
        outputs.append((key, out))
        yield out

    return into


def _complete(objects: Callable[[], ObjectStore], key: Published, out: ObjectOutput) -> ObjectRecord:
    """Worker thread: publish ``out`` from the parts its leases uploaded, once each is there with
    the size its lease was given (:class:`LeaseFailed` otherwise); its record, for the commit."""
    store = objects()
    held = store.list_parts(out.name, out.upload_id)
    for number, size in out.parts.items():
        if number not in held or held[number].size != size:
            got = held[number].size if number in held else None
            raise LeaseFailed(f"{out.name}: part {number} holds {got} bytes, not {size}")
    info = store.complete_multipart(out.name, out.upload_id, {n: held[n].etag for n in out.parts})
    if info.size != out.size:
        raise LeaseFailed(f"{out.name}: completed with {info.size} bytes, not {out.size}")
    return ObjectRecord(key, info.size, info.etag)


def _abort(objects: ObjectStore, outputs: list[ObjectOutput]) -> None:
    """Worker thread: drop the multipart uploads of a merge that failed (a store that fails here
    leaves them to the next start's clean-up)."""
    for out in outputs:
        try:
            objects.abort_multipart(out.name, out.upload_id)
        except StoreError as exc:
            log.warning("abort_multipart_failed object=%s: %s (cleaned up at the next start)", out.name, exc)
