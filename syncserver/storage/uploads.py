"""Receiving a safetensors body: streamed to disk, header checked early, hashed on the way.

No HTTP here: the input is any async iterator of byte chunks. The body is never held in
memory: chunks are batched to a few MiB and written (and hashed) in a worker thread while
the event loop receives the next batch. The header is parsed as soon as its bytes are in,
so a body with the wrong tensors is refused after a few kB, not after 500 MB.

In the worker thread each byte is touched once, while it is still hot: hashed, scanned for
NaN/Inf (float parts, by the layout the header gave) and written; and the kernel is told
to start writing it back to disk at once (:mod:`syncserver.storage.writeback`), so the fsync that
acknowledges an update waits for the last few MiB, not for 500 MB. The ``bytes`` chunks the
server hands us go to the thread as they are: no copy in Python.

Resumable bodies (updates): the bytes gather in a *partial* file named after the upload
(run, round, peer, digest). When the body stops arriving (link cut, client gone, stalled
past ``idle_seconds``) the partial is kept, so the client's retry sends only the rest, from
``offset`` (the file's size). A resumed body is checked exactly like a whole one: its first
``offset`` bytes are read back from the partial to parse the header and hash the whole body,
so the size limits, the header check and the final digest still cover every byte. A bad
body (refused header, too long, digest mismatch) or a disk error removes the partial.
One request at a time writes a partial: a newer one (the client's retry, or its HEAD)
supersedes the older, which may still look connected on a stalled link. The older one is
cancelled, and lets go of the partial only once the write its worker thread has in flight is
done and the file is closed: the newer one starts from what is really on disk, and the older
one is answered ``409 superseded`` (:class:`BodyInterrupted` with ``superseded``).

Held bodies (``complete=False``, ``Upload-Complete: ?0``): a peer that encodes its update
while it uploads knows the digest only after the last byte. Its body is received and checked
as any other, then kept as a whole partial instead of being finished; the request that brings
the digest resumes it at its end with an empty body. The hash state of a held body is kept in
memory (:data:`_kept`), so that completing it does not read 500 MB back to hash them again;
without it (more held bodies than :data:`_KEPT_MAX`) the bytes are read back as for any resume.
A hub that restarts drops every partial, held ones too: the completing request then gets
``409 upload_offset`` and the body is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
import numpy as np
from anyio import to_thread

from syncserver.errors import BadRequest, HubError, InvalidUpdate, OffsetMismatch, PayloadTooLarge
from syncserver.storage.store import Missing, Staged, Upload
from syncwire import FormatError, HeaderReader, TensorInfo
from syncwire.format import MAX_HEADER_BYTES

__all__ = ["BodyInterrupted", "FiniteScan", "Held", "Received", "check_length", "partial_offset", "receive"]

_BATCH = 8 << 20


_FINITE_DTYPES: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class FiniteScan:
    """Refuse NaN and Inf in the float parts of a body fed in order, as its bytes arrive.

    It works from the header's layout, so no second pass over the file is needed: each chunk
    is cut at the tensors' boundaries, and a value split between two chunks is carried over.
    """

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


def check_length(received: int, expected: int | None, max_bytes: int) -> None:
    """The size rules of a body whose first ``received`` bytes have come: at most ``max_bytes``,
    and no longer than its header says (``expected``, once the header is in)."""
    if expected is None:
        if received > max_bytes:
            raise PayloadTooLarge(f"body is over this endpoint's {max_bytes}-byte limit")
        return
    if expected > max_bytes:
        raise PayloadTooLarge(f"body of {expected} bytes is over the {max_bytes}-byte limit")
    if received > expected:
        raise BadRequest(f"body is longer than the {expected} bytes its header describes")


@dataclass
class Received:
    staged: Staged  # the whole body, fsynced, waiting to be published or discarded
    nbytes: int
    digest: str  # hex sha-256 of the whole body
    infos: dict[str, TensorInfo]
    seconds: float


@dataclass
class Held:
    """A whole body kept as its partial, waiting for the request that brings its digest."""

    nbytes: int


@dataclass
class _Kept:
    """Where the receipt of a held body stopped: the request that completes it goes on from here."""

    position: int
    hash: hashlib._Hash
    header: HeaderReader
    scan: FiniteScan | None


_KEPT_MAX = 64  # held bodies whose hash state is kept (O(tensors) each); past that the oldest is read back
_kept: dict[str, _Kept] = {}  # by upload ident; taken by whoever writes that upload next


def _keep(ident: str, kept: _Kept) -> None:
    _kept[ident] = kept
    while len(_kept) > _KEPT_MAX:
        del _kept[next(iter(_kept))]


class BodyInterrupted(Exception):
    """The body stopped arriving: the client went away, the link stalled for ``idle_seconds``,
    or (``superseded``) a newer attempt at the same upload took over. A resumable upload's
    partial is kept."""

    def __init__(self, reason: str, *, superseded: bool = False) -> None:
        super().__init__(reason)
        self.superseded = superseded


@dataclass
class _Writer:
    """The request that writes a partial upload now."""

    scope: anyio.CancelScope  # cancelling it stops the request's receive
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set once its file is closed
    superseded: bool = False  # a newer attempt stopped it


class _Writers:
    """Which request writes each partial upload (see the module docstring)."""

    def __init__(self) -> None:
        self._active: dict[str, _Writer] = {}

    async def settle(self, ident: str) -> None:
        """Stop whoever writes ``ident`` and wait until its writes are done and its file closed."""
        while (writer := self._active.get(ident)) is not None:
            writer.superseded = True
            writer.scope.cancel()
            await writer.done.wait()

    @contextlib.asynccontextmanager
    async def claim(self, ident: str, scope: anyio.CancelScope) -> AsyncIterator[_Writer]:
        await self.settle(ident)
        writer = self._active[ident] = _Writer(scope)
        try:
            yield writer
        finally:
            if self._active.get(ident) is writer:
                del self._active[ident]
            writer.done.set()


# keyed by the upload's absolute path, so hubs sharing a process (tests) cannot collide
_writers = _Writers()


async def partial_offset(upload: Upload) -> int:
    """How many bytes of a resumable upload the hub holds: the offset its retry starts from."""
    await _writers.settle(upload.ident)
    return upload.held()


class _Sink:
    """Upload + hash + NaN scan, fed from a worker thread. ``offset`` > 0 appends to a partial;
    ``size``, the bytes announced, picks the file a new upload writes over
    (:class:`~syncserver.storage.store.Spares`)."""

    def __init__(self, upload: Upload, offset: int = 0, size: int | None = None) -> None:
        self.hash = hashlib.sha256()
        self.scan: FiniteScan | None = None  # set once the header is known
        if offset:
            held = upload.held()
            if held < offset:
                raise OffsetMismatch(
                    f"the hub holds {held} bytes of this upload, not {offset}; ask again (HEAD)",
                    upload_offset=held,
                )
        upload.open(offset, size)
        self.upload = upload
        self.position = offset  # body offset of the next byte
        self._flushed = offset  # writeback asked for up to here

    def write(self, chunks: list[bytes]) -> None:
        """Hash, scan and write the body's next ``chunks`` (a few MiB of ~64 KiB pieces).

        They are joined first: one copy, then one pass each for the hash, the scan and the
        write, instead of Python's per-piece overhead times a hundred.
        """
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.hash.update(data)
        if self.scan is not None:
            self.scan.feed(self.position, data)
        self.upload.append([data])
        self.position += len(data)
        if self.position - self._flushed >= _BATCH:
            self.upload.writeback(self._flushed, self.position - self._flushed)
            self._flushed = self.position

    def rescan(self, nbytes: int) -> None:
        """Scan the first ``nbytes`` already held for NaN/Inf (a resumed body's start)."""
        assert self.scan is not None
        position = 0
        while position < nbytes and (data := self.upload.read(position, min(_BATCH, nbytes - position))):
            self.scan.feed(position, data)
            position += len(data)

    def replay(self, nbytes: int) -> bytes:
        """Hash the first ``nbytes`` already held; return its first few MiB (the header)."""
        head = b""
        position = 0
        while position < nbytes:
            data = self.upload.read(position, min(_BATCH, nbytes - position))
            if not data:
                raise BadRequest("the partial upload is shorter than its offset")
            self.hash.update(data)
            if len(head) < 8 + MAX_HEADER_BYTES:
                head += data
            position += len(data)
        return head


async def receive(
    chunks: AsyncIterator[bytes],
    upload: Upload,
    *,
    max_bytes: int,
    content_length: int | None,
    check_header: Callable[[dict[str, TensorInfo]], None],
    offset: int = 0,
    idle_seconds: float | None = None,
    complete: bool = True,
) -> Received | Held:
    """Stream a safetensors body into ``upload`` (fsynced), checking its header on the way.

    Raises a :class:`~syncserver.errors.HubError` on any problem, after discarding the upload.
    ``check_header`` raises :class:`FormatError` when the tensors are not the expected ones.
    A resumable upload (:meth:`Store.resumable_upload`) starts with ``offset`` of its bytes
    held (``chunks`` bring the rest, ``content_length`` counts only those), and is kept when
    the body stops arriving (:class:`BodyInterrupted`); once whole it leaves the reach of the
    housekeeping that drops a closed round's partials (:class:`BodyInterrupted` too if that
    already took it: the round closed meanwhile). ``idle_seconds`` bounds the wait for the
    next chunk: a peer whose link died silently must not hold an upload slot open forever.
    ``complete=False`` (resumable uploads only): a whole, checked body is kept as its partial
    and :class:`Held` returned; a later call from its end completes it.
    """
    assert complete or upload.resumable
    if content_length is not None and offset + content_length > max_bytes:
        raise PayloadTooLarge(f"body of {offset + content_length} bytes is over the {max_bytes}-byte limit")
    idle = math.inf if idle_seconds is None else idle_seconds
    scope = anyio.CancelScope(deadline=anyio.current_time() + idle)
    async with _writers.claim(upload.ident, scope) if upload.resumable else contextlib.nullcontext() as writer:
        with scope:
            return await _receive(
                chunks, upload, scope, idle, max_bytes, content_length, check_header, offset, complete
            )
        if writer is not None and writer.superseded:
            raise BodyInterrupted(
                "a newer attempt at this upload (a retry, or a HEAD) took over; what this one sent is kept for it",
                superseded=True,
            )
        raise BodyInterrupted(f"no body bytes for {idle}s")


async def _receive(
    chunks: AsyncIterator[bytes],
    upload: Upload,
    scope: anyio.CancelScope,
    idle: float,
    max_bytes: int,
    content_length: int | None,
    check_header: Callable[[dict[str, TensorInfo]], None],
    offset: int,
    complete: bool,
) -> Received | Held:
    started = time.monotonic()
    header = HeaderReader()
    expected: int | None = None
    received = 0
    batch: list[bytes] = []  # chunks not yet handed to the writer thread
    batched = 0  # their bytes
    pending: asyncio.Future[None] | None = None  # the write in the worker thread
    interrupted = False  # the body stopped arriving (as opposed to: it was refused)
    kept = _kept.pop(upload.ident, None)  # whoever writes the upload takes it: it is stale after
    sink = _Sink(upload, offset, content_length)

    def read_header(chunk: bytes) -> int | None:
        """Worker thread: feed the header; once whole, check it and set up the scan. O(tensors):
        a header of 100,000 tensors is megabytes of JSON, which the event loop must not parse."""
        if not header.feed(chunk):
            return None
        assert header.result is not None
        infos, _, data_bytes = header.result
        check_header(infos)
        sink.scan = FiniteScan(infos, header.header_bytes)
        return header.header_bytes + data_bytes

    async def written() -> None:
        """Wait for the write in flight. Shielded: a request cancelled by a newer attempt must
        not walk away from it. anyio shields the thread's own wait, but not this task awaiting
        that one: cancelled, it returned while the thread went on writing, its tidy-up appended
        the next batch at the same offset and closed the file under the thread, and the newer
        attempt resumed from a partial with bytes out of order (4 of 8 loaded tries of eight
        staggered retries got a 4xx and no acknowledgement at all)."""
        if pending is not None:
            await asyncio.shield(pending)

    async def hand_off() -> None:
        """Give the batch to the worker thread once the write before it is done: the thread
        writes one batch while the event loop receives the next."""
        nonlocal pending, batch, batched
        await written()
        data, batch, batched = batch, [], 0
        pending = asyncio.ensure_future(to_thread.run_sync(sink.write, data))

    async def take(chunk: bytes) -> None:
        """Count a chunk against the limits and parse the header out of the first ones."""
        nonlocal received, expected
        received += len(chunk)
        check_length(received, expected, max_bytes)
        if header.result is None:
            try:
                expected = await to_thread.run_sync(read_header, chunk)
            except FormatError as exc:
                raise InvalidUpdate(str(exc)) from None
            if expected is not None:
                check_length(received, expected, max_bytes)
                if content_length is not None and offset + content_length != expected:
                    raise BadRequest(
                        f"Content-Length is {content_length} after offset {offset} but the header "
                        f"describes {expected} bytes"
                    )

    try:
        if offset and kept is not None and kept.position == offset:  # a held body: hashed and checked
            header, sink.hash, sink.scan, received = kept.header, kept.hash, kept.scan, offset
            assert header.result is not None
            expected = header.header_bytes + header.result[2]
        elif offset:  # a resumed body: its start is on disk already
            head = await to_thread.run_sync(sink.replay, offset)
            received = offset - len(head)
            await take(head)
            if sink.scan is not None:  # the bytes the partial holds are checked like the rest
                await to_thread.run_sync(sink.rescan, offset)
            scope.deadline = anyio.current_time() + idle  # re-reading a big partial is not idling
        body = chunks.__aiter__()
        refreshed = anyio.current_time()
        refresh_every = min(1.0, idle / 4)
        while True:
            try:
                chunk = await body.__anext__()
            except StopAsyncIteration:
                break
            except BaseException:
                interrupted = True
                raise
            now = anyio.current_time()
            if now - refreshed >= refresh_every:  # moving the deadline re-arms a timer: not per chunk
                scope.deadline, refreshed = now + idle, now
            await take(chunk)
            batch.append(chunk)
            batched += len(chunk)
            if batched >= _BATCH:
                await hand_off()
        await written()
        if header.result is None:
            raise BadRequest(f"body ends after {received} bytes, inside the safetensors header")
        assert expected is not None
        if received < expected:
            raise BadRequest(f"body is truncated: {received} of {expected} bytes arrived")
        await hand_off()
        await written()
        if not complete:
            upload.close()
            _keep(upload.ident, _Kept(received, sink.hash, header, sink.scan))
            return Held(received)
        try:
            staged = await to_thread.run_sync(upload.finish)
        except Missing as exc:
            raise BodyInterrupted(str(exc)) from None
    except BaseException as exc:
        # cancelled (a newer attempt, or no byte for ``idle``): keep what arrived. Not "the scope
        # was cancelled": a cancel that came during the finish (shielded) did not stop it, and
        # the finish closed the upload (then a 500: AssertionError, appending to a closed upload)
        interrupted = interrupted or isinstance(exc, anyio.get_cancelled_exc_class())
        with anyio.CancelScope(shield=True):  # tidy up even when cancelled
            if pending is not None:  # the write in flight ends first: one writer per file
                await asyncio.gather(pending, return_exceptions=True)
            keep = upload.resumable and interrupted and not isinstance(exc, HubError)
            if keep:  # what did arrive stays for the retry
                with contextlib.suppress(HubError):
                    await to_thread.run_sync(upload.append, batch)
                upload.close()
            else:
                upload.discard()
        if interrupted and not isinstance(exc, asyncio.CancelledError | BodyInterrupted):
            raise BodyInterrupted(f"the body stopped after {received} bytes ({exc!r})") from exc
        raise
    return Received(staged, received, sink.hash.hexdigest(), header.result[0], time.monotonic() - started)
