"""Each peer its own random stream: a constant seed the program sets becomes seed + rank
(docs/launcher.md, "Seeds").

A script written for one machine seeds every run with one constant (``torch.manual_seed(1337)``),
and one that draws its batches itself (``torch.randint`` over a token array, no DataLoader for
the hooks to shard) then draws the *same* batches on every peer: the second machine adds nothing.
Distributed scripts add the rank by hand (nanoGPT's ``1337 + seed_offset``); with a rank among
several peers, the hooks do that for the process-wide streams: ``torch.manual_seed`` (CUDA's too),
``numpy.random.seed`` and ``random.seed``. The weights still start identical (the join loads the
run's version). A generator the program makes itself (``torch.Generator().manual_seed(42)``,
``numpy.random.default_rng(0)``, ``random.Random(0)``) keeps its seed: that is how programs make a
train/validation split that must agree across processes. ``--same-seed`` (``WEIGHTSYNC_SEED=0``)
turns this off.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

from syncclient.hooks import session

__all__ = ["install", "install_numpy", "install_torch"]

_offset = 0
_inside = False  # torch.manual_seed calls torch.cuda.manual_seed_all: the seed gets the offset once


def install(offset: int) -> None:
    """At the hooks' start: ``random.seed`` now; torch's and numpy's when they are imported."""
    global _offset
    _offset = offset
    if offset:
        random.seed = _offset_seed(random.seed)  # type: ignore[assignment]


def install_torch(torch: ModuleType) -> None:
    if _offset:
        seed = _offset_seed(torch.random.manual_seed)
        for module, name in ((torch, "manual_seed"), (torch.random, "manual_seed")):
            setattr(module, name, seed)
        for name in ("manual_seed", "manual_seed_all"):  # transformers' set_seed calls both
            setattr(torch.cuda, name, _offset_seed(getattr(torch.cuda, name)))


def install_numpy(numpy: ModuleType) -> None:
    if _offset:
        numpy.random.seed = _offset_seed(numpy.random.seed)


def _offset_seed(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def seed(value: Any = None, *args: Any, **kwargs: Any) -> Any:
        global _inside
        if _inside or not isinstance(value, int) or isinstance(value, bool):
            return original(value, *args, **kwargs)
        session.note(f"the seeds the program sets get + {_offset} (its rank): each peer draws its own batches "
                     "(--same-seed keeps them)", once=True)  # fmt: skip
        _inside = True
        try:
            return original(value + _offset, *args, **kwargs)
        finally:
            _inside = False

    return seed
