"""Where the bytes live (the data plane), chosen once in :func:`~syncserver.api.factory.create_app`:
the core calls its plane and never asks which one it has.

- :class:`LocalPlane`: the hub's disk alone. Peers PUT their updates to the hub and download
  results and versions from it.
- :class:`BucketPlane` (``SYNC_STORE``): the hub's disk and an S3-API bucket. Peers upload their
  updates straight to the bucket through presigned part URLs (:mod:`syncserver.core.presigned`)
  and are sent there (a 307 to a presigned GET) for results and versions, so the hub's link
  carries each object once, up to the bucket, instead of once per peer. The hub uploads each
  result before its commit announces it, and each version on its first download (a version
  nobody asks for is never sent). A store that fails leaves every download to the hub's disk
  for a while (:meth:`Bucket.failed <syncserver.storage.bucket.Bucket.failed>`); the bucket
  keeps what the disk keeps (pruned together), and what a crash left in it that no record names
  is deleted at start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from anyio import to_thread

from syncserver.core.state import Run, Via
from syncserver.errors import NoStore, Unavailable
from syncserver.storage.bucket import Bucket
from syncserver.storage.s3 import ObjectStore
from syncserver.storage.store import Blob, Missing, ObjectRecord, Published, ResultKey, Store, VersionKey

__all__ = ["BucketPlane", "LocalPlane", "Redirect"]


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
        self.url: str | None = None  # the bucket as status and the dashboard show it
        self.objects: ObjectStore | None = None  # where the engine and the reducers read what lives in the bucket
        self.reads: Callable[[], int] | None = None  # bytes the hub read from the bucket (/metrics)
        self.stored: list[Callable[[str, int], None]] = []  # told of each upload of the hub's: (run, bytes)

    def bucket(self, run: Run) -> Bucket:
        """The bucket peers upload their updates to; :class:`NoStore` here (its peers' SDKs PUT instead)."""
        raise NoStore("this hub has no object store: PUT the update to the hub", current_version=run.version)

    async def recover(self, run: Run) -> None:
        """At start: drop what a crash left of ``run`` past its commit (the store's files are its own)."""

    async def publish(
        self, run: Run, key: ResultKey, copies: list[ObjectRecord]
    ) -> tuple[list[ObjectRecord], dict[str, float]]:
        """Round ``key``'s result is merged: the records of its copies to commit with the round
        (``copies``: those its merge wrote), and the seconds publishing took, as round timings."""
        return copies, {}

    async def serve(self, run: Run, key: Published, *, direct: bool, peer: str | None) -> Blob | Redirect:
        """A download of ``key``: the hub's file, or where to fetch it; :class:`Missing` if neither
        is there. One that lives only in the bucket (the reducers wrote it there) while the store
        fails (or the hub restarted without it): :class:`Unavailable`."""
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
        pass


class BucketPlane(LocalPlane):
    """The hub's disk and a bucket (see the module docstring)."""

    uploads: Via = "store"

    def __init__(self, store: Store, keep_versions: int, bucket: Bucket) -> None:
        super().__init__(store, keep_versions)
        self._bucket = bucket
        self.url, self.objects = bucket.url, bucket.objects
        self.reads = lambda: bucket.objects.bytes_read
        self._copies: dict[VersionKey, asyncio.Task[None]] = {}  # versions being copied to the bucket

    def bucket(self, run: Run) -> Bucket:
        return self._bucket

    async def recover(self, run: Run) -> None:
        named = self._bucket.recover(run.name, run.version)
        await to_thread.run_sync(self._bucket.delete_unnamed, run.name, named)

    async def upload(self, run: Run, key: Published) -> ObjectRecord | None:
        """Copy ``key``'s file to the bucket; its record (the caller writes it: commit is the
        database's), or None if the store failed (then the hub serves it from disk)."""
        record = await to_thread.run_sync(self._bucket.upload, key)
        if record is not None:
            for listener in self.stored:
                listener(run.name, record.size)
        return record

    async def publish(
        self, run: Run, key: ResultKey, copies: list[ObjectRecord]
    ) -> tuple[list[ObjectRecord], dict[str, float]]:
        """The copy peers will fetch goes up before the commit announces the result (unless the
        reducers wrote it there); if the store fails, the round closes all the same and peers
        get the hub's copy."""
        began = time.monotonic()
        uploaded = None if copies else await self.upload(run, key)
        return copies or ([uploaded] if uploaded else []), {"publish": time.monotonic() - began}

    async def serve(self, run: Run, key: Published, *, direct: bool, peer: str | None) -> Blob | Redirect:
        """A presigned GET of ``key``'s copy (a version is copied on its first ask: every
        concurrent ask waits for the same upload); ``direct``: the peer was sent there and could
        not fetch it, so the hub's file."""
        if direct:
            self._bucket.failed(run.name, f"peer {peer or '?'} could not download from it")
        else:
            if isinstance(key, VersionKey) and self._bucket.up and self.store.exists(key):
                await self._copy(run, key)
            found = self._bucket.presign(key)
            if found is not None:
                return Redirect(found[0], found[1].size)
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
        record = await self.upload(run, key)
        if record is not None:
            self.store.record_object(record)  # the copy counts from here on

    async def prune(self, run: Run, version: int) -> None:
        """The bucket keeps what the disk keeps: records first, then the objects."""
        await super().prune(run, version)
        keep = self.keep_versions
        gone = self._bucket.prune(run.name, version - keep + 1, version - max(keep, run.keep_results or 0) + 1)
        if gone:
            await to_thread.run_sync(self._bucket.delete, run.name, gone)

    def close(self) -> None:
        self._bucket.close()
