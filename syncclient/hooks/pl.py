"""A PyTorch Lightning ``Trainer``: :class:`syncclient.lightning.SyncCallback` added when it is built.

``Trainer.__init__`` (``lightning.pytorch`` and ``pytorch_lightning`` alike) is wrapped to add the
callback to its ``callbacks`` argument, so that Lightning orders it as the program's own
(checkpoints stay last). Its DataLoaders are plain ones: :mod:`.shard` shards them.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

from syncclient.hooks import session
from syncclient.hooks.settings import HookSettings

__all__ = ["install"]


def install(module: ModuleType, settings: HookSettings) -> None:
    """At the import of a Lightning package's ``trainer.trainer`` module: wrap ``Trainer.__init__``."""
    trainer_class = module.Trainer
    original = trainer_class.__init__
    package = module.__name__.split(".")[0]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if session.claim("lightning", f"a Lightning {type(self).__name__}"):
            from syncclient.lightning import callback_class  # the SDK, only now: see session.uses_sdk

            sync = callback_class(importlib.import_module(package).Callback)(settings.hub, **settings.callback_kwargs())
            what = f"{type(self).__name__} will sync its LightningModule"
            session.synced_by(sync, settings, what, lambda: self.lightning_module)
            given = kwargs.get("callbacks")
            given = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
            kwargs["callbacks"] = [*given, sync]
        original(self, *args, **kwargs)

    trainer_class.__init__ = __init__
