"""An update body's checks, fed its bytes in order from anywhere: the one checker of the hub.

The upload path (:mod:`~syncserver.storage.uploads`) and the check of a body in the bucket
(:func:`syncserver.reduce.check.check_update`) both feed :class:`BodyCheck`, so a body gets the
same answer whichever way it came: its size (over the limit or its ``Content-Length``: 413;
longer or shorter than its header or ``Content-Length``: 400), its header (safetensors, and the
run's layout: 422 at the chunk that completes it, not after 500 MB), its values (no NaN or Inf:
422, scanned as they go by) and its sha-256. No I/O, no threads; each byte is touched twice (hash,
scan) while hot, and nothing is copied but the header.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from syncserver.errors import BadRequest, InvalidUpdate, PayloadTooLarge
from syncwire import FormatError, HeaderReader, TensorInfo

__all__ = ["BodyCheck", "FiniteScan", "HeaderRule"]

#: the caller's rule for a body's tensors: raises :class:`FormatError` for unexpected ones
HeaderRule = Callable[[dict[str, TensorInfo]], None]

_FINITE_DTYPES: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class FiniteScan:
    """Refuse NaN and Inf in the float parts of a body fed in order, from the header's layout:
    each chunk is cut at the tensors' boundaries, a value split between two chunks carried over."""

    def __init__(self, infos: dict[str, TensorInfo], data_start: int) -> None:
        self._spans = [
            (data_start + i.start, data_start + i.end, i.dtype, i.name)
            for i in sorted(infos.values(), key=lambda i: i.start)
            if i.dtype in _FINITE_DTYPES and i.end > i.start
        ]
        self._index = 0
        self._carry = b""

    def feed(self, position: int, chunk: bytes | memoryview) -> None:
        """Check the chunk that starts at byte ``position`` of the body."""
        end = position + len(chunk)
        view = memoryview(chunk)
        while self._index < len(self._spans):
            start, stop, dtype, name = self._spans[self._index]
            if start >= end:
                return
            lo, hi = max(start, position), min(stop, end)
            if hi > lo:
                data = view[lo - position : hi - position]
                size = _FINITE_DTYPES[dtype].itemsize
                if self._carry:  # complete the value split at the last chunk's end, alone:
                    # prepending the carry to the chunk copied every chunk (a second of a
                    # hub's CPU per GB, since bodies arrive in pieces of any length)
                    head, data = data[: size - len(self._carry)], data[size - len(self._carry) :]
                    self._carry += bytes(head)
                    if len(self._carry) == size:
                        self._check(name, dtype, self._carry)
                        self._carry = b""
                whole = len(data) - len(data) % size
                self._check(name, dtype, data[:whole])
                self._carry += bytes(data[whole:])
            if stop > end:
                return
            self._index += 1
            self._carry = b""

    @staticmethod
    def _check(name: str, dtype: str, data: bytes | memoryview) -> None:
        values = np.frombuffer(data, _FINITE_DTYPES[dtype])
        # bfloat16 travels as its bits: exponent all ones is Inf or NaN
        bad = ((values & 0x7F80) == 0x7F80).any() if dtype == "BF16" else not np.isfinite(values).all()
        if bad:
            raise InvalidUpdate(f"tensor {name!r} holds NaN or Inf values")


class BodyCheck:
    """One body's checks, fed in order; raises the hub's error at the first fault.

    ``content_length``: the bytes announced after ``offset`` (a resumed body's start), checked
    against ``max_bytes`` at once and against the header once it is in. ``received``: the bytes
    fed so far."""

    def __init__(
        self, check_header: HeaderRule, max_bytes: int, *, content_length: int | None = None, offset: int = 0
    ) -> None:
        if content_length is not None and offset + content_length > max_bytes:
            raise PayloadTooLarge(f"body of {offset + content_length} bytes is over the {max_bytes}-byte limit")
        self.check_header, self.max_bytes = check_header, max_bytes
        self.content_length, self.offset = content_length, offset
        self.hash = hashlib.sha256()
        self.header = HeaderReader()
        self.scan: FiniteScan | None = None  # once the header is in
        self.expected: int | None = None  # the body's size by its header, once it is in
        self.received = 0

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """The body's tensors, by its header (once it is in)."""
        assert self.header.result is not None
        return self.header.result[0]

    def feed(self, chunk: bytes | memoryview) -> None:
        position = self.received
        self.received += len(chunk)
        self._sized()
        if self.expected is None:
            try:
                if self.header.feed(chunk):
                    assert self.header.result is not None
                    infos, _, data_bytes = self.header.result
                    self.check_header(infos)
                    self.scan = FiniteScan(infos, self.header.header_bytes)
                    self.expected = self.header.header_bytes + data_bytes
            except FormatError as exc:
                raise InvalidUpdate(str(exc)) from None
            if self.expected is not None:
                self._sized()
                if self.content_length is not None and self.offset + self.content_length != self.expected:
                    raise BadRequest(
                        f"Content-Length is {self.content_length} after offset {self.offset} but the header "
                        f"describes {self.expected} bytes"
                    )
        if self.scan is not None:
            self.scan.feed(position, chunk)
        self.hash.update(chunk)

    def _sized(self) -> None:
        """At most ``max_bytes``, and no longer than the header says (once it is in)."""
        if self.expected is None:
            if self.received > self.max_bytes:
                raise PayloadTooLarge(f"body is over this endpoint's {self.max_bytes}-byte limit")
        elif self.expected > self.max_bytes:
            raise PayloadTooLarge(f"body of {self.expected} bytes is over the {self.max_bytes}-byte limit")
        elif self.received > self.expected:
            raise BadRequest(f"body is longer than the {self.expected} bytes its header describes")

    def finish(self) -> str:
        """Raise unless the body fed is whole; return its sha-256 (hex)."""
        if self.expected is None:
            raise BadRequest(f"body ends after {self.received} bytes, inside the safetensors header")
        if self.received < self.expected:
            raise BadRequest(f"body is truncated: {self.received} of {self.expected} bytes arrived")
        return self.hash.hexdigest()
