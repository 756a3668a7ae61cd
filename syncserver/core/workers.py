"""Who does the tensor work (fold, merge, build versions, check bodies uploaded to the bucket),
chosen once in :func:`~syncserver.api.factory.create_app`: the core never asks which it has.
:class:`Threads`: the hub's own. :class:`Reducers` (``SYNC_REDUCERS=K``): K reducer processes on
the hub's machine take it as leases (:mod:`syncserver.core.leases`; the same functions on the same
files, so the same bits), folding ahead in their memory. :class:`BucketReducers` (with
``SYNC_STORE``): reducers on any machine, through the bucket, building each version there (the
hub's disk holds version 0 only). Every mode writes versions in one task per run after each
commit, then prunes; a pull of a version not written yet waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from anyio import to_thread

from syncserver.core.changes import Tasks
from syncserver.core.finite import Merged
from syncserver.core.leases import (
    LEASE_POLL_MAX,
    Board,
    FoldAhead,
    ReducerStats,
    build_leased,
    merge_into_bucket,
    merge_leased,
)
from syncserver.core.planes import BucketPlane, LocalPlane
from syncserver.core.state import Run
from syncserver.errors import HubError, StoreDown, Unavailable, UploadUnknown
from syncserver.reduce.check import Checked
from syncserver.reduce.checklease import CheckJob, CheckReport, accept
from syncserver.reduce.engine import MergeEngine, RoundMerge
from syncserver.reduce.lease import FoldJob
from syncserver.storage.store import ResultKey, UpdateKey, VersionKey

__all__ = ["BucketReducers", "Reducers", "Threads", "Workers"]

log = logging.getLogger(__name__)


class Workers:
    """What every mode shares: the version files, written by the hub's threads after each commit."""

    board: Board | None = None  # the reducers' leases (HTTP: api/reduce.py); None: nothing is leased

    def __init__(self, engine: MergeEngine, plane: LocalPlane) -> None:
        self.engine = engine
        self.plane = plane
        self.store = plane.store
        self.tasks = Tasks()

    async def fold(self, run: Run) -> None:
        """Fold the updates not folded yet, in order, until the round closes (its merge folds the rest)."""
        raise NotImplementedError

    async def settle(self, run: Run) -> None:
        """The round closes: what folds ahead of it stops (what it folded counts)."""

    async def merge(self, m: RoundMerge) -> Merged:
        raise NotImplementedError

    async def check(self, job: CheckJob, own: Callable[[], Awaitable[Checked]]) -> Checked:
        """The check of a body a peer uploaded to the bucket; ``own``: the hub's own check of it."""
        return await own()

    def live(self) -> list[ReducerStats]:
        """The reducers heard from lately (none here)."""
        return []

    def end_polls(self) -> None:
        """The server stops: every long poll of a reducer answers now."""

    async def stop(self) -> None:
        await self.tasks.stop()
        self.engine.close()

    # ---- versions ---------------------------------------------------------------------------
    def start_versions(self, run: Run) -> None:
        """Write the committed versions lacking a file (after a commit, or a crash), then prune."""
        if run.writing is None or run.writing.done():
            run.writing = self.tasks.spawn(self._write(run))
            run.writing.add_done_callback(_log_version_failure)

    async def written(self, run: Run) -> None:
        """Until the versions being written are (re-raising the failure of that write)."""
        self.start_versions(run)
        assert run.writing is not None
        await asyncio.shield(run.writing)

    async def _write(self, run: Run) -> None:
        while True:
            target = run.version
            await self.build(run, target)
            with contextlib.suppress(Exception):  # housekeeping: a failure here loses nothing
                await self.plane.prune(run, target)
            if run.version == target:  # else rounds closed meanwhile
                return

    async def base(self, run: Run, v: int) -> None:
        """Version ``v`` is where this mode's merge of round ``v`` reads it (the hub's file)."""
        if not self.store.exists(VersionKey(run.name, v)):
            await self.written(run)

    async def build(self, run: Run, target: int) -> None:
        """Write each missing version file up to ``target``, but one only in the bucket (no result here)."""
        assert run.schema is not None
        if not self.store.exists(ResultKey(run.name, target - 1)) and self.store.stored_object(
            VersionKey(run.name, target)
        ):
            return
        await to_thread.run_sync(self.engine.build_versions, run.name, target, run.codec, run.schema)


class Threads(Workers):
    """The hub's own threads do all the work (see the module docstring)."""

    async def fold(self, run: Run) -> None:
        async with run.fold_lock:
            acc = run.accumulator()
            for update in run.ordered():
                if run.closing:
                    return
                if update.peer not in acc.folded:
                    key = UpdateKey.of(run.name, update)
                    # a first fold stops when the round closes: the merge then folds every update
                    stop: Callable[[], bool] | None = (lambda: run.closing) if not acc.folded else None
                    fold = functools.partial(self.engine.fold, acc, key, run.weight(update), run.codec, stop=stop)
                    if not await to_thread.run_sync(fold):
                        return

    async def merge(self, m: RoundMerge) -> Merged:
        return await to_thread.run_sync(self.engine.merge, m), [], {}


class Reducers(Workers):
    """Reducer processes on the hub's machine take the work as leases (see the module docstring)."""

    board: Board

    def __init__(self, engine: MergeEngine, plane: LocalPlane, board: Board, count: int) -> None:
        super().__init__(engine, plane)
        self.board, self.count = board, count
        self.ahead = FoldAhead(board, count, engine)
        self._folding: dict[str, asyncio.Task[None]] = {}  # run -> its fold ahead under way

    async def fold(self, run: Run) -> None:
        """The reducers fold ahead, in a task of their own: an acknowledgement never waits on a reducer."""
        under_way = self._folding.get(run.name)
        if under_way is None or under_way.done():  # else it folds what came meanwhile, next
            self._folding[run.name] = self.tasks.spawn(self._fold_ahead(run))

    async def _fold_ahead(self, run: Run) -> None:
        """Fold ahead step by step until the round closes; a failed step costs only time."""
        async with run.fold_lock:
            while not run.closing and run.schema is not None:
                acc = run.accumulator()
                pending = [u for u in run.ordered() if u.peer not in acc.folded]
                if not pending:
                    return  # the next acknowledgement starts the next step
                updates = [(u.peer, UpdateKey.of(run.name, u), run.weight(u)) for u in pending]
                try:
                    await self.ahead.fold(run.name, run.version, acc, run.codec, updates)
                except Exception as exc:
                    log.warning(
                        "fold_ahead_failed run=%s round=%d (the merge folds the rest): %r", run.name, run.version, exc
                    )
                    return

    async def settle(self, run: Run) -> None:
        """Wait for the fold step under way, but stop it while a lease of it waits (nothing folded is lost)."""
        task = self._folding.get(run.name)
        while task is not None and not task.done():
            if self.board.offered(run.name, FoldJob):
                task.cancel()
            await asyncio.wait({task}, timeout=0.05)

    async def merge(self, m: RoundMerge) -> Merged:
        size, peaks = await merge_leased(self.board, self.count, self.engine, m)
        return size, [], peaks

    async def check(self, job: CheckJob, own: Callable[[], Awaitable[Checked]]) -> Checked:
        """A reducer's check if one is alive, else the hub's own. Only a pass agreeing with what the hub can
        compare (:func:`accept`, the digest) is taken; else the hub checks, and judges the report."""
        report = await self.board.check(job)
        if report is None:
            return await own()
        taken = accept(report, job)
        if taken is not None and taken.digest == job.digest:
            return taken
        try:
            mine = await own()
        except HubError as exc:
            if not isinstance(exc, StoreDown | UploadUnknown):
                self._judge(job, report, taken, None)
            raise
        self._judge(job, report, taken, mine)
        return mine

    def _judge(self, job: CheckJob, report: CheckReport, taken: Checked | None, mine: Checked | None) -> None:
        """Count a reducer's report as its failure unless the hub's check (``mine``; None: refused) agrees."""
        if report.failed is not None:
            why = f"it could not check the body: {report.failed}"
        elif report.refused is not None:
            if mine is None:
                return  # the hub refuses it too: the peer's answer is the hub's own
            why = f"it refused a body that passes the hub's check: {report.refused.detail}"
        elif mine is None:
            why = "it passed a body that fails the hub's check"
        elif taken is None:
            why = "its report does not match the object (size, or norm)"
        elif taken.digest != mine.digest:
            why = f"it reported sha-256 {taken.digest} for a body of {mine.digest}"
        else:
            return  # the body is not what the peer declared, as the reducer said
        self.board.check_failed(report.reducer, job.run, job.object, why)

    def live(self) -> list[ReducerStats]:
        """The reducers heard from in the last three lease lengths and a long poll, by name."""
        return self.board.live(3 * self.board.lease_seconds + LEASE_POLL_MAX)

    def end_polls(self) -> None:
        self.board.end_polls()
        self._drop_folds()

    async def stop(self) -> None:
        self._drop_folds()
        await super().stop()

    def _drop_folds(self) -> None:
        for task in self._folding.values():  # a fold ahead is dropped, not waited for: nothing of it counts yet
            task.cancel()


class BucketReducers(Reducers):
    """Reducers on any machine, through the bucket (see the module docstring)."""

    plane: BucketPlane

    async def merge(self, m: RoundMerge) -> Merged:
        return await merge_into_bucket(self.board, self.count, self.engine, m, self.plane.objects)

    async def base(self, run: Run, v: int) -> None:
        """Version ``v`` has a copy in the bucket for the reducers: built after the last commit (waited
        for), or uploaded now (version 0); :class:`Unavailable` if the store fails (the close retries)."""
        key = VersionKey(run.name, v)
        if self.store.stored_object(key) is None and not self.store.exists(key):
            await self.written(run)
        if self.store.stored_object(key) is not None:
            return
        if (record := await self.plane.upload(run, key)) is None:
            raise Unavailable(f"the object store {self.plane.url} is down: version {v} cannot reach the reducers")
        self.store.record_object(record)

    async def build(self, run: Run, target: int) -> None:
        """Have the reducers build each version up to ``target`` the bucket lacks, recording each."""
        assert run.schema is not None
        first = target
        while first > 0 and self.store.stored_object(VersionKey(run.name, first)) is None:
            first -= 1
        for v in range(first, target):
            record, peaks = await build_leased(
                self.board, self.count, run.name, v, run.schema, run.codec, self.plane.objects
            )
            self.store.record_object(record)
            run.peaks = (v + 1, peaks)  # exact: the next merge's bound
            log.info("version_built run=%s version=%d mb=%.1f by=reducers", run.name, v + 1, record.size / 1e6)


def _log_version_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        # the results are durable, so nothing is lost: the next pull or commit retries
        log.error("version_write_failed: %r (will retry)", task.exception())
