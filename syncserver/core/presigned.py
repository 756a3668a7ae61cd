"""Updates that peers upload straight to the object store (``SYNC_STORE``), through presigned
part URLs for one key (routes ``.../presign`` and ``.../uploaded``; docs/object-store.md, "How an
update goes"). Invariants a change must keep:

- An acknowledged object is immutable by construction: its name is this attempt's own
  (:func:`~syncserver.storage.bucket.update_name`), its upload is completed (its part URLs are
  dead), and no clean-up here deletes a name a record holds (:meth:`PresignedUploads._drop`).
- Every check of what can change while a request waits (the round, an acknowledgement, the open
  upload) is made under the peer's lock, which ``uploaded`` holds until the acknowledgement.
- A refusal is a 4xx with its reason, the object deleted, nothing recorded; a store that fails or
  hangs past ``SYNC_STORE_CONTROL_SECONDS`` is 503 ``store_unavailable`` (the peer PUTs instead).
- Open uploads live in memory only: a restarted hub aborts those no record names, and answers
  their reports 409 ``upload_unknown``. No reducer's word alone ever refuses a peer
  (:meth:`Reducers.check <syncserver.core.workers.Reducers.check>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
from anyio import to_thread

from syncserver.core.planes import LocalPlane
from syncserver.core.rounds import Acknowledgement, Rounds, Ticket
from syncserver.core.state import Run
from syncserver.core.workers import Workers
from syncserver.errors import BadRequest, Conflict, PayloadTooLarge, StoreDown, UploadUnknown
from syncserver.reduce.check import Checked, UpdateRules, check_update
from syncserver.reduce.checklease import CheckJob, CheckRules
from syncserver.storage.bucket import update_name
from syncserver.storage.s3 import ObjectMissing, StoreError, StoreRefused
from syncwire import FormatError, TensorInfo

__all__ = ["Plan", "PresignedUploads", "UploadReport"]

log = logging.getLogger(__name__)

T = TypeVar("T")

PART_BYTES = 8 << 20  # S3's 5 MiB amortises no request on a far link; a part re-sent must not be 100s of MB
ATTEMPT_BYTES = 8  # random bytes in each upload attempt's object name


@dataclass(frozen=True)
class Plan:
    """Where an update goes: its object's name, upload and part size, a presigned PUT per part the
    store lacks (``urls``), the ETags of those it holds (``done``), the URLs' ``expires`` (unix)."""

    object: str
    upload_id: str
    size: int
    part_size: int
    urls: dict[int, str]
    done: dict[int, str]
    expires: float


@dataclass(frozen=True)
class UploadReport:
    """What a peer says it uploaded, with what a PUT of the update carries in its headers."""

    key: str
    size: int
    digest: str
    etags: dict[int, str]
    samples: int
    metrics: dict[str, float]
    final: bool = False


@dataclass
class _Open:
    """An upload handed out and not yet reported."""

    round: int
    key: str
    name: str
    upload_id: str
    size: int
    part_size: int
    began: float = field(default_factory=time.monotonic)

    @property
    def parts(self) -> int:
        return max(1, -(-self.size // self.part_size))

    def part_bytes(self, number: int) -> int:
        return min(self.part_size, self.size - (number - 1) * self.part_size)


class PresignedUploads:
    """The uploads into the object store that the hub handed out, one per (run, peer)."""

    def __init__(self, rounds: Rounds, plane: LocalPlane, scratch: Path, workers: Workers) -> None:
        self.rounds = rounds
        self.plane = plane  # no bucket: every request is 409 no_store
        self.workers = workers  # who checks the bodies
        self.scratch = scratch  # where a check that takes a norm spools the body (the hub's tmp/)
        self._open: dict[tuple[str, str], _Open] = {}
        self._locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)

    async def presign(self, run: Run, round_: int, peer: str, key: str, size: int) -> Plan:
        """URLs to upload ``key``'s update of ``size`` bytes to round ``round_``, every refusal before any
        URL (under the peer's lock: a presign racing an acknowledgement sees it)."""
        bucket = self.plane.uploads_to(run)
        assert run.shape is not None
        if size > run.shape.max_update_bytes:
            raise PayloadTooLarge(f"body of {size} bytes is over the {run.shape.max_update_bytes}-byte limit")
        objects = bucket.objects
        async with self._locks[run.name, peer]:
            await self.rounds.check_open(run, round_)
            if self.rounds.store.update_from(run.name, peer, round_) is not None:
                raise Conflict(
                    f"peer {peer!r} already has an update acknowledged for round {round_}", current_version=run.version
                )
            if not bucket.up:
                raise StoreDown(f"the object store {bucket.url} is down: PUT the update to the hub")
            opened = self._open.get((run.name, peer))
            done: dict[int, str] = {}
            if opened is not None and (opened.round, opened.key, opened.size) == (round_, key, size):
                try:  # the same upload again (a resume): the parts the store holds whole stay
                    held = await self._store(run, objects.list_parts, opened.name, opened.upload_id)
                    done = {n: p.etag for n, p in held.items() if n <= opened.parts and p.size == opened.part_bytes(n)}
                except UploadUnknown:  # gone from the store: start it again
                    opened = None
            elif opened is not None:  # the peer gave up on that one
                await self._drop(run, opened)
                opened = None
            if opened is None:
                # this attempt's own name: the object the acknowledgement records is the one checked
                name = update_name(run.name, round_, peer, key, secrets.token_hex(ATTEMPT_BYTES))
                upload_id = await self._store(run, objects.create_multipart, name)
                opened = _Open(round_, key, name, upload_id, size, objects.part_size(size, PART_BYTES))
                self._open[run.name, peer] = opened
        expires = time.time() + objects.url_seconds
        lacking = (n for n in range(1, opened.parts + 1) if n not in done)
        urls = {n: objects.presign_part(opened.name, opened.upload_id, n) for n in lacking}
        return Plan(opened.name, opened.upload_id, size, opened.part_size, urls, done, expires)

    async def uploaded(self, run: Run, round_: int, peer: str, report: UploadReport) -> Acknowledgement:
        """The peer uploaded every part: complete, check, acknowledge (a repeat: its acknowledgement)."""
        self.plane.uploads_to(run)
        async with self._locks[run.name, peer]:
            opened = self._open.get((run.name, peer))
            if opened is None or (opened.round, opened.key) != (round_, report.key):
                repeat = self.rounds.acknowledged(run, round_, peer, report.digest)
                if repeat is not None:  # a retry whose first attempt was acknowledged
                    return repeat
                raise UploadUnknown(
                    f"no upload of key {report.key!r} for round {round_} is open on the hub (it restarted, or another "
                    "upload replaced it): ask /presign again"
                )
            del self._open[run.name, peer]  # settled here, whatever comes of it
            try:
                ack = await self._settle(run, opened, peer, report)
            except BaseException:
                with anyio.CancelScope(shield=True):  # tidy up even when the request is cancelled
                    await self._drop(run, opened)
                raise
            if ack.repeat:  # the same update, acknowledged before from another copy: this one goes
                await self._drop(run, opened)
            return ack

    async def _settle(self, run: Run, opened: _Open, peer: str, report: UploadReport) -> Acknowledgement:
        objects = self.plane.uploads_to(run).objects
        size, digest, etags = report.size, report.digest, report.etags
        seconds = time.monotonic() - opened.began  # the upload phase: from the plan to the report
        if size != opened.size:
            raise BadRequest(f"the upload was presigned for {opened.size} bytes, not {size}")
        if sorted(etags) != list(range(1, opened.parts + 1)):
            raise BadRequest(f"etags must name parts 1 to {opened.parts}, each once")
        # ETags compared here: not every store refuses a complete naming ETags it does not hold
        held = await self._store(run, objects.list_parts, opened.name, opened.upload_id)
        for number, etag in sorted(etags.items()):
            part = held.get(number)
            if part is None or part.etag != etag.strip('"'):
                said = "holds no such part" if part is None else f"holds it with another ETag than {etag[:40]!r}"
                raise BadRequest(f"part {number}: the object store {said}")
        info = await self._store(run, objects.complete_multipart, opened.name, opened.upload_id, etags)
        if info.size != size:
            raise BadRequest(f"the object holds {info.size} bytes, not the {size} declared")
        assert run.shape is not None and run.schema is not None
        rules = UpdateRules(run.shape.layout, run.schema, run.codec, run.shape.max_update_bytes, run.checks_norm)
        job = CheckJob(
            lease="",
            run=run.name,
            round=opened.round,
            peer=peer,
            seconds=0.0,
            object=opened.name,
            size=opened.size,
            digest=digest,
            rules=CheckRules.of(rules),
        )

        def check() -> Checked:  # the hub's own: one GET, closed once the check stops reading
            with contextlib.closing(objects.stream(opened.name)) as chunks:
                return check_update(chunks, rules, spool=self.scratch)

        checked = await self.workers.check(job, functools.partial(self._store, run, check))
        if checked.digest != digest:
            raise BadRequest(f"body digest sha-256 {checked.digest} does not match the declared {digest}")
        ticket = Ticket(
            run.name, opened.round, peer, digest, report.samples, report.metrics, size, _no_body, final=report.final
        )
        return await self.rounds.commit_object(run, ticket, opened.name, checked.nbytes, seconds, checked.norm)

    async def _drop(self, run: Run, opened: _Open) -> None:
        """Delete an upload's object and parts, never one a record names (a store failing: next start)."""
        keep = self.rounds.store.names_update_object(run.name, opened.name)
        objects = self.plane.uploads_to(run).objects

        def drop() -> None:
            objects.abort_multipart(opened.name, opened.upload_id)
            if not keep:
                objects.delete(opened.name)

        try:
            await to_thread.run_sync(drop)
        except StoreError as exc:
            log.warning("object_store_delete_failed run=%s object=%s: %s", run.name, opened.name, exc)

    async def _store(self, run: Run, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread, the store's errors said as the hub's."""
        try:
            return await to_thread.run_sync(functools.partial(fn, *args))
        except ObjectMissing:
            raise UploadUnknown("the object store holds no such upload any more: ask /presign again") from None
        except StoreRefused as exc:  # a part the store does not hold with that ETag: the peer's word is false
            raise BadRequest(f"the object store refused to complete the upload: {exc}") from None
        except StoreError as exc:
            self.plane.uploads_to(run).failed(run.name, f"an update upload: {exc}")
            raise StoreDown(f"the object store failed ({exc}): PUT the update to the hub") from None


def _no_body(infos: dict[str, TensorInfo]) -> None:
    raise FormatError("this update is in the object store: the hub takes no body for it")
