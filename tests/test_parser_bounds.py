"""The streaming safetensors parser on hostile bytes: FormatError only, bounded memory, no hang.

``tests/test_wire.py`` fuzzes ``parse_header`` and ``HeaderReader`` with any bytes and any JSON
(only :class:`FormatError` comes out) and the codecs' ``decode`` with hostile parts. This file
adds what a hostile peer or hub could still do with *sizes*: ``StreamReader`` (what the SDK
parses the hub's answers with) on any bytes and any chunking, and the bounds: a header that
declares terabytes is refused before anything is allocated, and the parser never holds much
more than the bytes it was fed.
"""

from __future__ import annotations

import itertools
import json
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncwire import FormatError, HeaderReader, StreamReader, iter_chunks, parse_header
from syncwire.format import MAX_HEADER_BYTES

LIMIT = 1 << 16  # the data bytes a reader accepts in these tests


def frame(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def entry(dtype: str, shape: list[int], start: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def chunked(raw: bytes, cuts: list[int]) -> Iterator[bytes]:
    edges = sorted({0, len(raw), *(c % (len(raw) + 1) for c in cuts)})
    for a, b in itertools.pairwise(edges):
        yield raw[a:b]


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak memory traced (Python objects and numpy buffers) while ``fn`` runs."""
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def feed_all(reader: StreamReader, chunks: Iterator[bytes]) -> None:
    """Feed everything; only FormatError may come out."""
    try:
        for chunk in chunks:
            reader.feed(chunk)
    except FormatError:
        pass


#: Headers shaped like the real thing, sizes anywhere from 0 to absurd.
SIZES = st.integers(0, 6) | st.integers(2**20, 2**44)
HOSTILE = st.dictionaries(
    st.text(min_size=1, max_size=4),
    st.builds(
        lambda dtype, shape, start, extra: entry(dtype, shape, start, start + extra),
        st.sampled_from(["F32", "F16", "BF16", "I8", "U8"]),
        st.lists(SIZES, max_size=3),
        st.integers(0, 64),
        SIZES,
    ),
    max_size=3,
)
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
#: One well-formed tensor of any size: the header parses, only its size can be refused.
CONSISTENT = st.builds(
    lambda name, dtype, shape: {name: entry(dtype, shape, 0, int(np.prod(shape, dtype=object)) * _ITEMSIZE[dtype])},
    st.text(min_size=1, max_size=4),
    st.sampled_from(sorted(_ITEMSIZE)),
    st.lists(SIZES, max_size=3),
)


@settings(deadline=2000, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=8))
def test_stream_reader_any_bytes_only_format_error_and_bounded(raw: bytes, cuts: list[int]) -> None:
    started = time.monotonic()
    peak = peak_bytes(lambda: feed_all(StreamReader(LIMIT), chunked(raw, cuts)))
    assert peak < 4 * len(raw) + LIMIT + (256 << 10)
    assert time.monotonic() - started < 1.0


@settings(deadline=2000, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(header=HOSTILE | CONSISTENT, data=st.binary(max_size=512), cuts=st.lists(st.integers(0, 1024), max_size=6))
def test_stream_reader_hostile_sizes_refused_before_allocating(
    header: dict[str, object], data: bytes, cuts: list[int]
) -> None:
    raw = frame(header, data)
    reader = StreamReader(LIMIT)
    peak = peak_bytes(lambda: feed_all(reader, chunked(raw, cuts)))
    assert peak < 4 * len(raw) + LIMIT + (256 << 10)  # never the declared terabytes
    if reader.done:  # what it accepted is what it declared, within the limit
        assert sum(t.nbytes for t in reader.tensors.values()) <= LIMIT


@pytest.mark.parametrize(
    "shape",
    [[2**38], [2**20, 2**20], [2**13, 2**13, 2**14]],
    ids=["1TiB", "4TiB-2d", "4TiB-3d"],
)
def test_terabytes_declared_are_refused_without_a_limit_too(shape: list[int]) -> None:
    """No limit given: the allocation fails, and that is a FormatError, not a MemoryError."""
    size = int(np.prod(shape, dtype=np.int64)) * 4
    raw = frame({"a": entry("F32", shape, 0, size)})
    reader = StreamReader()
    with pytest.raises(FormatError, match="bytes of data"):
        reader.feed(raw)


def test_over_the_limit_is_refused_from_the_header_alone() -> None:
    raw = frame({"a": entry("F32", [2**30], 0, 2**32)})  # 4 GiB: allocatable, never allocated
    reader = StreamReader(max_bytes=1 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="over the 1048576-byte limit"):
            reader.feed(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_the_limit_admits_exactly_the_declared_size() -> None:
    x = np.arange(256, dtype=np.float32)
    raw = b"".join(iter_chunks([("x", x, None)]))
    exact = StreamReader(max_bytes=x.nbytes)
    exact.feed(raw)
    assert exact.done and np.array_equal(exact.tensors["x"], x)
    with pytest.raises(FormatError, match="over the 1020-byte limit"):
        StreamReader(max_bytes=x.nbytes - 4).feed(raw)


def test_header_length_prefix_is_checked_before_buffering() -> None:
    """A length prefix of 2**64 - 1: refused on its 8 bytes, nothing buffered for it."""
    reader = HeaderReader()
    with pytest.raises(FormatError, match="over the"):
        reader.feed(struct.pack("<Q", 2**64 - 1))
    # at the cap, the reader holds only what arrived (1 MiB), not the 8 MiB announced
    reader = HeaderReader()
    tracemalloc.start()
    try:
        assert not reader.feed(struct.pack("<Q", MAX_HEADER_BYTES))
        for _ in range(16):
            assert not reader.feed(b" " * (1 << 16))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20


@pytest.mark.parametrize("shape", [[0, 2**39, 2**39], [2**31, 2**31, 0], [1, 2**39, 2**23]])
def test_shapes_numpy_cannot_hold_are_a_format_error(shape: list[int]) -> None:
    """0 bytes or not, numpy refuses these shapes (``array is too big``): the parser must first."""
    size = int(np.prod(shape, dtype=object)) * 4
    raw = frame({"a": entry("F32", shape, 0, size)})
    with pytest.raises(FormatError, match="too large for an array"):
        parse_header(raw)
    with pytest.raises(FormatError, match="too large for an array"):
        StreamReader().feed(raw)
