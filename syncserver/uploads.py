"""Receiving a safetensors body: streamed to disk, header checked early, hashed on the way.

No HTTP here: the input is any async iterator of byte chunks. The body is never held in
memory: chunks are batched to a few MiB and written (and hashed) in a worker thread while
the event loop receives the next batch. The header is parsed as soon as its bytes are in,
so a body with the wrong tensors is refused after a few kB, not after 500 MB.

Resumable bodies (updates): the bytes gather in a *partial* file named after the upload
(run, round, peer, digest). When the body stops arriving (link cut, client gone, stalled
past ``idle_seconds``) the partial is kept, so the client's retry sends only the rest, from
``offset`` (the file's size). A resumed body is checked exactly like a whole one: its first
``offset`` bytes are read back from the partial to parse the header and hash the whole body,
so the size limits, the header check and the final digest still cover every byte. A bad
body (refused header, too long, digest mismatch) or a disk error removes the partial.
One request at a time writes a partial: a newer one (the client's retry) supersedes the
older, which may still look connected on a stalled link.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import math
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np
from anyio import to_thread

from syncserver.errors import BadRequest, HubError, InvalidUpdate, OffsetMismatch, PayloadTooLarge, Unavailable
from syncwire import FormatError, HeaderReader, TensorInfo, read_tensors
from syncwire.format import MAX_HEADER_BYTES

__all__ = ["BodyInterrupted", "Received", "check_finite", "disk_error", "partial_offset", "receive"]

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


class BodyInterrupted(Exception):
    """The body stopped arriving: the client went away, the link stalled for ``idle_seconds``,
    or a newer attempt at the same upload took over. A resumable upload's partial is kept."""


class _Writers:
    """Which request writes each partial file (see the module docstring)."""

    def __init__(self) -> None:
        self._active: dict[Path, tuple[anyio.CancelScope, asyncio.Event]] = {}

    async def settle(self, path: Path) -> None:
        """Stop whoever writes ``path`` and wait until its file is flushed and closed."""
        while (entry := self._active.get(path)) is not None:
            entry[0].cancel()
            await entry[1].wait()

    @contextlib.asynccontextmanager
    async def claim(self, path: Path, scope: anyio.CancelScope) -> AsyncIterator[None]:
        await self.settle(path)
        done = asyncio.Event()
        self._active[path] = (scope, done)
        try:
            yield
        finally:
            if self._active.get(path, (None,))[0] is scope:
                del self._active[path]
            done.set()


# keyed by absolute path, so hubs sharing a process (tests) cannot collide
_writers = _Writers()


async def partial_offset(path: Path) -> int:
    """How many bytes of a resumable upload the hub holds: the offset its retry starts from."""
    await _writers.settle(path)
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class _Sink:
    """File + hash, fed from a worker thread. ``offset`` > 0 appends to a partial file."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.hash = hashlib.sha256()
        path.parent.mkdir(parents=True, exist_ok=True)
        if offset:
            size = path.stat().st_size if path.exists() else 0
            if size < offset:
                raise OffsetMismatch(
                    f"the hub holds {size} bytes of this upload, not {offset}; ask again (HEAD)",
                    upload_offset=size,
                )
            self.file = open(path, "r+b")  # noqa: SIM115 (closed in finish/abort)
            self.file.truncate(offset)  # same digest, same bytes: anything past offset is re-sent
            self.file.seek(offset)
        else:
            self.file = open(path, "wb")  # noqa: SIM115 (closed in finish/abort)

    def write(self, data: bytes) -> None:
        self.hash.update(data)
        self.file.write(data)

    def finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def replay(self, nbytes: int) -> bytes:
        """Hash the first ``nbytes`` already in the file; return its first few MiB (the header)."""
        head = b""
        with open(self.file.name, "rb") as f:
            while nbytes:
                data = f.read(min(_BATCH, nbytes))
                if not data:
                    raise BadRequest("the partial upload is shorter than its offset")
                self.hash.update(data)
                if len(head) < 8 + MAX_HEADER_BYTES:
                    head += data
                nbytes -= len(data)
        return head


async def receive(
    chunks: AsyncIterator[bytes],
    dest: Path,
    *,
    max_bytes: int,
    content_length: int | None,
    check_header: Callable[[dict[str, TensorInfo]], None],
    offset: int = 0,
    resumable: bool = False,
    complete_path: Path | None = None,
    idle_seconds: float | None = None,
) -> Received:
    """Stream a safetensors body into ``dest`` (fsynced), checking its header on the way.

    Raises a :class:`~syncserver.errors.HubError` on any problem, after removing ``dest``.
    ``check_header`` raises :class:`FormatError` when the tensors are not the expected ones.
    With ``resumable``, ``dest`` is the upload's partial file: ``offset`` of its bytes are
    the body's start (``chunks`` bring the rest, ``content_length`` counts only those), and
    it is kept when the body stops arriving (:class:`BodyInterrupted`); once whole it moves
    to ``complete_path``, out of reach of the housekeeping that drops a closed round's partials
    (:class:`BodyInterrupted` too if that already took it: the round closed meanwhile). ``idle_seconds``
    bounds the wait for the next chunk: a peer whose link died silently must not hold an
    upload slot open forever.
    """
    if content_length is not None and offset + content_length > max_bytes:
        raise PayloadTooLarge(f"body of {offset + content_length} bytes is over the {max_bytes}-byte limit")
    idle = math.inf if idle_seconds is None else idle_seconds
    scope = anyio.CancelScope(deadline=anyio.current_time() + idle)
    async with _writers.claim(dest, scope) if resumable else contextlib.nullcontext():
        with scope:
            received = await _receive(
                chunks, dest, scope, idle, max_bytes, content_length, check_header, offset, resumable
            )
            if complete_path is not None:
                try:
                    os.replace(dest, complete_path)
                except FileNotFoundError:
                    raise BodyInterrupted("the partial upload was removed as it arrived: its round closed") from None
                received.path = complete_path
            return received
        raise BodyInterrupted(f"no body bytes for {idle}s, or a newer attempt at this upload took over")


async def _receive(
    chunks: AsyncIterator[bytes],
    dest: Path,
    scope: anyio.CancelScope,
    idle: float,
    max_bytes: int,
    content_length: int | None,
    check_header: Callable[[dict[str, TensorInfo]], None],
    offset: int,
    resumable: bool,
) -> Received:
    started = time.monotonic()
    header = HeaderReader()
    expected: int | None = None
    received = 0
    batch = bytearray()
    pending: asyncio.Future[None] | None = None
    interrupted = False  # the body stopped arriving (as opposed to: it was refused)
    try:
        sink = _Sink(dest, offset)
    except OSError as exc:
        raise disk_error(exc) from exc

    def take(chunk: bytes) -> None:
        """Count a chunk against the limits and parse the header out of the first ones."""
        nonlocal received, expected
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
                if received > expected:
                    raise BadRequest(f"body is longer than the {expected} bytes its header describes")
                if content_length is not None and offset + content_length != expected:
                    raise BadRequest(
                        f"Content-Length is {content_length} after offset {offset} but the header "
                        f"describes {expected} bytes"
                    )

    try:
        if offset:  # a resumed body: its start is on disk already
            head = await to_thread.run_sync(sink.replay, offset)
            received = offset - len(head)
            take(head)
            scope.deadline = anyio.current_time() + idle  # re-reading a big partial is not idling
        body = chunks.__aiter__()
        while True:
            try:
                chunk = await body.__anext__()
            except StopAsyncIteration:
                break
            except BaseException:
                interrupted = True
                raise
            scope.deadline = anyio.current_time() + idle
            take(chunk)
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
        interrupted = interrupted or scope.cancel_called
        with anyio.CancelScope(shield=True):  # tidy up even when cancelled
            if pending is not None:
                await asyncio.gather(pending, return_exceptions=True)
            keep = resumable and interrupted and not isinstance(exc, HubError | OSError)
            if keep:  # what did arrive stays for the retry
                with contextlib.suppress(OSError):
                    await to_thread.run_sync(sink.file.write, bytes(batch))
            sink.file.close()
            if not keep:
                dest.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise disk_error(exc) from exc
        if interrupted and not isinstance(exc, asyncio.CancelledError):
            raise BodyInterrupted(f"the body stopped after {received} bytes ({exc!r})") from exc
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
