"""A peer that is a torch.distributed process group: several ranks that train one model together
(DDP or FSDP) and sync with the other peers of a run as one (docs/concepts/groups.md).

Rank 0, the *leader*, alone talks to the hub; the other ranks never open a connection. Around each
of the leader's calls every rank runs, in this order:

1. **gather**: the leader gets the group's float32 weights: DDP, its own copy; FSDP,
   ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, on its CPU only.
2. **tell**: the leader broadcasts the call's outcome as JSON (no pickle), its error included,
   so that the other ranks raise too instead of waiting forever in the next collective.
3. **scatter**: DDP, the leader loads the merged weights and broadcasts each tensor in place;
   FSDP, ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``.

So all ranks of all peers hold the hub's version bit for bit. FSDP gathers to the leader because
the hub takes one update per peer (one digest, sample count and acknowledgement); the cost is 3
float32 model copies in the leader's host RAM (~1.5 GB for GPT-2 124M, ~84 GB for 7B: beyond
that, give rank 0's host the RAM or use DDP). The GPUs never hold the full model.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from syncclient.exceptions import SyncError
from syncclient.weights import ModelView, unwrap

__all__ = ["GroupError", "PeerGroup"]

T = TypeVar("T")

# Every process group a PeerGroup served, referenced until exit (atexit, while the interpreter is
# whole). gloo's worker takes the GIL to free a finished collective's tensors; when DDP's Reducer
# held the group's last reference, the script's end destroyed the group from the Reducer's
# destructor, joining that thread with the GIL held: a deadlock at exit (torch 2.13; 7 of 10 runs
# of a 2-rank DDP script that synced, 0 of 10 with this reference). See _lent for the SDK's own.
_KEEP: list[Any] = []


@atexit.register
def _release_groups() -> None:
    served = bool(_KEEP)
    _KEEP.clear()
    if served:
        _quiesce()


QUIESCE_SECONDS = 5.0  # at exit, the longest wait for gloo's worker threads to be idle


def _quiesce() -> None:
    """At exit, before the interpreter finalises: wait, without the GIL, until no gloo worker runs.
    One still freeing other code's tensors (the Trainer's, FSDP's; the SDK's: see _lent) may need
    the GIL, and one that asks once finalisation began is ended inside a C++ destructor: SIGABRT.
    Idle workers wait on their queue (state S); a late one is runnable (R), or gets the GIL while
    this sleeps. Three calm looks in a row, or QUIESCE_SECONDS, end the wait."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():  # not Linux: nothing to look at
        return
    deadline, calm = time.monotonic() + QUIESCE_SECONDS, 0
    while calm < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
        calm = calm + 1 if all(state == "S" for state in gloo_worker_states(tasks)) else 0


def gloo_worker_states(tasks: Path = Path("/proc/self/task")) -> list[str]:
    """The scheduler state (R, S, D...) of each of gloo's worker threads in this process."""
    states = []
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if (task / "comm").read_text().strip() == "pt_gloo_runloop":
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return states


#: How long gloo's worker thread may keep a collective's tensors after the collective returned
#: (it lets go well within a millisecond; this bounds a stuck one).
LEND_SECONDS = 10.0
_STUCK: list[torch.Tensor] = []  # tensors a worker kept past LEND_SECONDS: never dropped by Python


def _owners(t: torch.Tensor) -> int:
    """References to ``t``'s TensorImpl: its Python object's, and each C++ holder's (a work's)."""
    return int(t._use_count())  # type: ignore[attr-defined]  # torch's own, not in its stubs


@contextlib.contextmanager
def _lent(*tensors: torch.Tensor) -> Iterator[None]:
    """Lend ``tensors`` to collectives; on leaving, wait until torch.distributed's workers hold
    none of them, so that Python, not a worker, is their last owner.

    gloo's worker drops a finished collective's tensors a moment *after* it returned (right after
    a broadcast it still held the tensor in 2 of 3 calls, for under a millisecond). A tensor Python
    dropped meanwhile is then freed by the worker, taking the GIL. At a script's end that aborts:
    Python ends the worker with ``pthread_exit`` inside the work's destructor and the unwinding
    calls ``std::terminate`` ("terminate called without an active exception"; a core showed
    ``~AsyncBroadcastWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread`` while
    the main thread ran ``Py_FinalizeEx``); taken while the main thread holds the GIL joining the
    worker, it is a deadlock.
    """
    before = [_owners(t) for t in tensors]
    yield
    deadline = time.monotonic() + LEND_SECONDS
    for t, count in zip(tensors, before, strict=True):
        while _owners(t) > count:
            if time.monotonic() > deadline:
                _STUCK.append(t)  # then the worker never holds its last reference
                break
            time.sleep(0.0002)  # without the GIL: the worker may need it to finish


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
        with _lent(t):
            self._dist.all_reduce(t, group=self.group)
        return int(t.item())

    def flag(self, value: bool) -> bool:
        """The leader's ``value``, on every rank."""
        t = torch.tensor([int(value)], dtype=torch.uint8, device=self._device)
        self._broadcast(t)
        return bool(t.item())

    def tell(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """The leader's JSON ``message``, on every rank (the others pass None)."""
        payload = json.dumps(message).encode() if self.leader else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self._device)
        self._broadcast(size)
        data = torch.zeros(int(size.item()), dtype=torch.uint8, device=self._device)
        if self.leader:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._broadcast(data)
        told: dict[str, Any] = json.loads(bytes(data.cpu().numpy()))
        return told

    def _broadcast(self, *tensors: torch.Tensor) -> None:
        """The leader's ``tensors``, in place on every rank."""
        with _lent(*tensors):
            for t in tensors:
                self._dist.broadcast(t, src=self._src, group=self.group)

    # ---- weights ---------------------------------------------------------------------------
    @staticmethod
    def sharded(model: torch.nn.Module) -> bool:
        """FSDP (DTensor parameters) rather than DDP (each rank the whole model)."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in unwrap(model).parameters())

    def gather(self, model: torch.nn.Module) -> dict[str, np.ndarray] | None:
        """The group's weights as float32 arrays on the leader (None on the others)."""
        module = unwrap(model)
        view = ModelView(module)
        if not self.sharded(module):
            return {name: array.copy() for name, array in view.export().items()} if self.leader else None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full: dict[str, Any] = get_model_state_dict(module, options=options)  # plain CPU tensors
        if not self.leader:
            return None
        return {name: full[name].detach().to("cpu", torch.float32).numpy() for name in view.schema}

    def scatter(self, model: torch.nn.Module, arrays: dict[str, np.ndarray] | None) -> None:
        """Load the leader's ``arrays`` into ``model`` on every rank (the others pass None)."""
        module = unwrap(model)
        if not self.sharded(module):
            view = ModelView(module)
            if self.leader:
                assert arrays is not None
                view.load(arrays)
            with torch.no_grad():
                self._broadcast(*[tensor.data for tensor in view.tensors.values()])  # each a tensor of its own
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, Any] = {} if arrays is None else {n: torch.from_numpy(np.asarray(a)) for n, a in arrays.items()}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        with _lent(*full.values()):  # the leader's are broadcast as they are
            set_model_state_dict(module, full, options=options)  # strict=False: a tied weight travels once

    # ---- one call of the leader's, for the whole group ---------------------------------------
    def run(self, model: torch.nn.Module, call: Callable[[dict[str, np.ndarray]], T], kind: type[T]) -> T:
        """Gather, let the leader ``call`` on the arrays (which it may change: the new weights),
        tell everyone, scatter. Every rank returns the leader's result (a ``kind``: a dataclass or
        a JSON value) or raises when it failed (the others :class:`GroupError`), weights untouched."""
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
