"""Safetensors framing, written and parsed as a stream.

The hub must never hold a whole body in memory, and a peer must never hand httpx one big
``bytes`` object (httpcore re-copies the unsent tail after every partial write: 30 MB/s instead
of 800 MB/s for a 500 MB body). safetensors' own API works on whole buffers or files, so this
writes the same format as chunks and parses its header incrementally: plain safetensors, which
``safetensors.safe_open``, ``safetensors.numpy.load_file`` and ``safetensors.torch.load`` read.

Layout: 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}``), then the data
section with every tensor at its offsets.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["DTYPES", "FormatError", "HeaderReader", "StreamReader", "TensorFile", "TensorInfo"]
__all__ += ["encode_header", "iter_chunks", "parse_header", "read_tensors"]

#: Safetensors dtype name -> numpy dtype that holds its bytes. BF16 has no numpy dtype, so
#: its raw bits travel as ``uint16`` and :mod:`syncwire.codecs` converts them.
DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
}
_NAMES = {v: k for k, v in DTYPES.items() if k != "BF16"}

#: Upper bound on the JSON header. GPT-2 needs ~15 kB; a 70B model with scales ~300 kB.
MAX_HEADER_BYTES = 8 * 1024 * 1024
CHUNK_BYTES = 1 << 20
_DONE = np.empty(0, np.uint8)  # a StreamReader's place for a tensor handed on


class FormatError(ValueError):
    """The bytes are not well-formed safetensors, or not the tensors that were expected."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the data section (offsets are relative to its start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def _dtype_name(array: np.ndarray) -> str:
    try:
        return _NAMES[array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype]
    except KeyError:
        raise FormatError(f"dtype {array.dtype} cannot travel on the wire") from None


def encode_header(
    entries: Iterable[tuple[str, str, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[TensorInfo]]:
    """The framed header (length prefix + JSON) and the tensors' placement, from ``(name, dtype,
    shape)`` in data order: a writer can emit the header before it computed a single tensor."""
    header: dict[str, object] = {}
    infos: list[TensorInfo] = []
    offset = 0
    for name, dtype, shape in entries:
        if name in header or name == "__metadata__":
            raise FormatError(f"duplicate tensor name {name!r}")
        if dtype not in DTYPES:
            raise FormatError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        end = offset + math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        infos.append(TensorInfo(name, dtype, tuple(shape), offset, end))
        offset = end
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw, infos


def iter_chunks(
    tensors: Iterable[tuple[str, np.ndarray, str | None]],
    metadata: Mapping[str, str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    ready: Callable[[int], None] | None = None,
) -> Iterator[memoryview | bytes]:
    """Yield a safetensors file as chunks of at most ``chunk_bytes``, copying no tensor.
    ``ready(i)`` is called before the ``i``-th tensor's bytes are read: arrays still being filled
    (an update encoded while it uploads) are waited for there, the header going first."""
    items = [(n, np.asarray(a, order="C"), d or _dtype_name(a)) for n, a, d in tensors]
    head, _ = encode_header(((n, d, a.shape) for n, a, d in items), metadata)
    yield head
    for index, (_, array, _) in enumerate(items):
        if ready is not None:
            ready(index)
        view = array.reshape(-1).view(np.uint8).data
        for i in range(0, len(view), chunk_bytes):
            yield view[i : i + chunk_bytes]


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise FormatError(f"duplicate key {key!r} in header")
        seen[key] = value
    return seen


def parse_header(raw: bytes) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and check a complete framed header: ``(tensors by name, metadata, data section size)``.
    Checks all that can be without the data: JSON shape, known dtypes, sizes that match shapes,
    offsets that tile the data section with no gap or overlap."""
    if len(raw) < 8:
        raise FormatError("body shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"header of {n} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    if len(raw) < 8 + n:
        raise FormatError("body ends inside the header")
    try:
        obj = json.loads(raw[8 : 8 + n], object_pairs_hook=_reject_duplicates)
    except FormatError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(f"header is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise FormatError("header is not a JSON object")
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError("__metadata__ must map strings to strings")
    infos: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"tensor {name!r}: entry must have dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(f"tensor {name!r}: unsupported dtype {str(dtype)[:40]!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
        ):
            raise FormatError(f"tensor {name!r}: shape must be a list of non-negative integers")
        if math.prod(max(d, 1) for d in shape) * DTYPES[dtype].itemsize >= 2**62:
            # numpy refuses such a shape even with a 0 in it ("array is too big"): a ValueError
            # in whoever builds the array (read_tensors, StreamReader), not a FormatError here
            raise FormatError(f"tensor {name!r}: shape {shape} is too large for an array")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        ):
            raise FormatError(f"tensor {name!r}: data_offsets must be two non-negative integers")
        start, end = offsets
        if end - start != math.prod(shape) * DTYPES[dtype].itemsize:
            raise FormatError(f"tensor {name!r}: {end - start} bytes do not hold shape {shape} of {dtype}")
        infos[name] = TensorInfo(name, dtype, tuple(shape), start, end)
    position = 0
    for info in sorted(infos.values(), key=lambda i: (i.start, i.end)):
        if info.start != position:
            raise FormatError(f"tensor {info.name!r}: data does not start where the previous one ends")
        position = info.end
    return infos, metadata, position


class HeaderReader:
    """Feed a body's first bytes until the header is complete, without buffering the data."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need: int | None = None
        self.result: tuple[dict[str, TensorInfo], dict[str, str], int] | None = None
        self.header_bytes = 0

    def feed(self, chunk: bytes | memoryview) -> bool:
        """Take the next bytes of the body; return True once the header has been parsed."""
        if self.result is not None:
            return True
        self._buf += chunk
        if self._need is None and len(self._buf) >= 8:
            (n,) = struct.unpack("<Q", self._buf[:8])
            if n > MAX_HEADER_BYTES:
                raise FormatError(f"header of {n} bytes is over the {MAX_HEADER_BYTES}-byte limit")
            self._need = 8 + n
        if self._need is not None and len(self._buf) >= self._need:
            self.header_bytes = self._need
            self.result = parse_header(bytes(self._buf[: self._need]))
            self._buf = bytearray()
            return True
        return False


def read_tensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Memory-map a safetensors file: arrays are read-only views, nothing is copied."""
    with TensorFile(path) as file:
        infos, metadata, size = file.infos, file.metadata, file.size
    if size == 0:
        return {name: np.zeros(i.shape, i.numpy_dtype) for name, i in infos.items()}, metadata
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=file.start, shape=(size,))
    arrays = {name: data[i.start : i.end].view(i.numpy_dtype).reshape(i.shape) for name, i in infos.items()}
    return arrays, metadata


class TensorFile:
    """A safetensors file read a slice at a time, with ``pread`` into fresh arrays: a reader holds
    a slice of a model, not a model (:func:`read_tensors`' map copies nothing, but every page it
    touches counts in the RSS until the map goes, and folding a 500 MB update touches all of it).
    ``start``: where the data section begins; ``size``: its bytes, as the header describes them.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            prefix = os.pread(self._fd, 8, 0)
            if len(prefix) < 8:
                raise FormatError(f"{self.path}: shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise FormatError(f"{self.path}: header of {n} bytes is over the limit")
            self.infos, self.metadata, self.size = parse_header(prefix + os.pread(self._fd, n, 8))
            self.start = 8 + n
            actual = os.fstat(self._fd).st_size - self.start
            if actual != self.size:
                raise FormatError(f"{self.path}: {actual} data bytes, the header describes {self.size}")
        except BaseException:
            os.close(self._fd)
            raise

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Values ``[start, stop)`` of tensor ``name``, flattened, in a new writable array."""
        info = self.infos[name]
        count = math.prod(info.shape)
        stop = count if stop is None else stop
        if not 0 <= start <= stop <= count:
            raise IndexError(f"{name}: values [{start}, {stop}) of {count}")
        out = np.empty(stop - start, info.numpy_dtype)
        view = out.data.cast("B")
        position = self.start + info.start + start * out.itemsize
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], position + done)
            if n == 0:
                raise FormatError(f"{self.path}: ends inside tensor {name!r}")
            done += n
        return out

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamReader:
    """Parse a safetensors body arriving in chunks straight into fresh numpy arrays. ``received``
    counts the bytes taken (a resumed download keeps feeding it). A header that declares more than
    ``max_bytes`` of data (or than can be allocated) is a :class:`FormatError` before any allocation.
    ``on_tensor(name, array, metadata)`` takes each tensor once its last byte is in; then the
    reader keeps none."""

    def __init__(
        self,
        max_bytes: int | None = None,
        on_tensor: Callable[[str, np.ndarray, Mapping[str, str]], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.on_tensor = on_tensor
        self._header = HeaderReader()
        self._buffers: list[tuple[TensorInfo, np.ndarray]] = []
        self._data = bytearray()  # header bytes seen before the header is complete
        self._index = 0  # tensor being filled
        self._filled = 0  # bytes of it filled
        self.received = 0
        self.tensors: dict[str, np.ndarray] = {}
        self.metadata: dict[str, str] = {}

    @property
    def done(self) -> bool:
        return self._header.result is not None and self._index == len(self._buffers)

    def feed(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk).cast("B")
        self.received += len(view)
        if self._header.result is None:
            self._data += view
            if not self._header.feed(view):
                return
            result = self._header.result
            assert result is not None
            infos, self.metadata, size = result
            if self.max_bytes is not None and size > self.max_bytes:
                raise FormatError(f"header declares {size} bytes of data, over the {self.max_bytes}-byte limit")
            ordered = sorted(infos.values(), key=lambda i: i.start)
            try:
                self._buffers = [(i, np.empty(i.end - i.start, np.uint8)) for i in ordered]
            except MemoryError:
                raise FormatError(f"header declares {size} bytes of data: more than can be allocated") from None
            view = memoryview(bytes(self._data[self._header.header_bytes :]))
            self._data = bytearray()
            self._advance()
        while len(view):
            if self._index == len(self._buffers):
                raise FormatError("body is longer than its header describes")
            buf = self._buffers[self._index][1]
            take = min(len(view), len(buf) - self._filled)
            buf[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            self._advance()

    def _advance(self) -> None:
        while self._index < len(self._buffers):
            info, buf = self._buffers[self._index]
            if self._filled < len(buf):
                return
            array = buf.view(info.numpy_dtype).reshape(info.shape)
            self._index += 1
            self._filled = 0
            if self.on_tensor is None:
                self.tensors[info.name] = array
            else:
                self._buffers[self._index - 1] = (info, _DONE)  # let it go once taken
                self.on_tensor(info.name, array, self.metadata)
