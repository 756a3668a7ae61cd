"""weightsync SDK: make a training script collaborative across far-apart machines.

    from syncclient import SyncClient
    client = SyncClient("http://hub:8000", run="imdb-gpt2")
    client.join(model)
    ...
    client.sync(model, samples=n)

or, with a Hugging Face ``Trainer``, one callback: ``SyncCallback``.
"""

from __future__ import annotations

from syncclient.callbacks import SyncCallback
from syncclient.client import JoinInfo, PendingSync, SyncClient, SyncResult
from syncclient.exceptions import (
    AuthError,
    ConflictError,
    HubError,
    HubUnreachable,
    NotFound,
    RoundClosed,
    SchemaMismatch,
    SyncError,
)

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
    "SyncCallback",
    "SyncClient",
    "SyncResult",
    "SyncError",
]
