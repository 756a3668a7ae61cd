"""A peer's update state: the maths of a sync, apart from how bytes travel. numpy only, no I/O
(the tests check the maths without a hub).

A peer keeps ``base``, the global version it started from (float32, one model copy), and for
lossy codecs the error-feedback ``residual`` (one more). A sync sends
``encode(local - base + residual)`` and keeps ``residual = sent - decode(sent)``, so what the
codec rounds away is sent in the next round, not lost. The merged update ``U`` is folded in as
``base' = base + decode(U)``: the very sum the hub computes for version ``v + 1``, so every peer
and the hub hold bit-identical bases. Overlap: :meth:`syncclient.weights.ModelView.rebase` sets
the model to ``base' + (model - x_t)``, the steps taken since the snapshot ``x_t`` on top of the
merged version (on the model's tensors, in place: torch's work, on their device).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from syncclient.exceptions import SyncError
from syncwire import Codec, get_codec, wire_name
from syncwire.codecs import slices
from syncwire.format import DTYPES

__all__ = ["EncodedUpdate", "UpdateState"]

_Where = dict[str, tuple[int, int]]  # a slice's values in each wire part: suffix -> (first, count)


class EncodedUpdate:
    """One update on its way to the wire: its parts (sized by the codec's layout, so the header
    goes out at once) fill as the encode threads finish. :meth:`ready` waits for one part,
    :meth:`wait` for all and sets ``ratio`` (float32 bytes / bytes sent) and ``error``
    (``||delta - decoded|| / ||delta||``, 0 when lossless); a failed encode (NaN) raises :class:`SyncError`.
    """

    def __init__(
        self,
        parts: list[tuple[str, np.ndarray, str]],
        pending: list[list[Future[tuple[float, float]]]],
        fp32_bytes: int,
        failed: Callable[[], None],
    ) -> None:
        self.parts = parts  # (wire name, array, safetensors dtype), in order
        self._pending = pending  # per part: the encode jobs that write it
        self._fp32_bytes, self._failed = fp32_bytes, failed
        self.ratio = self.error = math.nan

    def ready(self, index: int) -> None:
        """Wait until part ``index`` is encoded."""
        self._results(self._pending[index])

    def wait(self) -> EncodedUpdate:
        """Wait until every part is encoded; set ``ratio`` and ``error``."""
        if math.isnan(self.ratio):
            sums = self._results([job for jobs in self._pending for job in jobs])
            err, norm = sum(e for e, _ in sums), sum(n for _, n in sums)
            sent = sum(a.nbytes for _, a, _ in self.parts)
            self.ratio = self._fp32_bytes / max(sent, 1.0)
            self.error = math.sqrt(err / norm) if norm > 0 else 0.0
        return self

    def settle(self) -> None:
        """Wait until no encode job runs any more: a failed sync must not leave threads writing into
        the state the next one uses."""
        concurrent.futures.wait([job for jobs in self._pending for job in jobs])

    def _results(self, jobs: list[Future[tuple[float, float]]]) -> list[tuple[float, float]]:
        try:
            return [job.result() for job in jobs]  # in order: the first failure
        except SyncError:
            self.settle()
            self._failed()
            raise


class UpdateState:
    """The base version a peer trains from (owned: kept, not copied, and changed in place by
    :meth:`fold`) and its error-feedback residual. A new state (after joining or catching up) has
    no residual: a residual belongs to local work, which adopting a version drops."""

    def __init__(self, codec: Codec, base: dict[str, np.ndarray]) -> None:
        self.codec = codec
        self.base = base
        self.residual: dict[str, np.ndarray] = {}  # lossy codecs only: what rounding kept back
        self._sent: dict[str, np.ndarray] = {}  # wire name -> the last update's part, reused
        # a streamed fold stopped midway (its download failed for good): the base is part one
        # version, part the next, and only adopting a whole version mends it (SyncClient does)
        self.torn = False

    def encode(self, local: Mapping[str, np.ndarray]) -> EncodedUpdate:
        """Start encoding ``local - base`` (plus the residual), keeping the new residual.

        Returns at once: a few threads encode a slice at a time (the hub's cut) in the body's order,
        so the upload sends each part once encoded, not after the whole update (0.6-1.3 s before the
        first byte for GPT-2 on bench/RESULTS.md's VM); the bytes do not depend on the thread.
        ``local``, ``base`` and the residual must not change until :meth:`EncodedUpdate.wait`. The
        parts are the state's buffers, reused by the next encode (fresh 130-500 MB each sync cost
        GPT-2 up to 1.3 s of page faults). A refused update (NaN) drops the half-replaced residual.
        """
        codec = self.codec
        parts: list[tuple[str, np.ndarray, str]] = []
        pending: list[list[Future[tuple[float, float]]]] = []
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
            jobs = [
                _pool().submit(self._encode_slice, name, flat, out, residual, *piece)
                for piece in slices(codec, x.shape)
            ]
            pending += [jobs] * len(out)  # each of the tensor's parts is whole once all its slices are

        def failed() -> None:
            self.residual = {}

        return EncodedUpdate(parts, pending, sum(x.nbytes for x in local.values()), failed)

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
        """Encode values ``start:stop`` of tensor ``name`` (``x``: flat local values) into ``out`` at
        ``where``, with ``residual`` carried in and the new rounding kept; the squared error and norm."""
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
        """``base += decode(U)``, a slice at a time, with the hub's slices and float32 adds (no
        full-size decoded copy). ``codec``: the result's, if not the run's (a final round's is fp32)."""
        decoder = self._decoder(codec)
        for name in self.base:
            self._fold_tensor(decoder, name, merged)

    def stream_fold(self) -> StreamFold:
        """A fold that takes the merged update tensor by tensor while it downloads; same bytes as :meth:`fold`."""
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


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The threads that encode updates, kept for the process's life (fresh threads per sync
    would each get a fresh malloc arena, as the hub's did: syncserver.reduce.engine)."""
    return ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="weightsync-encode")


class StreamFold:
    """Folds a merged update into :attr:`UpdateState.base` as it downloads, each tensor once its
    last wire part is in: no whole result is held. The state is :attr:`~UpdateState.torn` from
    the first tensor folded until :meth:`finish` finds every tensor folded."""

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
