"""A safetensors object in the bucket, read a slice at a time with ranged GETs.

:class:`syncwire.format.TensorFile` reads a file on the hub's disk with ``pread``; this reads an
object of the store the same way, with the same interface (``infos``, ``metadata``,
``read(name, start, stop)``), so the merge engine, a reducer or a check works on either without
knowing which. A reducer reads only the values of its slices of each update: the bytes it moves
are its share of the round, not whole models.
"""

from __future__ import annotations

import math
import struct
import threading

import numpy as np

from syncserver.storage.s3 import ObjectStore
from syncwire import FormatError
from syncwire.format import MAX_HEADER_BYTES, TensorFile, TensorInfo, parse_header

__all__ = ["ObjectTensorFile", "TensorReader"]

_FIRST_READ = 64 << 10  # one GET takes the header of any model with up to ~500 tensors


class ObjectTensorFile:
    """One safetensors object: its header read once, at first use, values by ranged GETs.

    ``size`` (the object's size, when the caller's record has it) saves a HEAD request; the
    header must describe exactly the bytes the object holds, as :class:`TensorFile` checks.
    Nothing is read until ``infos``, ``metadata`` or :meth:`read` is first used (then a fault in
    the object raises there): a hub whose reducers merge opens each update of the round only to
    name it in their leases, and so reads no byte of it.
    """

    def __init__(self, objects: ObjectStore, name: str, size: int | None = None) -> None:
        self.objects, self.name, self._size = objects, name, size
        self._opened: tuple[bytes, dict[str, TensorInfo], dict[str, str], int] | None = None
        self._lock = threading.Lock()  # slices are read from several threads at once

    def _header(self) -> tuple[bytes, dict[str, TensorInfo], dict[str, str], int]:
        """(the first GET's bytes, infos, metadata, where the data starts), read once."""
        with self._lock:
            if self._opened is None:
                self._opened = self._read_header()
            return self._opened

    def _read_header(self) -> tuple[bytes, dict[str, TensorInfo], dict[str, str], int]:
        objects, name, size = self.objects, self.name, self._size
        if size is None:
            info = objects.head(name)
            if info is None:
                raise FileNotFoundError(f"{objects.url}{name}: no such object")
            size = info.size
        head = bytes(objects.read(name, 0, min(size, _FIRST_READ)))
        if len(head) < 8:
            raise FormatError(f"{name}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_HEADER_BYTES:
            raise FormatError(f"{name}: header of {n} bytes is over the limit")
        if 8 + n > size:
            raise FormatError(f"{name}: {size} bytes, the header alone claims {8 + n}")
        if len(head) < 8 + n:
            head += bytes(objects.read(name, len(head), 8 + n))
        # what the first GET brought stays: a small object (a tiny model's update) is then read
        # by one request instead of one per slice, whose headers outweighed its bytes
        infos, metadata, data = parse_header(head[: 8 + n])
        if size - (8 + n) != data:
            raise FormatError(f"{name}: {size - (8 + n)} data bytes, the header describes {data}")
        return head, infos, metadata, 8 + n

    @property
    def infos(self) -> dict[str, TensorInfo]:
        return self._header()[1]

    @property
    def metadata(self) -> dict[str, str]:
        return self._header()[2]

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Values ``[start, stop)`` of tensor ``name``, flattened, in a new writable array."""
        held, infos, _, base = self._header()
        info = infos[name]
        count = math.prod(info.shape)
        stop = count if stop is None else stop
        if not 0 <= start <= stop <= count:
            raise IndexError(f"{name}: values [{start}, {stop}) of {count}")
        dtype = np.dtype(info.numpy_dtype)
        first = base + info.start + start * dtype.itemsize
        end = first + (stop - start) * dtype.itemsize
        if end <= len(held):
            return np.frombuffer(bytearray(held[first:end]), dtype)
        raw = self.objects.read(self.name, first, end)
        if len(raw) != (stop - start) * dtype.itemsize:
            raise FormatError(f"{self.name}: ends inside tensor {name!r}")
        return np.frombuffer(raw, dtype)  # a bytearray: the array is writable

    def close(self) -> None:
        """Nothing to release (each read is its own request); here for :class:`TensorFile`'s interface."""

    def __enter__(self) -> ObjectTensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: A safetensors file read a slice at a time: on the hub's disk, or an object of the store.
TensorReader = TensorFile | ObjectTensorFile
