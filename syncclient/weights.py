"""A torch model seen as the wire sees it: named float32 numpy arrays.

What is synced: every parameter once (``named_parameters`` skips a tied weight's second name, so
GPT-2's ``lm_head.weight`` travels as ``transformer.wte.weight`` and stays tied), plus
floating-point *persistent* buffers, which training may change (BatchNorm statistics). Other
buffers (GPT-2's causal mask, rotary tables, step counters) are constants and stay local.
"""

from __future__ import annotations

import numpy as np
import torch

from syncwire import Schema


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module that owns the weights: through ``torch.compile`` and DDP-style wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


class ModelView:
    """Named tensors of a model, exported to and loaded from numpy."""

    def __init__(self, model: torch.nn.Module) -> None:
        module = unwrap(model)
        persistent = set(module.state_dict(keep_vars=True))
        self.tensors: dict[str, torch.Tensor] = dict(module.named_parameters())
        for name, buf in module.named_buffers():
            if buf.is_floating_point() and name in persistent:
                self.tensors[name] = buf

    @property
    def schema(self) -> Schema:
        return {name: tuple(t.shape) for name, t in self.tensors.items()}

    def export(self) -> dict[str, np.ndarray]:
        """float32 arrays of the current values. On CPU float32 they share memory with the model
        (``to`` copies nothing then): read them before the next optimizer step."""
        return {name: t.detach().to("cpu", torch.float32).numpy() for name, t in self.tensors.items()}

    @torch.no_grad()
    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Copy ``arrays`` into the model (cast to each tensor's dtype and device)."""
        for name, t in self.tensors.items():
            t.copy_(torch.from_numpy(np.asarray(arrays[name])).reshape(t.shape))


class ArrayView:
    """A model held as named float32 arrays (what a process group's leader syncs for the group),
    with :class:`ModelView`'s surface; ``load`` copies into the arrays in place."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    @property
    def schema(self) -> Schema:
        return {name: tuple(a.shape) for name, a in self.arrays.items()}

    def export(self) -> dict[str, np.ndarray]:
        return self.arrays

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        for name, a in self.arrays.items():
            np.copyto(a, np.asarray(arrays[name]).reshape(a.shape))
