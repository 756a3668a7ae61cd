"""Where the bytes live (the data plane), chosen once in :func:`~syncserver.api.factory.create_app`:
the core never asks which plane it has. :class:`LocalPlane`: the hub's disk alone.
:class:`BucketPlane` (``SYNC_STORE``, docs/object-store.md): also a bucket, where peers upload
updates (:mod:`syncserver.core.presigned`: its only copy) and are sent (a 307) for results and
versions, so the hub's link carries each object once; the hub uploads each result before its
commit and each version on its first download, keeps its own copy, prunes both together (records
first) and deletes at start what no record names. A store that fails is *down* for
:data:`DOWN_SECONDS`: downloads come from the hub's disk, and one warning per run says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from anyio import to_thread

from syncserver.core.state import Run, Via
from syncserver.errors import NoStore, Unavailable
from syncserver.storage.bucket import object_name
from syncserver.storage.s3 import ObjectStore, StoreError
from syncserver.storage.store import Blob, Missing, ObjectRecord, Published, ResultKey, Store, VersionKey

__all__ = ["DOWN_SECONDS", "BucketPlane", "LocalPlane", "Redirect"]

log = logging.getLogger(__name__)

DOWN_SECONDS = 30.0  # after a failure, how long the store is left alone before it is tried again


@dataclass(frozen=True)
class Redirect:
    """A download to send to the object store: a presigned GET of the copy, and its size."""

    url: str
    size: int


class LocalPlane:
    """The hub's disk alone: what every plane does, and nothing in a bucket."""

    uploads: Via = "hub"  # where peers send their updates (the ready answer says it)

    def __init__(self, store: Store, keep_versions: int) -> None:
        self.store = store
        self.keep_versions = keep_versions
        self.url: str | None = None  # the bucket as status and the dashboard show it (no credential)
        self.reads: Callable[[], int] | None = None  # bytes the hub read from the bucket (/metrics)
        self.stored: list[Callable[[str, int], None]] = []  # told of each upload of the hub's: (run, bytes)

    def uploads_to(self, run: Run) -> BucketPlane:
        """The bucket peers upload their updates to: :class:`NoStore` here (their SDKs PUT instead)."""
        raise NoStore("this hub has no object store: PUT the update to the hub", current_version=run.version)

    async def recover(self, run: Run) -> None:
        """At start: drop what a crash left of ``run`` past its commit (the store's files are its own)."""

    async def publish(
        self, run: Run, key: ResultKey, copies: list[ObjectRecord]
    ) -> tuple[list[ObjectRecord], dict[str, float]]:
        """The records of the result's copies to commit (``copies``: its merge's) and publish timings."""
        return copies, {}

    async def serve(self, run: Run, key: Published, *, direct: bool, peer: str | None) -> Blob | Redirect:
        """A download of ``key``: the hub's file, or where to fetch it; :class:`Missing` if neither is
        there, :class:`Unavailable` if only the bucket has it (the reducers wrote it) and it fails."""
        try:
            return self.store.serve(key)
        except Missing:
            if self.store.stored_object(key) is None:
                raise
        what = f"version {key.number}" if isinstance(key, VersionKey) else f"round {key.round}'s result"
        raise Unavailable(f"{what} lives only in the object store (written there by the reducers), which failed: retry")

    async def prune(self, run: Run, version: int) -> None:
        """Version ``version`` is written: drop what ``SYNC_KEEP_VERSIONS`` no longer keeps."""
        self.store.prune(run.name, version, self.keep_versions, run.keep_results)

    def close(self) -> None:
        """Release what the plane holds (the bucket's connections)."""


class BucketPlane(LocalPlane):
    """The hub's disk and a bucket; on the event loop, the store's requests in worker threads."""

    uploads: Via = "store"

    def __init__(self, store: Store, keep_versions: int, objects: ObjectStore) -> None:
        super().__init__(store, keep_versions)
        self.url, self.objects = objects.url, objects
        self.reads = lambda: objects.bytes_read
        self._copies: dict[VersionKey, asyncio.Task[None]] = {}  # versions being copied to the bucket
        self._down_until = 0.0
        self._warned: set[str] = set()  # runs told the store is down, since it last worked

    def uploads_to(self, run: Run) -> BucketPlane:
        return self

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, run: str, why: str) -> None:
        """The store failed for ``run``: leave it alone for a while, say so once per run."""
        self._down_until = time.monotonic() + DOWN_SECONDS
        if run not in self._warned:
            self._warned.add(run)
            log.warning("object_store_down run=%s store=%s: %s; serving from the hub's disk", run, self.url, why)

    async def recover(self, run: Run) -> None:
        """Forget the records past the commit, then delete the run's objects no record names and abort
        its open multipart uploads (what a crash cut); a store that fails keeps them for next time."""
        v = run.version
        records = self.store.stored_objects(run.name)
        past = [r.key for r in records if (r.key.round >= v if isinstance(r.key, ResultKey) else r.key.number > v)]
        self.store.forget_objects(past)
        named = {object_name(r.key) for r in self.store.stored_objects(run.name)} | self.store.update_objects(run.name)

        def delete_unnamed() -> tuple[int, int]:
            unnamed = [info.name for info in self.objects.list(f"runs/{run.name}/") if info.name not in named]
            self.objects.delete_names(unnamed)
            uploads = self.objects.uploads(f"runs/{run.name}/")
            for upload in uploads:
                self.objects.abort_multipart(upload.name, upload.upload_id)
            return len(unnamed), len(uploads)

        try:
            objects, uploads = await to_thread.run_sync(delete_unnamed)
        except StoreError as exc:
            self.failed(run.name, f"cleaning up after a restart: {exc}")
            return
        if objects or uploads:  # a crash cut uploads before their records: worth a line in the log
            log.warning("object_store_orphans_deleted run=%s objects=%d uploads=%d", run.name, objects, uploads)

    async def upload(self, run: Run, key: Published) -> ObjectRecord | None:
        """Copy ``key``'s file to the bucket: its record for the caller to write, or None (it failed)."""
        if not self.up:
            return None
        try:
            blob = self.store.serve(key)
        except Missing:
            return None
        try:
            info = await to_thread.run_sync(self.objects.put_from, object_name(key), blob.size, blob.read)
        except Exception as exc:  # a second copy: nothing the store does may fail a round
            self.failed(key.run, f"uploading {object_name(key)}: {exc}")
            return None
        finally:
            blob.close()
        if self._warned:
            log.info("object_store_back store=%s", self.url)
            self._warned.clear()
        for listener in self.stored:
            listener(run.name, info.size)
        return ObjectRecord(key, info.size, info.etag)

    async def publish(
        self, run: Run, key: ResultKey, copies: list[ObjectRecord]
    ) -> tuple[list[ObjectRecord], dict[str, float]]:
        """The copy peers fetch goes up before the commit (unless the reducers wrote it); none fails a round."""
        began = time.monotonic()
        uploaded = None if copies else await self.upload(run, key)
        return copies or ([uploaded] if uploaded else []), {"publish": time.monotonic() - began}

    async def serve(self, run: Run, key: Published, *, direct: bool, peer: str | None) -> Blob | Redirect:
        """A presigned GET of ``key``'s copy (a version copied at its first ask); ``direct``: the hub's file."""
        if direct:
            self.failed(run.name, f"peer {peer or '?'} could not download from it")
        elif self.up:
            if isinstance(key, VersionKey) and self.store.exists(key):
                await self._copy(run, key)
            if (record := self.store.stored_object(key)) is not None:
                return Redirect(self.objects.presign_get(object_name(key)), record.size)
        return await super().serve(run, key, direct=direct, peer=peer)

    async def _copy(self, run: Run, key: VersionKey) -> None:
        if self.store.stored_object(key) is not None:
            return
        task = self._copies.get(key)
        if task is None:
            task = self._copies[key] = asyncio.ensure_future(self._record(run, key))
            task.add_done_callback(lambda _: self._copies.pop(key, None))
        await asyncio.shield(task)

    async def _record(self, run: Run, key: VersionKey) -> None:
        if (record := await self.upload(run, key)) is not None:
            self.store.record_object(record)  # the copy counts from here on

    async def prune(self, run: Run, version: int) -> None:
        """The bucket keeps what the disk keeps (updates as their rounds' results). Records go first:
        a crash in between leaves garbage the next start deletes, never a record of a deleted object."""
        await super().prune(run, version)
        keep = self.keep_versions
        floor, results = version - keep + 1, version - max(keep, run.keep_results or 0) + 1
        gone = [
            r.key
            for r in self.store.stored_objects(run.name)
            if (r.key.round < results if isinstance(r.key, ResultKey) else r.key.number < floor)
        ]
        self.store.forget_objects(gone)
        names = [object_name(key) for key in gone] + self.store.forget_update_objects(run.name, results)
        if names:
            try:
                await to_thread.run_sync(self.objects.delete_names, names)
            except StoreError as exc:
                self.failed(run.name, f"pruning: {exc}")

    def close(self) -> None:
        self.objects.close()
