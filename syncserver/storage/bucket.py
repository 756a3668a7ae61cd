"""The object store's names (``SYNC_STORE``) and its opening; the hub's use of it is
:class:`~syncserver.core.planes.BucketPlane`'s.

Invariants (docs/object-store.md, "Commit stays the hub's"): an object counts only once a sqlite
record names it (:class:`~syncserver.storage.store.ObjectRecord`, or an update's own record),
written after the upload succeeded; anything no record names is garbage, deleted at start. Every
upload attempt of an update writes a name of its own, under its peer's folder, and no request
path writes or deletes a name a record holds.
"""

from __future__ import annotations

from syncserver.storage.s3 import CONTROL_SECONDS, URL_SECONDS, ObjectStore, StoreError, StoreUnavailable
from syncserver.storage.store import ResultKey, Stored, VersionKey

__all__ = ["object_name", "open_store", "update_name"]


def open_store(url: str, url_seconds: int = URL_SECONDS, control_seconds: float = CONTROL_SECONDS) -> ObjectStore:
    """The store ``SYNC_STORE`` names, checked (:meth:`ObjectStore.check`). Every trouble, a
    malformed URL or missing credentials included, is a :class:`StoreUnavailable` with one line
    that names it: the hub does not start without it."""
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
    """Where one upload ``attempt`` (the hub's random id) of a peer's update computed from version
    ``round_`` goes, named by the upload's key: a name no other attempt ever writes."""
    return f"runs/{run}/updates/{round_:08d}/{peer}/{key}.{attempt}.safetensors"
