"""What the Hugging Face and the Lightning ``SyncCallback`` share (:class:`Adapter`): the checks of
their arguments, the client, joining at train begin, the metrics an update carries, what a sync
leaves behind. When to sync is the client's (:class:`~syncclient.schedule.SyncClock`)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import torch

from syncclient.client import JoinInfo, SyncClient, SyncResult
from syncclient.peerlr import PeerLR
from syncclient.schedule import SyncClock, SyncEvery

__all__ = ["Adapter", "sync_metrics"]

logger = logging.getLogger(__name__)

#: Bytes of JSON metrics sent with an update; beyond it (many ``compute_metrics`` values) only
#: the losses go, leaving room in the hub's 4 KiB header for what the SDK adds itself.
METRICS_BUDGET = 2048


def sync_metrics(logged: Mapping[str, Any], step: int) -> dict[str, float]:
    """What an update carries of the metrics a Trainer logged: the finite scalars (a one-element
    tensor's value), within :data:`METRICS_BUDGET` (else the losses alone), and ``step``: the
    dashboard plots against it."""
    metrics: dict[str, float] = {}
    for name, value in logged.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            metrics[name] = float(value)
    if len(json.dumps(metrics)) > METRICS_BUDGET:
        metrics = {k: v for k, v in metrics.items() if "loss" in k}
    return {**metrics, "step": float(step)}


class Adapter:
    """A Trainer callback's sync state: the client, each peer's learning rate
    (:mod:`syncclient.peerlr`), what ``join`` returned, the last result and the syncs made.
    ``on_sync(result)``, if given, is called after each. ``ValueError`` with the reason when the
    arguments make no callback: ``client`` itself (counting ``sync_every`` if given), or a new
    ``SyncClient(hub, sync_every=..., **client_kwargs)``."""

    def __init__(
        self,
        hub: str | None,
        sync_every: SyncEvery | None,
        client: SyncClient | None,
        lr_scaling: str,
        lr_scaling_warmup: int | None,
        client_kwargs: dict[str, Any],
    ) -> None:
        if sync_every is None and client is None and client_kwargs.get("round_samples") is None:
            raise ValueError("give sync_every=N (optimizer steps between syncs) or round_samples=S (samples per round)")
        if (hub is None) == (client is None):
            raise ValueError("give either hub='http://host:port' or client=SyncClient(...), not both or none")
        if client is not None:
            if client_kwargs:
                names = ", ".join(sorted(client_kwargs))
                raise ValueError(f"client settings ({names}) go to SyncClient(...) when you pass client=")
            if sync_every == "auto" and client.clock.every != "auto":
                raise ValueError("sync_every='auto' is a run setting: give it to SyncClient(..., sync_every='auto')")
            if sync_every is not None and sync_every != "auto":  # (an auto clock holds what the hub said)
                client.clock = SyncClock(sync_every)
        else:
            assert hub is not None
            parts = urlsplit(hub)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"hub must be an http:// or https:// URL such as http://hub:8000, got {hub!r}")
            if not client_kwargs.get("run"):
                raise ValueError("SyncCallback(hub, ...) needs run='name-of-the-run'")
            client = SyncClient(hub, sync_every=sync_every, **client_kwargs)
        self.client = client
        self.peer_lr = PeerLR(lr_scaling, lr_scaling_warmup).for_rounds(sync_every)
        self.join_info: JoinInfo | None = None
        self.last_result: SyncResult | None = None
        self.syncs = 0
        self.on_sync: Any = None
        self.after_join: Any = None  # weightsync-run's check of the rank the data was sharded by
        self._active = False  # joined and not yet left: the events act only then
        self._loss: Any = None  # the training loss since the last sync, as the Trainer gave it

    def _begin(self, model: torch.nn.Module, step: int) -> None:
        """Join (unless the client has: one passed in after joining, to learn the rank before
        sharding) and count steps from the Trainer's ``step`` (a ``SyncError`` when the run's
        policy needs ``sync_every`` and the callback has none)."""
        if self.client.version >= 0:  # -1 until join() loaded a version
            logger.info("client already joined the run; not joining again")
        else:
            self.join_info = self.client.join(model)
            logger.info("joined: %s", self.join_info)
        self.client.count_from(step)
        if self.after_join is not None:
            self.after_join(self.client)
        self._active = True

    def _due(self, step: int, max_steps: int) -> tuple[bool, bool]:
        """Whether to sync now, and whether ``step`` is the last (a sync there is the peer's last)."""
        last = 0 < max_steps <= step
        return self.client.due or (last and self.client.clock.unsynced), last

    def _synced(self, result: SyncResult, step: int, steps: int) -> None:
        self.last_result = result
        self.syncs += 1
        late = " (late: caught up, local steps dropped)" if result.caught_up else ""
        said = "step %d: synced %d steps -> version %d in %.2f s (%.2f s of it stalled training)%s"
        logger.info(said, step, steps, result.version, result.seconds, result.stall_seconds, late)
        if self.on_sync is not None:
            self.on_sync(result)
