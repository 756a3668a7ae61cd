"""The hooks ``weightsync-run`` puts into a training program that does not know about weightsync
(docs/launcher.md, "How it hooks in").

``weightsync-run`` puts the folder ``_site`` first on ``PYTHONPATH``, so Python imports its
``sitecustomize`` at startup in every Python process of the command (a ``sitecustomize`` it
hides runs after it). That calls :func:`install`, which reads the settings (:mod:`.settings`) and
only *watches* imports (:mod:`.imports`): a program that never imports torch runs exactly as
without weightsync (but for :mod:`.seeds`: a constant seed gets the peer's rank). Then ``torch``
brings the plain-loop hook (:mod:`.plain`, which sees an optimizer's steps, or the backward passes
of a loop that steps its weights itself: :mod:`.byhand`) and the DataLoader sharding and counting
(:mod:`.shard`); ``transformers.trainer`` the Hugging Face ``Trainer``'s
``SyncCallback`` (:mod:`.hf`); a Lightning ``Trainer`` module its callback (:mod:`.pl`). One of
them syncs a process (:mod:`.session`), and at exit the process says on stderr that it found
nothing to sync or which version it left the run at, with its weights' sha-256.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from types import ModuleType

from syncclient.hooks import seeds, session
from syncclient.hooks.imports import when_imported
from syncclient.hooks.settings import ENV, HookSettings, SettingsError

__all__ = ["SITE", "install"]

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")  # the folder for PYTHONPATH


def install(env: Mapping[str, str] = os.environ) -> bool:
    """Watch for torch, transformers and Lightning, with the settings in ``env``. Does nothing
    (False) without ``WEIGHTSYNC_HUB``: a process that merely inherited ``PYTHONPATH``."""
    if not env.get(ENV["hub"]):
        return False
    try:
        settings = HookSettings.from_env(env)
    except SettingsError as exc:
        session.note(f"{exc}; the program runs without sync")
        return False
    session.start()
    seeds.install(settings.seed_offset)

    def torch_imported(module: ModuleType) -> None:
        from syncclient.hooks import plain, shard

        seeds.install_torch(module)
        shard.install(settings)
        plain.install(settings)

    def trainer_imported(hooks: str) -> Callable[[ModuleType], None]:  # the hooks' module, imported only now
        return lambda module: importlib.import_module(f"syncclient.hooks.{hooks}").install(module, settings)

    when_imported("torch", torch_imported)
    when_imported("numpy", seeds.install_numpy)
    when_imported("transformers.trainer", trainer_imported("hf"))
    when_imported("lightning.pytorch.trainer.trainer", trainer_imported("pl"))
    when_imported("pytorch_lightning.trainer.trainer", trainer_imported("pl"))
    return True
