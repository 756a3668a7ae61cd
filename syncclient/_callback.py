"""What the Hugging Face and the Lightning ``SyncCallback`` share: the checks of their arguments,
the client they sync through, and joining at train begin. One set of rules and messages."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import torch

from syncclient.client import JoinInfo, SyncClient
from syncclient.schedule import SyncSchedule

__all__ = ["callback_client", "join_at_train_begin"]

logger = logging.getLogger(__name__)


def callback_client(
    hub: str | None,
    *,
    sync_every: int | SyncSchedule | None,
    client: SyncClient | None,
    client_kwargs: dict[str, Any],
) -> SyncClient:
    """``client`` itself, or a new ``SyncClient(hub, **client_kwargs)``; ``ValueError`` with the
    reason when the arguments do not make a callback."""
    bad_int = isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1
    if sync_every is not None and not isinstance(sync_every, SyncSchedule) and bad_int:
        raise ValueError(f"sync_every must be an int >= 1 (optimizer steps) or a SyncSchedule, got {sync_every!r}")
    if sync_every is None and client is None and client_kwargs.get("round_samples") is None:
        raise ValueError("give sync_every=N (optimizer steps between syncs) or round_samples=S (samples per round)")
    if (hub is None) == (client is None):
        raise ValueError("give either hub='http://host:port' or client=SyncClient(...), not both or none")
    if client is not None:
        if client_kwargs:
            raise ValueError(
                f"client settings ({', '.join(sorted(client_kwargs))}) go to SyncClient(...) when you pass client="
            )
        return client
    assert hub is not None
    parts = urlsplit(hub)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"hub must be an http:// or https:// URL such as http://hub:8000, got {hub!r}")
    if not client_kwargs.get("run"):
        raise ValueError("SyncCallback(hub, ...) needs run='name-of-the-run'")
    return SyncClient(hub, **client_kwargs)


def join_at_train_begin(
    client: SyncClient, model: torch.nn.Module, sync_every: int | SyncSchedule | None
) -> JoinInfo | None:
    """Join (unless the client has: one passed in after joining, to learn the rank before
    sharding), and check that the run's policy fits what the callback was given."""
    info = None
    if client.version >= 0:  # -1 until join() loaded a version
        logger.info("client already joined the run; not joining again")
    else:
        info = client.join(model)
        logger.info("joined: %s", info)
    if client.policy != "samples" and sync_every is None:
        raise ValueError(
            f"run {client.run!r} is a {client.policy} run: give SyncCallback sync_every=N "
            "(optimizer steps between syncs)"
        )
    return info
