"""A peer's update state: the maths of a sync, apart from how bytes travel. numpy only.

A peer keeps ``base``, the global version it started from (float32, one model copy), and for
lossy codecs the error-feedback ``residual`` (one more). A sync sends
``encode(local - base + residual)`` and keeps ``residual = sent - decode(sent)``, so what the
codec rounds away this round is sent in the next one instead of being lost. The round's merged
update ``U`` is then folded in as ``base' = base + decode(U)``: the very sum the hub computes
for version ``v + 1``, so every peer and the hub hold bit-identical bases afterwards.

Overlap (Streaming DiLoCo's eager updates): the peer encoded a snapshot ``x_t`` and trained on;
:meth:`UpdateState.rebase` gives ``base' + (model - x_t)``, the steps taken since the snapshot
on top of the merged version (they count in the next round, whose delta is taken against
``base'``).

Nothing here does I/O: :class:`~syncclient.client.SyncClient` feeds it arrays from the model
and wire tensors from the hub, which is what lets the tests check the maths without a hub.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from syncclient.exceptions import SyncError
from syncwire import Codec, get_codec, wire_name
from syncwire.codecs import slices
from syncwire.format import DTYPES

__all__ = ["EncodedUpdate", "UpdateState"]

_Where = dict[str, tuple[int, int]]  # a slice's values in each wire part: suffix -> (first, count)


@dataclass(frozen=True)
class EncodedUpdate:
    """One update as it goes on the wire, with what the codec did to it."""

    parts: list[tuple[str, np.ndarray, str]]  # (wire name, array, safetensors dtype), in order
    ratio: float  # float32 bytes / bytes sent
    error: float  # ||delta - decoded|| / ||delta|| over the whole model (0 for a lossless codec)


class UpdateState:
    """The base version a peer trains from and its error-feedback residual.

    ``base`` is owned: the arrays given are kept (not copied) and changed in place by
    :meth:`fold`. A new state (after joining or catching up) has no residual: a residual
    belongs to local work, and adopting a version drops that work.
    """

    def __init__(self, codec: Codec, base: dict[str, np.ndarray]) -> None:
        self.codec = codec
        self.base = base
        self.residual: dict[str, np.ndarray] = {}  # lossy codecs only: what rounding kept back
        self._sent: dict[str, np.ndarray] = {}  # wire name -> the last update's part, reused
        # a streamed fold stopped midway (its download failed for good): the base is part one
        # version, part the next, and only adopting a whole version mends it (SyncClient does)
        self.torn = False

    def encode(self, local: Mapping[str, np.ndarray]) -> EncodedUpdate:
        """Encode ``local - base`` (plus the residual) and keep the new residual.

        ``local`` may change (training goes on) once this returns. The parts returned are the
        state's own buffers, reused by the next encode (the client encodes again only once the
        update is sent): fresh 130-500 MB each sync cost GPT-2 up to 1.3 s of page faults here.
        The work goes a slice at a time (:func:`syncwire.codecs.slices`, the hub's own cut) over
        a few threads: the peer encodes before its first byte goes out, and on one thread an
        int8 GPT-2 took as long as its upload at 1 Gbit/s. A slice's bytes do not depend on the
        thread or the order, so the update is the same bytes as on one thread. The residual is
        updated in place; a refused update (NaN) drops it, as it would have half of it replaced.
        """
        codec = self.codec
        parts: list[tuple[str, np.ndarray, str]] = []
        jobs: list[tuple[str, np.ndarray, dict[str, np.ndarray], np.ndarray | None, int, int, _Where]] = []
        for name, x in local.items():
            flat = np.ascontiguousarray(x, np.float32).reshape(-1)
            out = {}
            for suffix, (dtype, shape) in codec.layout(x.shape).items():
                wire, size, kind = wire_name(name, suffix), math.prod(shape), DTYPES[dtype]
                buffer = self._sent.get(wire)
                if buffer is None or buffer.size != size or buffer.dtype != kind:
                    buffer = self._sent[wire] = np.empty(size, kind)
                out[suffix] = buffer
                parts.append((wire, buffer.reshape(shape), dtype))
            residual = None
            if not codec.lossless:
                if name not in self.residual or self.residual[name].shape != x.shape:
                    self.residual[name] = np.zeros(x.shape, np.float32)
                residual = self.residual[name].reshape(-1)
            jobs += [(name, flat, out, residual, *piece) for piece in slices(codec, x.shape)]
        try:
            sums = list(_pool().map(lambda job: self._encode_slice(*job), jobs))  # in order: the first failure
        except SyncError:
            self.residual = {}
            raise
        err, norm = sum(e for e, _ in sums), sum(n for _, n in sums)
        sent = sum(a.nbytes for _, a, _ in parts)
        fp32 = sum(x.nbytes for x in local.values())
        return EncodedUpdate(parts, fp32 / max(sent, 1.0), math.sqrt(err / norm) if norm > 0 else 0.0)

    def _encode_slice(
        self,
        name: str,
        x: np.ndarray,
        out: dict[str, np.ndarray],
        residual: np.ndarray | None,
        start: int,
        stop: int,
        where: _Where,
    ) -> tuple[float, float]:
        """Values ``start:stop`` of tensor ``name`` (``x``: its local values, flat): encode them
        into ``out`` at ``where``, carry ``residual`` in and keep the new rounding there; return
        this slice's squared error and squared norm."""
        codec = self.codec
        delta = x[start:stop] - self.base[name].reshape(-1)[start:stop]
        if not np.isfinite(delta).all():
            raise SyncError(f"tensor {name!r} holds NaN or Inf: the update was not sent (training diverged?)")
        if residual is not None:
            delta += residual[start:stop]
        encoded = codec.encode(delta)
        for suffix, (first, count) in where.items():
            out[suffix][first : first + count] = encoded[suffix].reshape(-1)
        if residual is None:
            return 0.0, 0.0
        left = residual[start:stop]
        np.subtract(delta, codec.decode(encoded, delta.shape), out=left)
        return float(np.dot(left, left)), float(np.dot(delta, delta))

    def fold(self, merged: Mapping[str, np.ndarray], codec: str | None = None) -> None:
        """``base += decode(U)`` from the merged update's wire tensors, a slice at a time (no
        full-size decoded copy of a big tensor; see :func:`syncwire.codecs.slices`). The hub
        builds version ``v + 1`` with the same slices and the same float32 adds. ``codec``: the
        one the result names, if not the run's (a final round's result is fp32)."""
        decoder = self._decoder(codec)
        for name in self.base:
            self._fold_tensor(decoder, name, merged)

    def stream_fold(self) -> StreamFold:
        """A fold that takes the merged update tensor by tensor while it downloads (pass its
        :meth:`StreamFold.take` to :class:`~syncwire.StreamReader`); same bytes as :meth:`fold`."""
        return StreamFold(self)

    def _decoder(self, codec: str | None) -> Codec:
        return self.codec if codec is None or codec == self.codec.spec else get_codec(codec)

    def _fold_tensor(self, decoder: Codec, name: str, merged: Mapping[str, np.ndarray]) -> None:
        base = self.base[name]
        flat = base.reshape(-1)
        for start, stop, where in slices(decoder, base.shape):
            piece = {
                suffix: merged[wire_name(name, suffix)].reshape(-1)[first : first + count]
                for suffix, (first, count) in where.items()
            }
            flat[start:stop] += decoder.decode(piece, (stop - start,))

    def rebase(self, snapshot: dict[str, np.ndarray], local: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``base + (local - snapshot)``: the steps taken since ``snapshot`` on top of the base.

        Computed in ``snapshot``'s arrays (no third copy of the model), which are returned.
        """
        for name, x_t in snapshot.items():
            np.subtract(local[name], x_t, out=x_t)  # the steps taken since the snapshot
            x_t += self.base[name]  # on top of base' (IEEE + commutes: base' + (x - x_t))
        return snapshot


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The threads that encode updates, kept for the process's life (fresh threads per sync
    would each get a fresh malloc arena, as the hub's did: syncserver.engine)."""
    return ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="weightsync-encode")


class StreamFold:
    """Folds a merged update into :attr:`UpdateState.base` as it downloads: each tensor the
    moment its last wire part is in, so the fold runs behind the download instead of after it,
    and no whole result is held. The state is :attr:`~UpdateState.torn` from the first tensor
    folded until :meth:`finish` finds every tensor folded."""

    def __init__(self, state: UpdateState) -> None:
        self.state = state
        self._decoder: Codec | None = None  # the body's codec, known once its header is in
        self._wires: dict[str, list[str]] = {}  # tensor name -> its wire parts' names
        self._owner: dict[str, str] = {}  # wire name -> tensor name
        self._held: dict[str, np.ndarray] = {}  # wire parts of tensors not complete yet
        self._left = set(state.base)

    def take(self, wire: str, array: np.ndarray, metadata: Mapping[str, str]) -> None:
        """One wire tensor of the body, complete (``metadata``: the body's, with its codec)."""
        state = self.state
        if self._decoder is None:
            self._decoder = decoder = state._decoder(metadata.get("codec"))
            for tensor, base in state.base.items():
                self._wires[tensor] = [wire_name(tensor, suffix) for suffix in decoder.layout(base.shape)]
                self._owner |= dict.fromkeys(self._wires[tensor], tensor)
        name = self._owner.get(wire)
        if name is None or name not in self._left:
            raise SyncError(f"the merged update holds {wire!r}, which is no tensor of the run's model left to fold")
        self._held[wire] = array
        wires = self._wires[name]
        if all(w in self._held for w in wires):
            state.torn = True
            state._fold_tensor(self._decoder, name, {w: self._held.pop(w) for w in wires})
            self._left.discard(name)

    def finish(self) -> None:
        """The body is complete: every tensor must have been folded."""
        if self._left:
            raise SyncError(f"the merged update lacks {len(self._left)} tensor(s), e.g. {min(self._left)!r}")
        self.state.torn = False
