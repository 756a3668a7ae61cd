"""The hub's object store (``SYNC_STORE``): the results and versions it publishes there, and
the updates peers upload there.

Peers download a round's result and a model version straight from the bucket, through a
presigned GET the hub answers with (307), so the hub's link carries each object once, up to
the bucket, instead of once per peer. The hub's disk keeps its own copy of those (the merge
reads it, and downloads fall back to it), so for them the bucket is a second copy, never the
only one.

Peers' updates go the other way (:mod:`syncserver.core.presigned`): uploaded through presigned
part URLs straight into the bucket, checked by the hub with one streaming GET, and then the
bucket holds the only copy (the update's record names it; the merge reads it with ranged GETs).
The local-disk hub without a store is unchanged.

Commit stays the hub's: an object counts only once a sqlite record names it
(:class:`~syncserver.storage.store.ObjectRecord` for results and versions, the update's own
record for an update), and the record is written after the upload succeeded (a round's result:
in the round's own commit transaction). Anything in the bucket that no record names is garbage
(an upload that a crash cut before its record, a multipart upload left open): deleted at start
(:meth:`Bucket.recover`, :meth:`Bucket.delete_unnamed`); pruned versions, results and updates
leave the bucket with their files (:meth:`Bucket.prune`).

Names in the bucket, under the store's prefix::

    runs/<run>/rounds/<round:08d>/result.safetensors
    runs/<run>/versions/<version:08d>/model.safetensors
    runs/<run>/updates/<round:08d>/<peer>/<key>.<attempt>.safetensors    (round: the update's base)

An update's name carries the key its peer chose for the upload (``Upload-Key``'s rule), under
a folder of its own peer (no peer can name another's object), and the hub's random id of the
upload attempt: every attempt writes an object of its own, and the acknowledgement records the
one that was checked. That record is the only place the name lives (the merge reads it from
there); no request path writes or deletes an object a record names.

Threads: :meth:`upload`, :meth:`delete_unnamed` and :meth:`delete` make requests (worker
threads) and touch no record; the record methods (:meth:`recover`, :meth:`prune`,
:meth:`presign`) run on the event loop, as every sqlite call of the hub does.
A store that fails is *down* for :data:`DOWN_SECONDS`: no upload
and no redirect is tried meanwhile, every download is served from the hub's disk, and one
warning per run says so.
"""

from __future__ import annotations

import logging
import threading
import time

from syncserver.storage.s3 import CONTROL_SECONDS, URL_SECONDS, ObjectStore, StoreError, StoreUnavailable
from syncserver.storage.store import (
    Missing,
    MomentumKey,
    ObjectRecord,
    Published,
    ResidualKey,
    ResultKey,
    Store,
    Stored,
)

__all__ = ["DOWN_SECONDS", "Bucket", "object_name", "open_store", "update_name"]

log = logging.getLogger(__name__)

DOWN_SECONDS = 30.0
"""After a failure, how long the store is left alone before it is tried again."""


def open_store(url: str, url_seconds: int = URL_SECONDS, control_seconds: float = CONTROL_SECONDS) -> ObjectStore:
    """The store ``SYNC_STORE`` names, checked (:meth:`ObjectStore.check`: it lists, writes and
    deletes there), its control calls bounded by ``control_seconds`` (``SYNC_STORE_CONTROL_SECONDS``).
    Every trouble, a malformed URL or missing credentials included, is a
    :class:`StoreUnavailable` with one line that names it: the hub does not start without it."""
    try:
        objects = ObjectStore.from_url(url, url_seconds=url_seconds, control_seconds=control_seconds)
    except ValueError as exc:
        raise StoreUnavailable(str(exc)) from None
    try:
        objects.check()
    except StoreError as exc:
        objects.close()
        raise StoreUnavailable(f"{objects.url}: {exc}") from None
    return objects


def object_name(key: Stored) -> str:
    """Where ``key`` lives in the bucket (relative to the store's prefix)."""
    if isinstance(key, ResultKey):
        return f"runs/{key.run}/rounds/{key.round:08d}/result.safetensors"
    if isinstance(key, MomentumKey):
        return f"runs/{key.run}/momentum/{key.number:08d}.safetensors"
    if isinstance(key, ResidualKey):
        return f"runs/{key.run}/residual/{key.number:08d}.safetensors"
    return f"runs/{key.run}/versions/{key.number:08d}/model.safetensors"


def update_name(run: str, round_: int, peer: str, key: str, attempt: str) -> str:
    """Where one upload ``attempt`` (the hub's random id of it) of a peer's update computed from
    version ``round_`` goes, named by the upload's key: a name no other attempt ever writes."""
    return f"runs/{run}/updates/{round_:08d}/{peer}/{key}.{attempt}.safetensors"


class Bucket:
    """The object store as the hub's second copy of what peers download."""

    def __init__(self, objects: ObjectStore, store: Store) -> None:
        self.objects = objects
        self.store = store
        self._down_until = 0.0
        self._warned: set[str] = set()  # runs told the store is down, since it last worked
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """``s3://bucket/prefix``: shown in status and the dashboard (no credential in it)."""
        return self.objects.url

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, run: str, why: str) -> None:
        """The store failed for ``run``: leave it alone for a while, say so once per run."""
        with self._lock:
            self._down_until = time.monotonic() + DOWN_SECONDS
            first = run not in self._warned
            self._warned.add(run)
        if first:
            log.warning(
                "object_store_down run=%s store=%s: %s; serving results and versions from the hub's disk",
                run,
                self.url,
                why,
            )

    def _worked(self) -> None:
        with self._lock:
            if self._warned:
                log.info("object_store_back store=%s", self.url)
            self._warned.clear()

    # ---- publishing (worker threads) -------------------------------------------------------
    def upload(self, key: Published) -> ObjectRecord | None:
        """Copy ``key``'s file to the bucket; its record, or None if the store failed (then the
        hub serves it from disk). The caller writes the record: commit is the database's."""
        if not self.up:
            return None
        try:
            blob = self.store.serve(key)
        except Missing:
            return None
        try:
            info = self.objects.put_from(object_name(key), blob.size, blob.read)
        except Exception as exc:  # a second copy: nothing the store does may fail a round
            self.failed(key.run, f"uploading {object_name(key)}: {exc}")
            return None
        finally:
            blob.close()
        self._worked()
        return ObjectRecord(key, info.size, info.etag)

    def recover(self, run: str, version: int) -> set[str]:
        """At start (event loop): forget the records past the committed state (a version past
        ``version``, a result of a round not closed); the names of the objects the records left
        name (results, versions, momentum, residuals, acknowledged updates), for :meth:`delete_unnamed`."""
        past = [
            r.key
            for r in self.store.stored_objects(run)
            if (isinstance(r.key, ResultKey) and r.key.round >= version)
            or (not isinstance(r.key, ResultKey) and r.key.number > version)
        ]
        if past:
            self.store.forget_objects(past)
        return {object_name(r.key) for r in self.store.stored_objects(run)} | self.store.update_objects(run)

    def delete_unnamed(self, run: str, named: set[str]) -> int:
        """Worker thread, at start: delete every object of ``run`` in the bucket that no record
        names (``named``, from :meth:`recover`) and abort every multipart upload open there (no
        record names an upload: it is a peer's update or a result a crash cut); how many objects
        went. A store that fails keeps them for the next start."""
        try:
            unnamed = [info.name for info in self.objects.list(f"runs/{run}/") if info.name not in named]
            self.objects.delete_names(unnamed)
            uploads = self.objects.uploads(f"runs/{run}/")
            for upload in uploads:
                self.objects.abort_multipart(upload.name, upload.upload_id)
        except StoreError as exc:
            self.failed(run, f"cleaning up after a restart: {exc}")
            return 0
        if unnamed or uploads:  # a crash cut uploads before their records: worth a line in the log
            log.warning("object_store_orphans_deleted run=%s objects=%d uploads=%d", run, len(unnamed), len(uploads))
        return len(unnamed)

    def prune(self, run: str, version_floor: int, result_floor: int) -> list[str]:
        """Event loop: forget the copies of versions below ``version_floor``, results below
        ``result_floor`` and the updates merged in those rounds, as the hub prunes its files
        (``SYNC_KEEP_VERSIONS``); the names of the objects :meth:`delete` then removes. Records
        go first: a crash in between leaves garbage that :meth:`delete_unnamed` deletes, never
        a record of a deleted object."""
        gone = [
            r.key
            for r in self.store.stored_objects(run)
            if (isinstance(r.key, ResultKey) and r.key.round < result_floor)
            or (not isinstance(r.key, ResultKey) and r.key.number < version_floor)
        ]
        if gone:
            self.store.forget_objects(gone)
        return [object_name(key) for key in gone] + self.store.forget_update_objects(run, result_floor)

    def delete(self, run: str, names: list[str]) -> None:
        """Worker thread: delete the objects ``names`` (forgotten by :meth:`prune`)."""
        try:
            self.objects.delete_names(names)
        except StoreError as exc:
            self.failed(run, f"pruning: {exc}")

    # ---- serving (event loop: no I/O) --------------------------------------------------------
    def presign(self, key: Published) -> tuple[str, ObjectRecord] | None:
        """A presigned GET of ``key``'s copy (and its record), or None: not in the bucket, or the
        store is down (serve it from disk)."""
        if not self.up:
            return None
        record = self.store.stored_object(key)
        if record is None:
            return None
        return self.objects.presign_get(object_name(key)), record

    def close(self) -> None:
        self.objects.close()
