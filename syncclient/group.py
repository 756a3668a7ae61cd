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

# Every process group a PeerGroup served, referenced until the process ends. gloo's worker thread
# frees a finished collective's tensors, which takes the GIL; when DDP's Reducer held the last
# reference to the group, the script's end destroys the group from the Reducer's destructor, which
# joins that thread while holding the GIL: a deadlock at exit (torch 2.13; 7 of 10 runs of a 2-rank
# DDP script that synced, 0 of 10 with this reference). Held here, the group outlives the Reducer.
# They are let go at exit (atexit runs while the interpreter is whole). The tensors of the SDK's own
# collectives never make gloo's thread ask for the GIL: see _lent.
_KEEP: list[Any] = []


@atexit.register
def _release_groups() -> None:
    served = bool(_KEEP)
    _KEEP.clear()
    if served:
        _quiesce()


QUIESCE_SECONDS = 5.0  # at exit, the longest wait for gloo's worker threads to be idle


def _quiesce() -> None:
    """At exit, before the interpreter finalises: wait, without the GIL, until no worker thread of
    gloo is running. A worker still freeing a finished collective's tensors (other code's: the
    Trainer's, FSDP's own temporaries; the SDK's own are never left to it, see _lent) may need the
    GIL, and one that asks for it once finalisation began is ended inside a C++ destructor: SIGABRT.
    Idle workers wait on their queue (state S); a late one is runnable (R), or waits for the GIL,
    which it gets while this sleeps. Three calm looks in a row, or QUIESCE_SECONDS, end the wait."""
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
    """Lend ``tensors`` to collectives; on leaving, wait until torch.distributed's worker threads
    hold none of them, so that Python, not a worker, is their last owner.

    gloo's worker lets go of a finished collective's tensors a moment *after* the collective has
    returned (the worker notifies, then drops its work). A tensor that Python dropped meanwhile
    is then freed by the worker, which must take the GIL to free its Python object. At a script's
    end that is the abort: the main thread is finalising the interpreter, Python ends the worker
    with ``pthread_exit`` inside the work's destructor, and unwinding a C++ destructor calls
    ``std::terminate`` ("terminate called without an active exception", SIGABRT; a core showed
    ``~AsyncBroadcastWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread`` on
    the worker while the main thread ran ``Py_FinalizeEx``). The same free, taken while the main
    thread holds the GIL in a destructor that joins the worker, is a deadlock. Measured: right
    after a broadcast, gloo still held the tensor in 2 of 3 calls, for under a millisecond.
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
        with _lent(t):
            self._dist.broadcast(t, src=self._src, group=self.group)
        return bool(t.item())

    def tell(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """The leader's JSON ``message``, on every rank (the others pass None)."""
        payload = json.dumps(message).encode() if self.leader else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self._device)
        with _lent(size):
            self._dist.broadcast(size, src=self._src, group=self.group)
        data = torch.zeros(int(size.item()), dtype=torch.uint8, device=self._device)
        if self.leader:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        with _lent(data):
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
                aliases = [tensor.data for tensor in view.tensors.values()]  # each a tensor of its own
                with _lent(*aliases):
                    for alias in aliases:
                        self._dist.broadcast(alias, src=self._src, group=self.group)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full: dict[str, Any] = {} if arrays is None else {n: torch.from_numpy(np.asarray(a)) for n, a in arrays.items()}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        with _lent(*full.values()):  # the leader's are broadcast as they are
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
