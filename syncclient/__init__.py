"""weightsync SDK: make a training script collaborative across far-apart machines.

    from syncclient import SyncClient
    client = SyncClient("http://hub:8000", run="imdb-gpt2")
    client.join(model)
    ...
    client.sync(model, samples=n)

or, with a Hugging Face ``Trainer``, one callback: ``SyncCallback``. It is loaded on first
use, so that ``pip install 'weightsync[client]'`` (no transformers) is enough for ``SyncClient``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from syncclient.client import JoinInfo, PendingSync, SyncClient, SyncResult
from syncclient.exceptions import (
    AuthError,
    ConflictError,
    HubError,
    HubUnreachable,
    NotFound,
    RoundClosed,
    SchemaMismatch,
    StaleUpdate,
    SyncError,
)

if TYPE_CHECKING:
    from syncclient.callbacks import SyncCallback

__all__ = [
    "AuthError",
    "ConflictError",
    "HubError",
    "HubUnreachable",
    "JoinInfo",
    "NotFound",
    "PendingSync",
    "RoundClosed",
    "SchemaMismatch",
    "StaleUpdate",
    "SyncCallback",
    "SyncClient",
    "SyncResult",
    "SyncError",
]


def __getattr__(name: str) -> Any:
    """``SyncCallback`` on first use: it imports transformers, which ``SyncClient`` does not need."""
    if name != "SyncCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from syncclient.callbacks import SyncCallback
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":
            raise
        raise ImportError("SyncCallback needs transformers: pip install transformers (or weightsync[train])") from exc
    return SyncCallback
