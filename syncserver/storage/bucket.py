"""The object store's names (``SYNC_STORE``) and its opening; the hub's use of it is
:class:`~syncserver.core.planes.BucketPlane`'s.

Names in the bucket, under the store's prefix::

    runs/<run>/rounds/<round:08d>/result.safetensors
    runs/<run>/versions/<version:08d>/model.safetensors
    runs/<run>/momentum/<version:08d>.safetensors      DiLoCo's, written by reducers
    runs/<run>/residual/<version:08d>.safetensors      the hub's error feedback, written by reducers
    runs/<run>/updates/<round:08d>/<peer>/<key>.<attempt>.safetensors    (round: the update's base)

An update's name carries the key its peer chose for the upload (``Upload-Key``'s rule), under
a folder of its own peer (no peer can name another's object), and the hub's random id of the
upload attempt: every attempt writes an object of its own, and the acknowledgement records the
one that was checked. That record is the only place the name lives (the merge reads it from
there); no request path writes or deletes an object a record names.

Commit stays the hub's: an object counts only once a sqlite record names it
(:class:`~syncserver.storage.store.ObjectRecord` for results and versions, the update's own
record for an update), and the record is written after the upload succeeded. Anything in the
bucket that no record names is garbage, deleted at start.
"""

from __future__ import annotations

from syncserver.storage.s3 import CONTROL_SECONDS, URL_SECONDS, ObjectStore, StoreError, StoreUnavailable
from syncserver.storage.store import ResultKey, Stored, VersionKey

__all__ = ["object_name", "open_store", "update_name"]


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
    if isinstance(key, VersionKey):
        return f"runs/{key.run}/versions/{key.number:08d}/model.safetensors"
    return f"runs/{key.run}/{key.kind}/{key.number:08d}.safetensors"  # momentum, residual


def update_name(run: str, round_: int, peer: str, key: str, attempt: str) -> str:
    """Where one upload ``attempt`` (the hub's random id of it) of a peer's update computed from
    version ``round_`` goes, named by the upload's key: a name no other attempt ever writes."""
    return f"runs/{run}/updates/{round_:08d}/{peer}/{key}.{attempt}.safetensors"
