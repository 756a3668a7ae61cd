"""weightsync SDK: make a training script collaborative across far-apart machines.

    from syncclient import SyncClient
    client = SyncClient("http://hub:8000", run="imdb-gpt2")
    client.join(model)
    ...
    client.sync(model, samples=n)

or, with a Hugging Face ``Trainer``, one callback: ``SyncCallback`` (with Lightning:
``syncclient.lightning.SyncCallback``); or no code at all: ``weightsync-run -- python train.py``.

Every name but the exceptions loads on first use: ``import syncclient`` imports neither torch nor
httpx (``weightsync-run``'s hooks sit in every Python process it starts, training or not), and
``pip install 'weightsync[client]'`` (no transformers) is enough for ``SyncClient``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from syncclient.exceptions import (  # the standard library only: cheap to import now
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
    from syncclient.client import JoinInfo, PendingSync, SyncClient, SyncResult
    from syncclient.preemption import Preempted
    from syncclient.schedule import SyncSchedule

__all__ = ["AuthError", "ConflictError", "HubError", "HubUnreachable", "JoinInfo", "NotFound", "PendingSync"]
__all__ += ["RoundClosed", "SchemaMismatch", "StaleUpdate", "SyncCallback", "SyncClient", "SyncResult"]
__all__ += ["Preempted", "SyncSchedule", "SyncError"]

_HOMES = {
    **dict.fromkeys(["JoinInfo", "PendingSync", "SyncClient", "SyncResult"], "syncclient.client"),
    "SyncCallback": "syncclient.callbacks",
    "SyncSchedule": "syncclient.schedule",
    "Preempted": "syncclient.preemption",
}


def __getattr__(name: str) -> Any:
    """Each public name from its module, on first use. ``SyncCallback`` imports transformers,
    which ``SyncClient`` does not need; it says so when transformers is missing."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(home)
    except ModuleNotFoundError as exc:
        if name != "SyncCallback" or exc.name != "transformers":
            raise
        raise ImportError("SyncCallback needs transformers: pip install transformers (or weightsync[train])") from exc
    value = getattr(module, name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
