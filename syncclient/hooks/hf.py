"""A Hugging Face ``Trainer``, or any subclass of it: ``SyncCallback`` added when it is built.

``Trainer.__init__`` is wrapped (subclasses call it through ``super().__init__``); at its end, if
this process is not synced another way already (:mod:`.session`), the ``train_dataset`` becomes
this rank's share (:mod:`.shard`) and :class:`syncclient.SyncCallback` joins the callbacks.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from syncclient.hooks import session, shard
from syncclient.hooks.settings import HookSettings

__all__ = ["install"]


def install(module: ModuleType, settings: HookSettings) -> None:
    """At ``transformers.trainer``'s import: wrap ``Trainer.__init__``."""
    trainer_class = module.Trainer
    original = trainer_class.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        name = type(self).__name__
        if not session.claim("transformers", f"a Hugging Face {name}"):
            return
        from syncclient.callbacks import SyncCallback  # the SDK, only now: see session.uses_sdk

        self.train_dataset = shard.shard_dataset(self.train_dataset, settings, f"{name}'s train_dataset")
        callback = SyncCallback(settings.hub, **settings.callback_kwargs())
        self.add_callback(callback)
        session.synced_by(callback, settings, f"{name} will sync its model", lambda: self.model)

    trainer_class.__init__ = __init__
