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

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from syncclient.exceptions import SyncError
from syncwire import Codec, get_codec, wire_name
from syncwire.codecs import slices

__all__ = ["EncodedUpdate", "UpdateState"]


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

    def encode(self, local: Mapping[str, np.ndarray]) -> EncodedUpdate:
        """Encode ``local - base`` (plus the residual) and keep the new residual.

        Returns new arrays: ``local`` may change (training goes on) once this returns.
        """
        codec, parts = self.codec, []
        sent = err = norm = 0.0
        for name, x in local.items():
            delta = x - self.base[name]
            if not np.isfinite(delta).all():
                raise SyncError(f"tensor {name!r} holds NaN or Inf: the update was not sent (training diverged?)")
            if not codec.lossless and name in self.residual:
                delta += self.residual[name]
            encoded = codec.encode(delta)
            layout = codec.layout(delta.shape)
            for suffix, array in encoded.items():
                parts.append((wire_name(name, suffix), array, layout[suffix][0]))
                sent += array.nbytes
            if not codec.lossless:
                residual = delta - codec.decode(encoded, delta.shape)
                self.residual[name] = residual
                err += float(np.dot(residual.ravel(), residual.ravel()))
                norm += float(np.dot(delta.ravel(), delta.ravel()))
        fp32 = sum(x.nbytes for x in local.values())
        return EncodedUpdate(parts, fp32 / max(sent, 1.0), math.sqrt(err / norm) if norm > 0 else 0.0)

    def fold(self, merged: Mapping[str, np.ndarray], codec: str | None = None) -> None:
        """``base += decode(U)`` from the merged update's wire tensors, a slice at a time (no
        full-size decoded copy of a big tensor; see :func:`syncwire.codecs.slices`). The hub
        builds version ``v + 1`` with the same slices and the same float32 adds. ``codec``: the
        one the result names, if not the run's (a final round's result is fp32)."""
        decoder = self.codec if codec is None or codec == self.codec.spec else get_codec(codec)
        for name, base in self.base.items():
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
