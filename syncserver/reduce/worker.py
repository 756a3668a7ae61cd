"""``syncserver reduce --hub URL``: a reducer, one process that works work leases until killed.

    syncserver reduce --hub http://127.0.0.1:8000 --token "$SYNC_ADMIN_TOKEN"

It takes, works (:func:`syncserver.reduce.lease.work`), renews and reports one lease at a time: K
reducers are K processes, so a slow or killed one costs its own lease only. A lease naming the
hub's files needs the hub's machine; with the hub's object store (``SYNC_STORE``, ``AWS_*``) it runs
anywhere that reaches it. A hub unreachable or refusing the token at the start is a one-line error
(exit 2); later, a hub that went away is waited for (it may be restarting).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx

from syncserver.reduce.checklease import CheckReport
from syncserver.reduce.lease import Done, WorkJob, WorkLeaseLost, parse, work
from syncserver.storage.s3 import ObjectStore
from syncwire.retry import retrying

__all__ = ["ReducerError", "Reducer"]

log = logging.getLogger(__name__)

POLL_SECONDS = 5.0  # the long poll for a lease (a hub that is told to stop answers it at once)
#: the longest wait between tries at a hub that does not answer: it may be restarting, and every
#: lease waits on the reducers that come back
RETRY_MOST = 2.0


class ReducerError(Exception):
    """The hub cannot be used (unreachable at the start, wrong token, not a reducer's hub)."""


class _Busy(Exception):
    """The hub answered a lease request with an error that may pass (a 5xx, say): ask again."""


class Reducer:
    """One reducer's loop against one hub."""

    def __init__(self, hub: str, token: str | None = None, threads: int = 1) -> None:
        self.hub = hub.rstrip("/")
        # a lease's slices on a few threads, as the hub's own merge runs them (numpy, pread and
        # pwrite release the GIL): one reducer can use the cores it is given
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="reducer-slices") if threads > 1 else None
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.hub, headers=headers, timeout=httpx.Timeout(10.0, read=90.0))
        self._objects: ObjectStore | None = None  # the bucket SYNC_STORE names, opened at first use

    def close(self) -> None:
        self._http.close()
        if self._objects is not None:
            self._objects.close()
        if self._pool is not None:
            self._pool.shutdown()

    def run_forever(self) -> None:
        """Ask once without waiting (:class:`ReducerError` unless the hub takes us), then take, work
        and report leases until killed; a hub that does not answer (it restarts, say) is asked
        again, with backoff."""
        try:
            job = self._take(wait=0.0, strict=True)
        except httpx.HTTPError as exc:
            raise ReducerError(f"cannot reach the hub at {self.hub}: {exc}") from None
        log.info("reducer %s working for %s", self.name, self.hub)
        while True:
            if job is not None:
                self.do(job)
            for attempt in retrying(
                lambda exc: isinstance(exc, httpx.HTTPError | _Busy),
                most=RETRY_MOST,
                before_sleep=lambda exc, _: log.warning("reducer %s: no lease (%s), retrying", self.name, exc),
            ):
                with attempt:
                    job = self._take(wait=POLL_SECONDS)

    def do(self, job: WorkJob) -> None:
        """Work one lease, renewing it meanwhile, and report it."""
        with self._renewing(job) as lost:
            try:
                objects = self._store if os.environ.get("SYNC_STORE") else None
                report = work(job, self.name, stop=lost.is_set, pool=self._pool, objects=objects)
            except WorkLeaseLost:
                log.warning("reducer %s: %s lease %s lost mid-work, dropped", self.name, job.kind, job.lease)
                return
        if self._report(job, report):
            log.info("reducer %s: %s lease %s reported in %.3f s", self.name, job.kind, job.lease, report.seconds)

    @contextlib.contextmanager
    def _renewing(self, job: WorkJob) -> Iterator[threading.Event]:
        """Renew ``job``'s lease every third of its length, from a thread, while the body runs; the
        event is set once the hub says the lease is lost (and, on the way out, to stop the renewer)."""
        lost = threading.Event()

        def renew() -> None:
            while not lost.wait(max(0.05, job.seconds / 3)):
                with contextlib.suppress(httpx.HTTPError):  # the lease may still hold: the next renewal tries
                    answer = self._http.post(f"/v1/reduce/leases/{job.lease}/renew", json={"reducer": self.name})
                    if answer.status_code in (404, 409):
                        lost.set()

        renewer = threading.Thread(target=renew, daemon=True, name="reducer-renew")
        renewer.start()
        try:
            yield lost
        finally:
            lost.set()
            renewer.join()

    def _report(self, job: WorkJob, report: Done | CheckReport) -> bool:
        """POST a lease's report; True once the hub took it. One not sent, or too late (409), is
        logged: the lease expires and is redone."""
        try:
            answer = self._http.post(f"/v1/reduce/leases/{job.lease}/{job.report}", json=report.model_dump(mode="json"))
        except httpx.HTTPError as exc:
            log.warning("reducer %s: could not report lease %s (%s): it will expire", self.name, job.lease, exc)
            return False
        if answer.status_code == 409:
            log.warning("reducer %s: lease %s was lost before its report", self.name, job.lease)
        elif answer.status_code != 204:
            log.warning("reducer %s: report of lease %s refused: %s", self.name, job.lease, answer.text[:300])
        return answer.status_code == 204

    def _store(self) -> ObjectStore:
        if self._objects is None:
            self._objects = ObjectStore.from_url(os.environ["SYNC_STORE"])
        return self._objects

    def _take(self, wait: float, strict: bool = False) -> WorkJob | None:
        answer = self._http.post("/v1/reduce/lease", json={"reducer": self.name, "wait": wait})
        if answer.status_code == 204:
            return None
        if answer.status_code != 200:
            if strict or answer.status_code in (401, 403, 404, 409):
                raise ReducerError(f"the hub at {self.hub} refused a reducer: {_reason(answer)}")
            raise _Busy(_reason(answer))
        try:
            return parse(answer.json())
        except ValueError as exc:  # pydantic's ValidationError is one
            raise ReducerError(f"the hub at {self.hub} answered a lease request with no lease: {exc}") from None


def _reason(answer: httpx.Response) -> str:
    try:
        body = answer.json()
        return f"{answer.status_code} {body.get('error')}: {body.get('detail')}"
    except ValueError:
        return f"{answer.status_code} {answer.text[:200]!r}"


def main(hub: str, token: str | None, threads: int = 1) -> None:
    """The ``syncserver reduce`` command's body: check the hub, then work until killed."""
    with contextlib.closing(Reducer(hub, token, threads=threads)) as reducer:
        reducer.run_forever()
