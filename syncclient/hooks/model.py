"""Which model a plain loop trains: the module that owns its optimizer's parameters.

An optimizer holds tensors, not a model. At its first step the live *root* modules (nobody's
submodule; after a ``gc.collect()``, so a dropped wrapper is not one) that hold its parameters are
looked at. One root holds them all: that is the model, whole (frozen layers and BatchNorm
statistics must agree across peers too; a compiled or DDP wrapper is unwrapped by the SDK).
Several roots each hold them all (one model in two wrappers): the highest module inside every one
that still holds them all. Otherwise :class:`AmbiguousModel` says why: parameters spread over
models that share no root (a GAN's generator and discriminator), or tensors of no module.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch

__all__ = ["AmbiguousModel", "find_model", "describe"]


class AmbiguousModel(Exception):
    """No single model owns the optimizer's parameters; the message says what to do."""


def find_model(params: Iterable[torch.Tensor]) -> torch.nn.Module:
    """The model that owns ``params`` (an optimizer's), or :class:`AmbiguousModel`."""
    wanted = {id(p) for p in params}
    if not wanted:
        raise AmbiguousModel("the optimizer has no parameters")
    gc.collect()
    modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
    children = {id(c) for m in modules for c in m._modules.values() if c is not None}
    holders: list[tuple[torch.nn.Module, set[int]]] = []
    for root in (m for m in modules if id(m) not in children):
        held = {id(p) for p in root.parameters() if id(p) in wanted}
        if held:
            holders.append((root, held))
    whole = [root for root, held in holders if held == wanted]
    if len(whole) == 1:
        return whole[0]
    if whole:  # one model inside several wrappers: the highest module all of them share
        inside_all = set.intersection(*({id(m) for m in root.modules()} for root in whole))
        for module in whole[0].modules():  # parents before their children
            if id(module) in inside_all and wanted <= {id(p) for p in module.parameters()}:
                return module
        raise AmbiguousModel(f"the optimizer's parameters are shared by {describe(whole)}, which share no module")
    if len(holders) > 1:
        raise AmbiguousModel(
            f"the optimizer trains parameters of {len(holders)} models that share no root module "
            f"({describe([root for root, _ in holders])}): make them submodules of one torch.nn.Module, "
            "or sync with the SDK yourself (SyncClient)"
        )
    loose = len(wanted - set().union(*(held for _, held in holders)))
    raise AmbiguousModel(
        f"{loose} of the optimizer's {len(wanted)} tensors belong to no torch.nn.Module, so weightsync cannot "
        "tell what to sync: make them parameters of the model (an nn.Parameter attribute of one of its "
        "modules), or sync with the SDK yourself (SyncClient)"
    )


def describe(modules: Iterable[torch.nn.Module]) -> str:
    return ", ".join(type(m).__name__ for m in modules)
