"""Blockwise absmax quantizers: ``int8`` and ``int4``. numpy only.

The flattened tensor is cut into blocks of ``block`` values (the last one may be short); each
block keeps one float32 ``scale = absmax / qmax`` (rounded up, never down) and its values as
``q = round(x / scale)`` in ``[-qmax, qmax]``; decoding is ``q * scale`` in float32. Symmetric (no
zero point): deltas are centred on zero, and a zero point would cost 4 bytes more per block. Per
value ``|x - decode(x)| <= scale / 2``, up to a few ulps of the scale; error feedback carries the rest.

Wire parts of a tensor ``name`` with ``n`` values and ``nblocks = ceil(n / block)``:

==========  =====================================  ======================  =========================
spec        ``name``                               ``name:scale``          bytes vs fp32 (default)
==========  =====================================  ======================  =========================
``int8``    ``I8``, the tensor's shape             ``F32`` ``(nblocks,)``  (1 + 4/64) / 4 = 0.266
``int4``    ``U8`` ``(ceil(n / 2),)``, 2 per byte  ``F32`` ``(nblocks,)``  (0.5 + 4/128) / 4 = 0.133
==========  =====================================  ======================  =========================

Defaults: ``int8`` uses ``block=64``, ``int4`` uses ``block=128`` (with 64, the scales alone
push int4 to 0.141x). ``int4`` packs value ``2i`` in the low nibble of byte ``i`` and value
``2i + 1`` in the high nibble, each as a 4-bit two's complement number; an odd count leaves
the last high nibble zero.

Both work about 1 MB of float32 at a time, so the temporaries stay in cache (a 38.6M-value
embedding needs no full-size float32 temporary). Decoding is total: finite scales and any integer
bytes give finite float32 values (clipped to float32's range); non-finite scales or parts of the
wrong size raise :class:`~syncwire.format.FormatError`, so the hub rejects a corrupt body instead
of averaging NaN into everyone's weights. Encoding NaN or Inf raises ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import ClassVar

import numpy as np

from syncwire.codecs import Codec, register_codec
from syncwire.format import FormatError

__all__ = ["Int4", "Int8"]

_F32_MAX = float(np.finfo(np.float32).max)
#: Values per chunk: 1 MB of float32 work buffer, which keeps the passes in L2.
_CHUNK = 1 << 18


class _Absmax(Codec):
    """Symmetric blockwise absmax quantization of the flattened tensor."""

    name: ClassVar[str]
    #: Largest quantized magnitude the encoder writes.
    qmax: ClassVar[int]
    #: Largest magnitude the wire dtype can hold (``-128`` for int8, ``-8`` for int4): the
    #: decoder must stay finite for bytes no honest encoder writes.
    qlimit: ClassVar[int]
    default_block: ClassVar[int]
    lossless = False

    def __init__(self, block: int | None = None) -> None:
        block = self.default_block if block is None else block
        self._check_block(block)
        self.block = block
        self.spec = self.name if block == self.default_block else f"{self.name}:block={block}"

    def _check_block(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 2:
            raise ValueError(f"codec {self.name!r}: block must be an integer >= 2, got {block!r}")

    def nblocks(self, shape: tuple[int, ...]) -> int:
        """Number of scales a tensor of ``shape`` has."""
        return self._blocks(math.prod(shape))

    def _blocks(self, n: int) -> int:
        return -(-n // self.block)

    def _step(self, n: int) -> int:
        """Values per chunk: a whole number of blocks, at most ``n``."""
        return max(1, min(n, max(self.block, _CHUNK // self.block * self.block)))

    def _chunks(self, n: int) -> Iterator[tuple[int, int, slice]]:
        """``(start, end, its scales)`` of each chunk of ``n`` values."""
        step = self._step(n)
        for start in range(0, n, step):
            end = min(n, start + step)
            yield start, end, slice(start // self.block, start // self.block + self._blocks(end - start))

    def _quantize(self, seg: np.ndarray, scale_out: np.ndarray, q_out: np.ndarray, work: np.ndarray) -> None:
        """Quantize ``seg`` (starting on a block boundary) into ``q_out`` (int8) and its scales."""
        n, block, qmax = seg.size, self.block, self.qmax
        a = work[:n]
        np.abs(seg, out=a)
        amax = np.maximum.reduceat(a, np.arange(0, n, block))  # the last block may be short
        if not np.isfinite(amax).all():
            raise ValueError(f"codec {self.spec!r} cannot encode NaN or Inf")
        scale = amax / np.float32(qmax)
        with np.errstate(over="ignore"):
            # Round the scale up where float32 rounded it down, so |x / scale| <= qmax holds
            # even for subnormal blocks, whose scale can lose most of its precision.
            low = scale * np.float32(qmax) < amax
        if low.any():
            scale[low] = np.nextafter(scale[low], np.float32(np.inf))
        scale_out[:] = scale
        divisor = np.where(scale > 0, scale, np.float32(1))  # an all-zero block quantizes to 0
        full = n // block * block
        np.divide(seg[:full].reshape(-1, block), divisor[: full // block, None], out=a[:full].reshape(-1, block))
        if full < n:
            np.divide(seg[full:], divisor[-1], out=a[full:])
        np.rint(a, out=a)
        np.clip(a, -qmax, qmax, out=a)  # a no-op by the scale's rounding; a wrapped int8 flips signs
        np.copyto(q_out, a, casting="unsafe")

    def _dequantize(self, q: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
        """``out = q * scale`` block by block, clipped to float32's range when it could overflow."""
        n, block = q.size, self.block
        full = n // block * block
        with np.errstate(over="ignore"):
            np.multiply(q[:full].reshape(-1, block), scale[: full // block, None], out=out[:full].reshape(-1, block))
            if full < n:
                np.multiply(q[full:], scale[-1], out=out[full:])
        if scale.size and float(np.abs(scale).max()) > _F32_MAX / self.qlimit:
            np.clip(out, -_F32_MAX, _F32_MAX, out=out)

    def _parts(
        self, parts: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: np.dtype, size: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The main part (flat, contiguous) and the scales, checked against ``shape``."""
        main, scale = np.asarray(parts[""]), np.asarray(parts["scale"])
        if main.dtype != dtype or main.size != size:
            raise FormatError(
                f"codec {self.spec!r}: main part is {main.dtype}{list(main.shape)}, expected {size} {dtype}"
            )
        nblocks = self.nblocks(shape)
        if scale.dtype != np.float32 or scale.size != nblocks:
            raise FormatError(
                f"codec {self.spec!r}: scale is {scale.dtype}{list(scale.shape)}, expected {nblocks} float32"
            )
        scale = np.ascontiguousarray(scale).reshape(-1)
        if not np.isfinite(scale).all():
            raise FormatError(f"codec {self.spec!r}: scales must be finite")
        return np.ascontiguousarray(main).reshape(-1), scale


class Int8(_Absmax):
    """int8 with one float32 scale per ``block`` values (default 64): 0.266x the bytes of fp32."""

    name = "int8"
    qmax = 127
    qlimit = 128
    default_block = 64

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"": ("I8", shape), "scale": ("F32", (self.nblocks(shape),))}

    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        x = np.asarray(x, dtype=np.float32)  # not ascontiguousarray: it turns 0-d into 1-d
        flat = x.reshape(-1)
        n = flat.size
        q = np.empty(n, np.int8)
        scale = np.empty(self._blocks(n), np.float32)
        work = np.empty(self._step(n), np.float32)
        for start, end, scales in self._chunks(n):
            self._quantize(flat[start:end], scale[scales], q[start:end], work)
        return {"": q.reshape(x.shape), "scale": scale}

    def decode(self, parts: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape)
        q, scale = self._parts(parts, shape, np.dtype(np.int8), n)
        out = np.empty(n, np.float32)
        for start, end, scales in self._chunks(n):
            self._dequantize(q[start:end], scale[scales], out[start:end])
        return out.reshape(shape)


class Int4(_Absmax):
    """4-bit values in ``[-7, 7]``, two per byte, one float32 scale per ``block`` (default 128).

    0.133x the bytes of fp32; the block must be even so that every block starts on a byte.
    """

    name = "int4"
    qmax = 7
    qlimit = 8
    default_block = 128

    def _check_block(self, block: int) -> None:
        super()._check_block(block)
        if block % 2:
            raise ValueError(f"codec 'int4': block must be even (two values per byte), got {block}")

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"": ("U8", ((math.prod(shape) + 1) // 2,)), "scale": ("F32", (self.nblocks(shape),))}

    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        flat = np.asarray(x, dtype=np.float32).reshape(-1)
        n = flat.size
        packed = np.empty((n + 1) // 2, np.uint8)
        scale = np.empty(self._blocks(n), np.float32)
        step = self._step(n)
        work = np.empty(step, np.float32)
        q = np.zeros(step + 1, np.int8)  # one spare value: zero padding for an odd count
        for start, end, scales in self._chunks(n):
            size = end - start
            self._quantize(flat[start:end], scale[scales], q[:size], work)
            if size % 2:
                q[size] = 0
                size += 1
            pairs = q[:size].view(np.uint8).reshape(-1, 2)
            dst = packed[start // 2 : start // 2 + size // 2]
            np.bitwise_and(pairs[:, 0], 0x0F, out=dst)
            dst |= pairs[:, 1] << 4
        return {"": packed, "scale": scale}

    def decode(self, parts: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape)
        packed, scale = self._parts(parts, shape, np.dtype(np.uint8), (n + 1) // 2)
        out = np.empty(n, np.float32)
        step = self._step(n)
        q = np.empty((step + 1) // 2 * 2, np.int8).reshape(-1, 2)
        low = np.empty(len(q), np.uint8)
        for start, end, scales in self._chunks(n):
            chunk = packed[start // 2 : (end + 1) // 2]
            k = chunk.size
            # Sign-extend each nibble: move it to the top of an int8, then shift back down.
            np.left_shift(chunk, 4, out=low[:k])
            np.right_shift(low[:k].view(np.int8), 4, out=q[:k, 0])
            np.right_shift(chunk.view(np.int8), 4, out=q[:k, 1])
            values = q[:k].reshape(-1)[: end - start]
            self._dequantize(values, scale[scales], out[start:end])
        return out.reshape(shape)


register_codec("int8", Int8)
register_codec("int4", Int4)
