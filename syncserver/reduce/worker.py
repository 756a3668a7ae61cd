"""``syncserver reduce --hub URL``: a reducer, one process that works merge leases until stopped.

    syncserver reduce --hub http://127.0.0.1:8000 --token "$SYNC_ADMIN_TOKEN"

It long-polls the hub for a lease (``POST /v1/reduce/lease``), works it
(:func:`syncserver.reduce.lease.work`: ``pread`` of its slices of every update and of version v,
``pwrite`` of its byte ranges of the hub's staged outputs, so on the hub's machine; with the
hub's object store, ranged GETs of the updates (and of version v, for a slice its bound does
not clear) and a PUT of its part of the result, so anywhere that reaches the store, given
``SYNC_STORE`` and the ``AWS_*`` variables, but for DiLoCo's momentum and topk's residual, still
files of the hub's), renews it from a thread while working, and reports it done. A check lease
(``kind: check``, an update a peer uploaded to the bucket: :mod:`syncserver.reduce.checklease`) is
streamed from the bucket and checked, and reported to ``/checked``; a build lease (``kind:
build``, :func:`syncserver.reduce.lease.work_build`) adds a committed result to version v by
ranges and PUTs its part of version v+1; a fold lease (``kind: fold``,
:func:`syncserver.reduce.lease.work_fold`) folds the updates acknowledged since the last one
into its span of the round's mean, ahead of the close. One lease at a time, one thread:
K reducers are K processes, so a slow or killed one costs its own lease only. A hub that
cannot be reached or refuses the token at the start is a one-line error (exit 2); later, a
hub that went away is waited for (it may be restarting), a lease found lost is dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
from pydantic import ValidationError

from syncserver.reduce.checklease import CheckJob, work_check
from syncserver.reduce.lease import BuildJob, Done, FoldJob, Job, LeaseStopped, work, work_build, work_fold
from syncserver.storage.s3 import ObjectStore

__all__ = ["ReducerError", "Reducer"]

log = logging.getLogger(__name__)

POLL_SECONDS = 5.0  # the long poll for a lease (a hub that is told to stop answers it at once)
RETRY_SECONDS = 1.0  # between tries at a hub that does not answer


class ReducerError(Exception):
    """The hub cannot be used (unreachable at the start, wrong token, not a reducer's hub)."""


class Reducer:
    """One reducer's loop against one hub."""

    def __init__(self, hub: str, token: str | None = None, name: str | None = None, threads: int = 1) -> None:
        self.hub = hub.rstrip("/")
        # a lease's slices on a few threads, as the hub's own merge runs them (numpy, pread and
        # pwrite release the GIL): one reducer can use the cores it is given
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="reducer-slices") if threads > 1 else None
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.hub, headers=headers, timeout=httpx.Timeout(10.0, read=90.0))
        self._stop = threading.Event()
        self._objects: ObjectStore | None = None  # the hub's bucket, for updates peers uploaded there

    def close(self) -> None:
        self._http.close()
        if self._objects is not None:
            self._objects.close()
        if self._pool is not None:
            self._pool.shutdown()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> Job | BuildJob | FoldJob | CheckJob | None:
        """One lease request without waiting: :class:`ReducerError` unless the hub takes us;
        the lease it gave, if one was waiting (to be worked first)."""
        try:
            return self._take(wait=0.0, strict=True)
        except httpx.HTTPError as exc:
            raise ReducerError(f"cannot reach the hub at {self.hub}: {exc}") from None

    def run_forever(self) -> None:
        """Take, work and report leases until :meth:`stop`."""
        log.info("reducer %s working for %s", self.name, self.hub)
        while not self._stop.is_set():
            try:
                job = self._take(wait=POLL_SECONDS)
            except httpx.HTTPError as exc:  # the hub restarts, say: wait for it
                log.warning("reducer %s: hub unreachable (%s), retrying", self.name, exc)
                self._stop.wait(RETRY_SECONDS)
                continue
            if job is not None:
                self.do(job)

    def do(self, job: Job | BuildJob | FoldJob | CheckJob) -> None:
        """Work one lease, renewing it meanwhile, and report it."""
        if isinstance(job, CheckJob):
            self.do_check(job)
            return
        with self._renewing(job) as lost:
            try:
                if isinstance(job, BuildJob):
                    done = work_build(job, self.name, stop=lost.is_set, pool=self._pool, objects=self._store)
                elif isinstance(job, FoldJob):
                    done = work_fold(job, self.name, stop=lost.is_set, pool=self._pool, objects=self._store)
                else:
                    done = work(job, self.name, stop=lost.is_set, pool=self._pool, objects=self._store)
            except LeaseStopped:
                log.warning("reducer %s: lease %s lost mid-work, dropped", self.name, job.lease)
                return
            except Exception as exc:  # the hub fails the close, and tries it again later
                log.exception("reducer %s: lease %s failed", self.name, job.lease)
                done = Done(reducer=self.name, seconds=0.0, bytes=0, error="failed", detail=repr(exc)[:2000])
        if self._report(job.lease, "done", done.model_dump(mode="json")):
            log.info("reducer %s: lease %s done in %.3f s", self.name, job.lease, done.seconds)

    def do_check(self, job: CheckJob) -> None:
        """Check one uploaded body (renewing the lease meanwhile) and report it: passed, refused or failed."""
        with self._renewing(job):
            report = work_check(job, self.name, self._store)
        if self._report(job.lease, "checked", report.model_dump(mode="json")):
            outcome = "passed" if report.digest else "refused" if report.refused else f"failed ({report.failed})"
            log.info(
                "reducer %s: check %s of %s %s in %.3f s", self.name, job.lease, job.object, outcome, report.seconds
            )

    @contextlib.contextmanager
    def _renewing(self, job: Job | BuildJob | FoldJob | CheckJob) -> Iterator[threading.Event]:
        """Renew ``job``'s lease on a thread while the body runs; the event is set once the
        hub says the lease is lost (and, on the way out, to stop the renewer)."""
        lost = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(job, lost), daemon=True, name="reducer-renew")
        renewer.start()
        try:
            yield lost
        finally:
            lost.set()
            renewer.join()

    def _report(self, lease: str, what: str, body: dict[str, object]) -> bool:
        """POST a lease's report (``done`` or ``checked``); True once the hub took it. A report
        that cannot be sent, or comes too late (409), is logged: the lease expires and is redone."""
        try:
            answer = self._http.post(f"/v1/reduce/leases/{lease}/{what}", json=body)
        except httpx.HTTPError as exc:
            log.warning("reducer %s: could not report lease %s (%s): it will expire", self.name, lease, exc)
            return False
        if answer.status_code == 409:
            log.warning("reducer %s: lease %s was lost before its report", self.name, lease)
        elif answer.status_code != 204:
            log.warning("reducer %s: report of lease %s refused: %s", self.name, lease, answer.text[:300])
        return answer.status_code == 204

    def _store(self) -> ObjectStore:
        """The bucket that SYNC_STORE names (and the AWS_* variables sign for), as the hub's."""
        if self._objects is None:
            url = os.environ.get("SYNC_STORE", "")
            if not url:
                raise RuntimeError("a lease reads updates in the object store: set SYNC_STORE and AWS_* as the hub's")
            self._objects = ObjectStore.from_url(url)
        return self._objects

    def _renew(self, job: Job | BuildJob | FoldJob | CheckJob, lost: threading.Event) -> None:
        every = max(0.05, job.seconds / 3)
        while not lost.wait(every):
            try:
                answer = self._http.post(f"/v1/reduce/leases/{job.lease}/renew", json={"reducer": self.name})
            except httpx.HTTPError:
                continue  # the lease may still hold: try again
            if answer.status_code in (404, 409):
                lost.set()

    def _take(self, wait: float, strict: bool = False) -> Job | BuildJob | FoldJob | CheckJob | None:
        answer = self._http.post("/v1/reduce/lease", json={"reducer": self.name, "wait": wait})
        if answer.status_code == 204:
            return None
        if answer.status_code != 200:
            reason = _reason(answer)
            if strict or answer.status_code in (401, 403, 404, 409):
                raise ReducerError(f"the hub at {self.hub} refused a reducer: {reason}")
            log.warning("reducer %s: lease request refused (%s), retrying", self.name, reason)
            self._stop.wait(RETRY_SECONDS)
            return None
        try:
            lease = answer.json()
            kind = lease.get("kind") if isinstance(lease, dict) else None
            if kind == "check":
                return CheckJob.model_validate(lease)
            if kind == "build":
                return BuildJob.model_validate(lease)
            if kind == "fold":
                return FoldJob.model_validate(lease)
            return Job.model_validate(lease)
        except (ValueError, ValidationError) as exc:
            raise ReducerError(f"the hub at {self.hub} answered a lease request with no lease: {exc}") from None


def _reason(answer: httpx.Response) -> str:
    try:
        body = answer.json()
        return f"{answer.status_code} {body.get('error')}: {body.get('detail')}"
    except ValueError:
        return f"{answer.status_code} {answer.text[:200]!r}"


def main(hub: str, token: str | None, threads: int = 1) -> None:
    """The ``syncserver reduce`` command's body: check the hub, then work until killed."""
    reducer = Reducer(hub, token, threads=threads)
    try:
        first = reducer.check()
        if first is not None:
            reducer.do(first)
        started = time.monotonic()
        reducer.run_forever()
        log.info("reducer %s stopped after %.0f s", reducer.name, time.monotonic() - started)
    finally:
        reducer.close()
