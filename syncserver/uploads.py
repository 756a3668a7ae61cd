"""Receiving a safetensors body: streamed to disk, header checked early, hashed on the way.

No HTTP here: the input is any async iterator of byte chunks. The body is never held in
memory: chunks are batched to a few MiB and written (and hashed) in a worker thread while
the event loop receives the next batch. The header is parsed as soon as its bytes are in,
so a body with the wrong tensors is refused after a few kB, not after 500 MB.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from anyio import to_thread

from syncserver.errors import BadRequest, InvalidUpdate, PayloadTooLarge, Unavailable
from syncwire import FormatError, HeaderReader, TensorInfo, read_tensors

__all__ = ["Received", "check_finite", "disk_error", "receive"]

_BATCH = 4 << 20


@dataclass
class Received:
    path: Path
    nbytes: int
    digest: str  # hex sha-256 of the whole body
    infos: dict[str, TensorInfo]
    seconds: float


def disk_error(exc: OSError | sqlite3.Error) -> Unavailable:
    """The one translation of a storage failure: 503, and the caller has changed nothing."""
    if isinstance(exc, sqlite3.Error):
        if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return Unavailable("the hub's disk is full; nothing was stored", retry_after=30)
        return Unavailable(f"the hub cannot write its database ({exc}); nothing was stored", retry_after=30)
    if exc.errno == errno.ENOSPC:
        return Unavailable("the hub's disk is full; nothing was stored", retry_after=30)
    return Unavailable(f"the hub cannot write its data dir ({exc.strerror}); nothing was stored", retry_after=30)


class _Sink:
    """File + hash, fed from a worker thread."""

    def __init__(self, path: Path) -> None:
        self.hash = hashlib.sha256()
        self.file = open(path, "wb")  # noqa: SIM115 (closed in finish/abort)

    def write(self, data: bytes) -> None:
        self.hash.update(data)
        self.file.write(data)

    def finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


async def receive(
    chunks: AsyncIterator[bytes],
    dest: Path,
    *,
    max_bytes: int,
    content_length: int | None,
    check_header: Callable[[dict[str, TensorInfo]], None],
) -> Received:
    """Stream a safetensors body into ``dest`` (fsynced), checking its header on the way.

    Raises a :class:`~syncserver.errors.HubError` on any problem, after removing ``dest``.
    ``check_header`` raises :class:`FormatError` when the tensors are not the expected ones.
    """
    if content_length is not None and content_length > max_bytes:
        raise PayloadTooLarge(f"body of {content_length} bytes is over the {max_bytes}-byte limit")
    started = time.monotonic()
    header = HeaderReader()
    expected: int | None = None
    received = 0
    batch = bytearray()
    pending: asyncio.Future[None] | None = None
    try:
        sink = _Sink(dest)
    except OSError as exc:
        raise disk_error(exc) from exc
    try:
        async for chunk in chunks:
            received += len(chunk)
            limit = expected if expected is not None else max_bytes
            if received > limit:
                if expected is not None:
                    raise BadRequest(f"body is longer than the {expected} bytes its header describes")
                raise PayloadTooLarge(f"body is over this endpoint's {max_bytes}-byte limit")
            if header.result is None:
                try:
                    if header.feed(chunk):
                        assert header.result is not None
                        infos, _, data_bytes = header.result
                        check_header(infos)
                        expected = header.header_bytes + data_bytes
                except FormatError as exc:
                    raise InvalidUpdate(str(exc)) from None
                if expected is not None:
                    if expected > max_bytes:
                        raise PayloadTooLarge(f"body of {expected} bytes is over the {max_bytes}-byte limit")
                    if content_length is not None and content_length != expected:
                        raise BadRequest(
                            f"Content-Length is {content_length} but the header describes {expected} bytes"
                        )
            batch += chunk
            if len(batch) >= _BATCH:
                if pending is not None:
                    await pending
                data, batch = bytes(batch), bytearray()
                pending = asyncio.ensure_future(to_thread.run_sync(sink.write, data))
        if pending is not None:
            await pending
            pending = None
        if header.result is None:
            raise BadRequest(f"body ends after {received} bytes, inside the safetensors header")
        assert expected is not None
        if received < expected:
            raise BadRequest(f"body is truncated: {received} of {expected} bytes arrived")
        await to_thread.run_sync(sink.write, bytes(batch))
        await to_thread.run_sync(sink.finish)
    except BaseException as exc:
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        sink.file.close()
        dest.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise disk_error(exc) from exc
        raise
    return Received(dest, received, sink.hash.hexdigest(), header.result[0], time.monotonic() - started)


def check_finite(path: Path) -> None:
    """Raise :class:`InvalidUpdate` if any floating-point value in the file is NaN or Inf.

    Works on the wire tensors, whatever the codec: float parts with ``isfinite``, bfloat16
    bits by their exponent. Integer parts (quantized values) are always finite.
    """
    arrays, _ = read_tensors(str(path))
    for name, array in arrays.items():
        if array.dtype == np.uint16 and array.size:  # bfloat16 bits: exponent all ones = Inf/NaN
            bad = bool(((array & 0x7F80) == 0x7F80).any())
        elif array.dtype.kind == "f":
            bad = not bool(np.isfinite(array).all())
        else:
            continue
        if bad:
            raise InvalidUpdate(f"tensor {name!r} holds NaN or Inf values")
