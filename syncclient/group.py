"""A peer that is a torch.distributed process group: several ranks (GPUs, or processes) that
train one model together, and sync with the other peers of a run as one.

Inside the group, torch.distributed does the work (DDP, FSDP, over NCCL on GPUs or gloo on
CPUs); between groups, weightsync. Rank 0 of the group is the *leader*: it alone talks to the
hub (join, sync, pull, leave); the other ranks never open a connection. Around each of the
leader's calls the group runs three collectives, in this order on every rank:

1. **gather**: the leader gets the group's weights as float32 arrays. DDP (every rank holds the
   whole model, identical): its own copy, no collective. FSDP (sharded parameters, DTensors):
   ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, which assembles the full
   weights on the leader's CPU one tensor at a time and nowhere else.
2. **tell**: the leader runs the call, then broadcasts its outcome as JSON (a byte tensor: no
   pickle): the result, or the error it raised, so that the other ranks raise too instead of
   waiting forever in the next collective.
3. **scatter**: the merged weights go from the leader to every rank. DDP: the leader loads them,
   then broadcasts every synced tensor in place. FSDP: ``set_model_state_dict(full_state_dict=True,
   broadcast_from_rank0=True)``, which sends each tensor and keeps only each rank's shard.

So after every sync all ranks of all peers hold bit-identical weights, equal to the hub's version.

Why FSDP gathers to the leader instead of syncing each rank's shard: the hub's protocol is one
update per peer, with one digest, one sample count and one acknowledgement; a peer made of P
uploads would need P-way commits on the hub. The cost is memory on the leader's host only: the
full float32 model, plus the SDK's base copy and (lossy codecs) its error-feedback residual, i.e.
3 model copies in CPU RAM, against 1/P of the model per GPU for the others. A GPT-2 124M leader
needs ~1.5 GB of host RAM; a 7B model ~84 GB, so beyond that size give rank 0's host the RAM or
use DDP. The GPUs never hold the full model.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from syncclient._model import ModelView, unwrap
from syncclient.exceptions import SyncError

__all__ = ["GroupError", "PeerGroup"]

T = TypeVar("T")

# Every process group a PeerGroup served, referenced until the process ends. gloo's worker thread
# frees a finished collective's tensors, which takes the GIL; when DDP's Reducer held the last
# reference to the group, the script's end destroys the group from the Reducer's destructor, which
# joins that thread while holding the GIL: a deadlock at exit (torch 2.13; 7 of 10 runs of a 2-rank
# DDP script that synced, 0 of 10 with this reference). Held here, the group outlives the Reducer.
# They are let go at exit (atexit runs while the interpreter is whole): a group destroyed later, in
# the interpreter's finalisation, can abort the process ("terminate called without an active
# exception") when gloo's thread asks for the GIL there.
_KEEP: list[Any] = []


@atexit.register
def _release_groups() -> None:
    _KEEP.clear()


class GroupError(SyncError):
    """Rank 0 of this peer's group failed; its error is in the message."""


class PeerGroup:
    """The ranks of one peer, over a torch.distributed process group (``group.WORLD`` under a
    plain ``torchrun``)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group= needs torch.distributed initialised (torchrun, then init_process_group)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.leader = self.rank == 0
        self._src = dist.get_global_rank(group, 0)
        backend = dist.get_backend(group)
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        if not any(kept is group for kept in _KEEP):
            _KEEP.append(group)

    # ---- small collectives -------------------------------------------------------------------
    def total(self, samples: int) -> int:
        """Every rank's ``samples``, summed (on every rank)."""
        t = torch.tensor([samples], dtype=torch.int64, device=self._device)
        self._dist.all_reduce(t, group=self.group)
        return int(t.item())

    def flag(self, value: bool) -> bool:
        """The leader's ``value``, on every rank."""
        t = torch.tensor([int(value)], dtype=torch.uint8, device=self._device)
        self._dist.broadcast(t, src=self._src, group=self.group)
        return bool(t.item())

    def tell(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """The leader's JSON ``message``, on every rank (the others pass None)."""
        payload = json.dumps(message).encode() if self.leader else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self._device)
        self._dist.broadcast(size, src=self._src, group=self.group)
        data = torch.zeros(int(size.item()), dtype=torch.uint8, device=self._device)
        if self.leader:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._dist.broadcast(data, src=self._src, group=self.group)
        told: dict[str, Any] = json.loads(bytes(data.cpu().numpy()))
        return told

    # ---- weights ---------------------------------------------------------------------------
    @staticmethod
    def sharded(model: torch.nn.Module) -> bool:
        """FSDP (DTensor parameters) rather than DDP (each rank the whole model)."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in unwrap(model).parameters())

    def gather(self, model: torch.nn.Module) -> dict[str, np.ndarray] | None:
        """The group's weights as float32 arrays on the leader (None on the others)."""
        module = unwrap(model)
        names = list(ModelView(module).schema)
        if not self.sharded(module):
            if not self.leader:
                return None
            return {name: array.copy() for name, array in ModelView(module).export().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.leader:
            return None
        tensors: dict[str, Any] = full  # a full state dict holds plain CPU tensors
        return {name: tensors[name].detach().to("cpu", torch.float32).numpy() for name in names}

    def scatter(self, model: torch.nn.Module, arrays: dict[str, np.ndarray] | None) -> None:
        """Load the leader's ``arrays`` into ``model`` on every rank (the others pass None)."""
        module = unwrap(model)
        if not self.sharded(module):
            view = ModelView(module)
            if self.leader:
                assert arrays is not None
                view.load(arrays)
            with torch.no_grad():
                for tensor in view.tensors.values():
                    self._dist.broadcast(tensor.data, src=self._src, group=self.group)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, Any] = {} if arrays is None else {n: torch.from_numpy(np.asarray(a)) for n, a in arrays.items()}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(module, full, options=options)  # strict=False: a tied weight travels once

    # ---- one call of the leader's, for the whole group ---------------------------------------
    def run(self, model: torch.nn.Module, call: Callable[[dict[str, np.ndarray]], T], kind: type[T]) -> T:
        """Gather, let the leader ``call`` on the arrays (which it may change: the new weights),
        tell everyone what happened, scatter the arrays. Every rank returns the leader's result
        (a ``kind``: a dataclass or a JSON value), or raises when the leader failed (the leader
        its own exception, the others :class:`GroupError`), with the group's weights untouched."""
        arrays = self.gather(model)
        if not self.leader:
            told = self.tell(None)
            if not told["ok"]:
                raise GroupError(f"rank 0 of this peer failed: {told['error']}")
            self.scatter(model, None)
            value: Any = told["value"]
            return kind(**value) if dataclasses.is_dataclass(kind) else kind(value)  # type: ignore[call-arg]
        assert arrays is not None
        try:
            mine = call(arrays)
        except BaseException as exc:
            self.tell({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            raise
        said = dataclasses.asdict(mine) if dataclasses.is_dataclass(mine) else mine  # type: ignore[arg-type]
        self.tell({"ok": True, "value": said})
        self.scatter(model, arrays)
        return mine
