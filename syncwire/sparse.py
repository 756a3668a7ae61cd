"""Top-k sparsification: the ``topk`` codec. numpy only.

The flattened tensor is cut into chunks of ``chunk`` values (the last one may be short). Each
chunk sends only its ``k`` values of largest magnitude (all when it holds ``k`` or fewer), as
offsets inside the chunk and values at ``bits`` bits. Per ``block`` values (whole chunks), scales
``lo, hi``: the smallest and largest magnitude sent. A value is a sign bit and a magnitude on
``2 ** (bits - 1)`` even levels from ``lo`` to ``hi`` (not from 0: on heavy-tailed deltas a grid
from 0 sent most values at twice their size); with ``bits=1`` the sign alone, and ``lo = hi`` the
mean of those sent. What the codec leaves out goes into the error-feedback residual (the client's
for uploads, the hub's for results: ``hub_feedback``), to be sent in a later round.

Wire parts of a tensor ``name``, with ``w = bit_length(chunk - 1)`` bits per offset and ``s``
values sent in a block (``k`` per whole chunk, ``min(k, size)`` for a short last one):

===============  =======  =========================================================
part             dtype    per block, in block order
===============  =======  =========================================================
``name``         ``U8``   ``ceil(s * bits / 8)`` bytes: the codes, ``bits`` each
``name:index``   ``U8``   ``ceil(s * w / 8)`` bytes: the offsets in their chunks
``name:scale``   ``F32``  ``lo, hi``
===============  =======  =========================================================

Codes and offsets are packed least significant bit first, chunk after chunk, and each block
starts on a byte, so a slice of whole blocks is a slice of every part
(:func:`syncwire.codecs.slices`). A code is ``level << 1 | sign``.

The default, ``chunk=4, k=1, bits=1, block=1024``, sends the largest of every 4 values (25%)
as its sign and 2 bits of offset: ``(256 * 3 / 8 + 8) / 4096 = 0.0254`` of fp32's bytes. On
real GPT-2 deltas (AdamW, ``bench/sparse.py``) the density mattered far more than the bits:
after 6 rounds with error feedback it left out 26% of the deltas' sum, against 56% for 12.5% at
2 bits and 77% for 6% at 2 bits (top 64 of 1024), at about the same bytes; bench/RESULTS.md
("Sparse codec") has the table.

Decoding is total on well-formed parts and strict on the rest: the parts' sizes, finite scales
with ``0 <= lo <= hi``, offsets inside their chunk and strictly increasing (a repeated one would
make "what was sent" ambiguous) are checked, raising :class:`~syncwire.format.FormatError`; the
hub decodes such an update before acknowledging it (``check_on_receipt``): a 422. Encoding NaN or
Inf raises ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from syncwire.codecs import Codec, register_codec
from syncwire.format import DTYPES, FormatError

__all__ = ["TopK"]

#: Values encoded or decoded at a time: the bit-unpacking temporaries of 2^18 values stay a
#: few MB whatever the tensor's size (GPT-2's embedding has 38.6M values).
_STEP = 1 << 18


#: A run of ``count`` chunks of ``size`` values, ``sent`` of each sent: how a block is cut.
Segment = tuple[int, int, int]


class TopK(Codec):
    """The ``k`` largest magnitudes of each ``chunk`` values, at ``bits`` bits, with their offsets;
    one ``lo, hi`` pair of scales per ``block`` values (a whole number of chunks)."""

    name = "topk"
    lossless = False
    hub_feedback = True
    check_on_receipt = True
    flush = False
    defaults: ClassVar[dict[str, int]] = {"chunk": 4, "k": 1, "bits": 1, "block": 1024}

    def __init__(self, chunk: int = 4, k: int = 1, bits: int = 1, block: int = 1024) -> None:
        checks = (
            ("chunk", chunk, 2, 1 << 16),
            ("k", k, 1, chunk),
            ("bits", bits, 1, 8),
            ("block", block, chunk, 1 << 20),
        )
        for key, value, low, high in checks:
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"codec 'topk': {key} must be an integer in [{low}, {high}], got {value!r}")
        if block % chunk:
            raise ValueError(f"codec 'topk': block must be a multiple of chunk ({chunk}), got {block}")
        self.chunk, self.k, self.bits, self.block = chunk, k, bits, block  # slices start on a block
        self.width = (chunk - 1).bit_length()  # bits per offset
        self.levels = 1 << (bits - 1)
        given = {"chunk": chunk, "k": k, "bits": bits, "block": block}
        params = ",".join(f"{key}={value}" for key, value in given.items() if value != self.defaults[key])
        self.spec = f"topk:{params}" if params else "topk"

    # ---- layout ----------------------------------------------------------------------------
    def _segments(self, size: int) -> list[Segment]:
        """How a block of ``size`` values (the last one may be short) is cut into chunks."""
        full, rest = divmod(size, self.chunk)
        out = [(full, self.chunk, self.k)] if full else []
        return [*out, (1, rest, min(self.k, rest))] if rest else out

    def _row_sizes(self, size: int) -> tuple[int, int]:
        """Bytes of codes and bytes of offsets of one block of ``size`` values."""
        sent = sum(count * m for count, _, m in self._segments(size))
        return _bytes(sent * self.bits), _bytes(sent * self.width)

    def _sizes(self, n: int) -> tuple[int, int, int]:
        """Bytes of codes, bytes of offsets, number of scales for ``n`` values."""
        full, rest = divmod(n, self.block)
        codes, index = (full * size for size in self._row_sizes(self.block))
        if rest:
            last = self._row_sizes(rest)
            codes, index = codes + last[0], index + last[1]
        return codes, index, 2 * (full + (rest > 0))

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        codes, index, scales = self._sizes(math.prod(shape))
        return {"": ("U8", (codes,)), "index": ("U8", (index,)), "scale": ("F32", (scales,))}

    def _rows(self, flat: np.ndarray) -> list[np.ndarray]:
        """The flattened values as rows of whole blocks, a few at a time, then the short last block."""
        full = flat.size // self.block
        per = max(1, _STEP // self.block)
        out = [
            flat[i * self.block : min(full, i + per) * self.block].reshape(-1, self.block) for i in range(0, full, per)
        ]
        return [*out, flat[full * self.block :].reshape(1, -1)] if flat.size % self.block else out

    # ---- encode ----------------------------------------------------------------------------
    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        flat = np.asarray(x, dtype=np.float32).reshape(-1)
        out = {suffix: np.empty(shape, DTYPES[dtype]) for suffix, (dtype, shape) in self.layout(flat.shape).items()}
        at = dict.fromkeys(out, 0)
        for rows in self._rows(flat):
            for suffix, part in zip(out, self._encode_rows(rows), strict=True):
                out[suffix][at[suffix] : at[suffix] + part.size] = part.reshape(-1)
                at[suffix] += part.size
        return out

    def _encode_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Codes and offsets (packed per block) and the ``lo, hi`` scales of each block (row)."""
        mags = np.abs(rows)
        if not np.isfinite(mags).all():
            raise ValueError(f"codec {self.spec!r} cannot encode NaN or Inf")
        offsets, values, picked = [], [], []
        start = 0
        for count, size, m in self._segments(rows.shape[1]):
            seg = slice(start, start + count * size)
            chunks = mags[:, seg].reshape(len(rows), count, size)
            if m <= 2 < size:  # top 1 (the default, of 4) or 2: argmax passes beat argpartition 5x
                index = np.argmax(chunks, axis=2)[:, :, None]
                if m == 2:
                    rest = chunks.copy()
                    np.put_along_axis(rest, index, -1, axis=2)
                    other = np.argmax(rest, axis=2)[:, :, None]
                    index = np.concatenate([np.minimum(index, other), np.maximum(index, other)], axis=2)
            elif m < size:
                index = np.argpartition(chunks, size - m, axis=2)[:, :, size - m :]
                index.sort(axis=2)
            else:
                index = np.broadcast_to(np.arange(size), chunks.shape).copy()
            offsets.append(index.reshape(len(rows), -1))
            at = (index + (np.arange(count) * size)[:, None]).reshape(len(rows), -1)
            values.append(np.take_along_axis(rows[:, seg], at, axis=1))
            picked.append(np.take_along_axis(mags[:, seg], at, axis=1))
            start += count * size
        value, mag = np.concatenate(values, axis=1), np.concatenate(picked, axis=1)
        if self.levels == 1:  # sign only: one magnitude, the mean (float64: the mean of equal values is that value)
            lo = hi = mag.mean(axis=1, dtype=np.float64).astype(np.float32)
        else:
            lo, hi = mag.min(axis=1), mag.max(axis=1)
        step = self._step(lo, hi)
        level = np.rint((mag - lo[:, None]) / np.where(step > 0, step, np.float32(1))[:, None])
        np.clip(level, 0, self.levels - 1, out=level)
        codes = level.astype(np.uint8) << 1 | (value < 0)
        return _pack(codes, self.bits), _pack(np.concatenate(offsets, axis=1), self.width), np.stack([lo, hi], axis=1)

    def _step(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The spacing of the magnitude levels of each block, as encoder and decoder both compute it."""
        return (hi - lo) / np.float32(max(1, self.levels - 1))

    # ---- decode ----------------------------------------------------------------------------
    def decode(self, parts: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape)
        kinds = (("", np.uint8), ("index", np.uint8), ("scale", np.float32))
        got = {}
        for (suffix, dtype), size in zip(kinds, self._sizes(n), strict=True):
            part = np.asarray(parts[suffix])
            if part.dtype != dtype or part.size != size:
                raise FormatError(
                    f"codec {self.spec!r}: part {suffix or 'main'!r} is {part.dtype}{list(part.shape)}, "
                    f"expected {size} {np.dtype(dtype)}"
                )
            got[suffix] = np.ascontiguousarray(part).reshape(-1)
        scale = got["scale"].reshape(-1, 2)
        if not np.isfinite(scale).all() or not ((scale[:, 0] >= 0) & (scale[:, 0] <= scale[:, 1])).all():
            raise FormatError(f"codec {self.spec!r}: scales must be finite with 0 <= lo <= hi")
        out = np.zeros(n, np.float32)
        at = dict.fromkeys(got, 0)
        for rows in self._rows(out):
            count, size = rows.shape
            codes_bytes, index_bytes = self._row_sizes(size)
            take = {"": count * codes_bytes, "index": count * index_bytes, "scale": 2 * count}
            piece = {suffix: got[suffix][at[suffix] : at[suffix] + take[suffix]] for suffix in got}
            at = {suffix: at[suffix] + take[suffix] for suffix in got}
            segments = self._segments(size)
            sent = sum(c * m for c, _, m in segments)
            offsets = _unpack(piece["index"].reshape(count, -1), sent, self.width)
            positions, first, start = [], 0, 0
            for chunks, chunk, m in segments:
                index = offsets[:, first : first + chunks * m].reshape(count, chunks, m)
                if (index >= chunk).any() or (m > 1 and (np.diff(index, axis=2) <= 0).any()):
                    raise FormatError(f"codec {self.spec!r}: offsets must be inside their chunk and increasing")
                positions.append(
                    (index.astype(np.intp) + start + np.arange(chunks)[:, None] * chunk).reshape(count, -1)
                )
                first, start = first + chunks * m, start + chunks * chunk
            codes = _unpack(piece[""].reshape(count, -1), sent, self.bits)
            lo, hi = piece["scale"][0::2, None], piece["scale"][1::2, None]
            level = codes >> 1
            with np.errstate(over="ignore"):  # lo + level * step can pass hi by an ulp: clipped
                mags = np.minimum(lo + level.astype(np.float32) * self._step(lo, hi), hi)
            # the top level is hi itself, so decoding what was decoded gives the same bits
            mags = np.where(level == self.levels - 1, hi, mags)
            np.put_along_axis(rows, np.concatenate(positions, axis=1), np.where(codes & 1, -mags, mags), axis=1)
        return out.reshape(shape)


def _bytes(bits: int) -> int:
    return -(-bits // 8)


def _pack(values: np.ndarray, width: int) -> np.ndarray:
    """Pack each row's unsigned ``values`` into ``width`` bits each, least significant first."""
    rows, count = values.shape
    per = 8 // width
    if 8 % width == 0 and count % per == 0:  # whole bytes (2-bit codes, 4- or 8-bit offsets): shifts
        groups = values.astype(np.uint8).reshape(rows, -1, per)
        out = groups[:, :, 0].copy()
        for j in range(1, per):
            out |= groups[:, :, j] << np.uint8(j * width)
        return out
    bits = (values.astype(np.uint16)[..., None] >> np.arange(width, dtype=np.uint16)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(rows, -1), axis=1, bitorder="little")


def _unpack(packed: np.ndarray, count: int, width: int) -> np.ndarray:
    """The inverse of :func:`_pack`: ``count`` values of ``width`` bits from each row."""
    rows, per = len(packed), 8 // width
    if 8 % width == 0 and count % per == 0:
        mask = np.uint8((1 << width) - 1)
        shifts = (np.arange(per) * width).astype(np.uint8)
        return ((packed[:, :, None] >> shifts) & mask).reshape(rows, count).astype(np.uint16)
    bits = np.unpackbits(packed, axis=1, count=count * width, bitorder="little").reshape(rows, count, width)
    return (bits.astype(np.uint16) << np.arange(width, dtype=np.uint16)).sum(axis=2, dtype=np.uint16)


register_codec("topk", TopK)
