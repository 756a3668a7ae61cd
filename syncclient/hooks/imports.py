"""Run a function right after a module is first imported, without importing it ourselves.

The hooks must not import torch, transformers or Lightning: a program that never uses them must
run exactly as without weightsync (and one that sets ``OMP_NUM_THREADS`` before importing torch
must have its way). :func:`when_imported` puts a finder first on ``sys.meta_path`` that wraps the
watched module's loader, so the function runs once the module's code has run. Every other import
costs it one dict lookup; it leaves ``sys.meta_path`` once nothing is left to watch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]

Hook = Callable[[ModuleType], None]


def when_imported(name: str, hook: Hook) -> None:
    """``hook(module)`` once ``name`` is imported (now, if it is already)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        _run(hook, module)
        return
    _FINDER.pending.setdefault(name, []).append(hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: dict[str, list[Hook]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        spec = None
        for finder in sys.meta_path:  # what the import system would have found without us
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec  # not found (the import fails as it would have), or a namespace package
        hooks = self.pending.pop(fullname)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec.loader = _Loader(spec.loader, hooks)  # type: ignore[assignment]
        return spec


class _Loader:
    """The module's own loader, plus the hooks after ``exec_module`` (the real loader goes back on
    the module before its code runs: nothing else ever sees this one)."""

    def __init__(self, loader: Any, hooks: list[Hook]) -> None:
        self._loader, self._hooks = loader, hooks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for hook in self._hooks:
            _run(hook, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _run(hook: Hook, module: ModuleType) -> None:
    """A hook that fails says so; the program's import succeeds, without that integration."""
    try:
        hook(module)
    except Exception as exc:  # the program's import must succeed whatever happens here
        from syncclient.hooks.session import note

        note(f"could not hook {module.__name__} ({type(exc).__name__}: {exc}); it runs without sync")


_FINDER = _Finder()
