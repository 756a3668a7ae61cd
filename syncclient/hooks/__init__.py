"""The hooks ``weightsync-run`` puts into a training program that does not know about weightsync.

How they get in: ``weightsync-run`` puts the folder ``_site`` first on ``PYTHONPATH``, and Python
imports the ``sitecustomize`` module in it at startup, before the program's first line, in every
Python process of the command (``python train.py``, ``python -m package.train``, a console
script such as ``accelerate``'s; a ``sitecustomize`` it hides is run after it). That calls
:func:`install`, which reads the settings (:mod:`.settings`) and only *watches* imports
(:mod:`.imports`): nothing heavy is imported, and a program that never imports torch runs
exactly as without weightsync. Then, as the program imports them:

==================================  ==========================================================
the program imports                 the hooks
==================================  ==========================================================
``torch``                           every optimizer step is seen (:mod:`.plain`: the model
                                    is found at the first step, joins, syncs every N steps and
                                    when its state is read, the rest at exit); DataLoaders
                                    are sharded by rank and their samples counted
                                    (:mod:`.shard`)
``transformers`` (its ``Trainer``)  ``Trainer.__init__`` adds ``SyncCallback`` (:mod:`.hf`)
``lightning`` / ``pytorch_lightning``  ``Trainer.__init__`` adds ``syncclient.lightning``'s
                                    callback (:mod:`.pl`)
==================================  ==========================================================

Only one of them syncs a process (:mod:`.session`): a Trainer claims it when built, and the
optimizer hook then stands aside; a program that uses the SDK itself is left alone. At exit the
process says on stderr either that it found nothing to sync (and exits with the program's own
code) or which version it left the run at, with its weights' sha-256.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType

from syncclient.hooks import session
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

    def torch_imported(module: ModuleType) -> None:
        from syncclient.hooks import plain, shard

        shard.install(settings)
        plain.install(settings)

    def transformers_trainer(module: ModuleType) -> None:
        from syncclient.hooks import hf

        hf.install(module, settings)

    def lightning_trainer(module: ModuleType) -> None:
        from syncclient.hooks import pl

        pl.install(module, settings)

    when_imported("torch", torch_imported)
    when_imported("transformers.trainer", transformers_trainer)
    when_imported("lightning.pytorch.trainer.trainer", lightning_trainer)
    when_imported("pytorch_lightning.trainer.trainer", lightning_trainer)
    return True
