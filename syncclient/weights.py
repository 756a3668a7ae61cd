"""A torch model seen as the wire sees it: named float32 numpy arrays.

What is synced: every parameter once (``named_parameters`` skips a tied weight's second name, so
GPT-2's ``lm_head.weight`` travels as ``transformer.wte.weight`` and stays tied), plus
floating-point *persistent* buffers, which training may change (BatchNorm statistics). Other
buffers (GPT-2's causal mask, rotary tables, step counters) are constants and stay local.
"""

from __future__ import annotations

from collections.abc import Mapping

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

    @torch.no_grad()
    def snapshot(self, kept: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """float32 copies of the current values, written into ``kept``'s arrays (allocated there on
        first use): the caller keeps them from sync to sync, since a fresh copy of GPT-2's 498 MB
        costs twice a copy into memory already touched, in page faults."""
        out = {}
        for name, t in self.tensors.items():
            array = kept.get(name)
            if array is None or array.shape != tuple(t.shape):
                array = kept[name] = np.empty(tuple(t.shape), np.float32)
            torch.from_numpy(array).copy_(t)  # from the GPU too, cast from bf16 too
            out[name] = array
        return out

    @torch.no_grad()
    def rebase(self, base: Mapping[str, np.ndarray], snapshot: Mapping[str, np.ndarray]) -> None:
        """Set the model to ``base + (model - snapshot)`` (overlap: the merged version plus the
        steps taken since the snapshot), in place on each tensor's device, in float32: bit for bit
        numpy's ``base + (x - x_t)`` (one rounding per operation, and + commutes). Two in-place
        passes and no model-sized temporary: exporting, computing in numpy and loading back took
        three passes and an allocation (GPT-2 on 2 cores: 0.18 s against 0.08 s, bench/hostwork.py)."""
        for name, t in self.tensors.items():
            x_t, b = (torch.from_numpy(np.asarray(a[name])).to(t.device).reshape(t.shape) for a in (snapshot, base))
            x = t if t.dtype == torch.float32 else t.float()  # another dtype: in float32, rounded once
            x.sub_(x_t).add_(b)
            if x is not t:
                t.copy_(x)


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
