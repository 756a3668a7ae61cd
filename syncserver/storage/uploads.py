"""Receiving a safetensors body (no HTTP here): streamed to disk, checked on the way by
:class:`~syncserver.storage.body.BodyCheck`. Chunks are batched to a few MiB; a worker thread
checks and writes one batch while the event loop receives the next, touching each byte once while
hot (hash, NaN/Inf scan, write, writeback started at once: the fsync that acknowledges an update
waits for the last few MiB, not for 500 MB).

Resumable bodies (docs/RELIABILITY.md, "Resumable uploads") gather in a *partial* that outlives a
cut body; a resumed body's start is read back through the check, so every check covers every
byte, unless it is a held body whose check is kept in memory (:data:`_kept`). One request at a
time writes a partial: a newer one supersedes the older, which lets go only once its write in
flight is done and its file closed (then ``409 superseded``): the newer starts from what is on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from anyio import to_thread

from syncserver.errors import BadRequest, HubError, OffsetMismatch
from syncserver.storage.body import BodyCheck, HeaderRule
from syncserver.storage.store import Missing, Staged, Upload
from syncwire import TensorInfo

__all__ = ["BodyInterrupted", "Held", "Received", "partial_offset", "receive"]

_BATCH = 8 << 20


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


_KEPT_MAX = 64  # held bodies whose check (hash state: O(tensors)) is kept; past that the oldest is read back
_kept: dict[str, BodyCheck] = {}  # by upload ident; taken by whoever writes that upload next


class BodyInterrupted(Exception):
    """The body stopped arriving: the client went away, the link stalled for ``idle_seconds``,
    or (``superseded``) a newer attempt took over. A resumable upload's partial is kept."""

    def __init__(self, reason: str, *, superseded: bool = False) -> None:
        super().__init__(reason)
        self.superseded = superseded


@dataclass
class _Writer:
    """The request that writes a partial upload now."""

    scope: anyio.CancelScope  # cancelling it stops the request's receive
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set once its file is closed
    superseded: bool = False  # a newer attempt stopped it


# who writes each partial upload, by its absolute path (hubs sharing a process cannot collide)
_writers: dict[str, _Writer] = {}


async def _settle(ident: str) -> None:
    """Stop whoever writes ``ident`` and wait until its writes are done and its file closed."""
    while (writer := _writers.get(ident)) is not None:
        writer.superseded = True
        writer.scope.cancel()
        await writer.done.wait()


@contextlib.asynccontextmanager
async def _claim(ident: str, scope: anyio.CancelScope) -> AsyncIterator[_Writer]:
    await _settle(ident)
    writer = _writers[ident] = _Writer(scope)
    try:
        yield writer
    finally:
        if _writers.get(ident) is writer:
            del _writers[ident]
        writer.done.set()


async def partial_offset(upload: Upload) -> int:
    """How many bytes of a resumable upload the hub holds: the offset its retry starts from."""
    await _settle(upload.ident)
    return upload.held()


class _Sink:
    """An upload fed through its body's check, from a worker thread. ``offset`` > 0 appends to a
    partial; ``size``, the bytes announced, picks the spare a new upload writes over."""

    def __init__(self, upload: Upload, check: BodyCheck, offset: int, size: int | None) -> None:
        if offset and (held := upload.held()) < offset:
            raise OffsetMismatch(
                f"the hub holds {held} bytes of this upload, not {offset}; ask again (HEAD)", upload_offset=held
            )
        upload.open(offset, size)
        self.upload, self.check = upload, check

    def write(self, chunks: list[bytes]) -> None:
        """Check and write the body's next ``chunks`` (~64 KiB pieces), joined first: one copy, then
        a pass each for hash, scan and write, not Python's per-piece overhead times a hundred."""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.check.feed(data)
        self.upload.append([data])
        self.upload.writeback(self.check.received - len(data), len(data))

    def replay(self, nbytes: int) -> None:
        """Check the first ``nbytes`` already held (a resumed body's start), as if they came now."""
        while (position := self.check.received) < nbytes:
            data = self.upload.read(position, min(_BATCH, nbytes - position))
            if not data:
                raise BadRequest("the partial upload is shorter than its offset")
            self.check.feed(data)


async def receive(
    chunks: AsyncIterator[bytes],
    upload: Upload,
    *,
    max_bytes: int,
    content_length: int | None,
    check_header: HeaderRule,
    offset: int = 0,
    idle_seconds: float | None = None,
    complete: bool = True,
) -> Received | Held:
    """Stream a safetensors body into ``upload`` (fsynced), checking it on the way.

    A :class:`~syncserver.errors.HubError` on any problem, after discarding the upload. A
    resumable upload starts with ``offset`` bytes held (``content_length`` counts the rest), is
    kept when the body stops (:class:`BodyInterrupted`; also if its round closed before it was
    whole), and once whole leaves the reach of pruning. ``idle_seconds`` bounds the wait for the
    next chunk: a peer whose link died silently must not hold an upload slot forever.
    ``complete=False`` (resumable only): a whole, checked body is kept as its partial (:class:`Held`).
    """
    assert complete or upload.resumable
    check = BodyCheck(check_header, max_bytes, content_length=content_length, offset=offset)
    idle = math.inf if idle_seconds is None else idle_seconds
    scope = anyio.CancelScope(deadline=anyio.current_time() + idle)
    async with _claim(upload.ident, scope) if upload.resumable else contextlib.nullcontext() as writer:
        with scope:
            return await _receive(chunks, upload, scope, idle, check, complete)
        if writer is not None and writer.superseded:
            raise BodyInterrupted(
                "a newer attempt at this upload (a retry, or a HEAD) took over; what this one sent is kept for it",
                superseded=True,
            )
        raise BodyInterrupted(f"no body bytes for {idle}s")


async def _receive(
    body: AsyncIterator[bytes], upload: Upload, scope: anyio.CancelScope, idle: float, check: BodyCheck, complete: bool
) -> Received | Held:
    """The I/O of :func:`receive`. The header's chunks and one past the body's end go to the thread
    one at a time: wrong tensors are refused after a few kB (its JSON, megabytes for 100,000
    tensors, parsed off the event loop), a body too long now, not after 8 MiB more."""
    started, offset = time.monotonic(), check.offset
    batch: list[bytes] = []  # chunks not yet handed to the writer thread
    batched = 0  # their bytes
    arrived = offset  # the body's bytes so far, checked or not
    pending: asyncio.Future[None] | None = None  # the write in the worker thread
    interrupted = False  # the body stopped arriving (as opposed to: it was refused)
    kept = _kept.pop(upload.ident, None)  # whoever writes the upload takes it: it is stale after
    if offset and kept is not None and kept.received == offset:  # a held body: hashed and checked
        check = kept
    sink = _Sink(upload, check, offset, check.content_length)

    async def written() -> None:
        """Wait for the write in flight, shielded: anyio shields the thread's own wait, not this
        task's; cancelled by a newer attempt, it returned while the thread wrote on, its tidy-up
        wrote the next batch at the same offset and closed the file under the thread (4 of 8
        loaded tries of eight staggered retries got a 4xx and no acknowledgement at all)."""
        if pending is not None:
            await asyncio.shield(pending)

    async def hand_off() -> None:
        """Give the batch to the worker thread once the write before it is done."""
        nonlocal pending, batch, batched
        await written()
        data, batch, batched = batch, [], 0
        pending = asyncio.ensure_future(to_thread.run_sync(sink.write, data))

    try:
        if check.received < offset:  # a resumed body: its start is on disk already
            await to_thread.run_sync(sink.replay, offset)
            scope.deadline = anyio.current_time() + idle  # re-reading a big partial is not idling
        refreshed = anyio.current_time()
        refresh_every = min(1.0, idle / 4)
        interrupted = True  # set while the next chunk is awaited: a failure there is the body stopping
        async for chunk in body:
            interrupted = False
            now = anyio.current_time()
            if now - refreshed >= refresh_every:  # moving the deadline re-arms a timer: not per chunk
                scope.deadline, refreshed = now + idle, now
            batch.append(chunk)
            batched += len(chunk)
            arrived += len(chunk)
            if check.expected is None or arrived > check.expected:  # the header, or one byte too many:
                await hand_off()  # checked at once
                await written()
            elif batched >= _BATCH:
                await hand_off()
            interrupted = True
        interrupted = False
        await hand_off()
        await written()
        digest = check.finish()
        if not complete:
            upload.close()
            _kept[upload.ident] = check
            while len(_kept) > _KEPT_MAX:
                del _kept[next(iter(_kept))]
            return Held(check.received)
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
            # the write in flight ends first: one writer per file; one that failed spoils the partial
            last = await asyncio.gather(pending, return_exceptions=True) if pending is not None else [None]
            if upload.resumable and interrupted and not isinstance(exc, HubError) and last[0] is None:
                with contextlib.suppress(HubError):  # what did arrive and passes stays for the retry
                    await to_thread.run_sync(sink.write, batch)
                upload.close()
            else:
                upload.discard()
        if interrupted and not isinstance(exc, asyncio.CancelledError | BodyInterrupted):
            raise BodyInterrupted(f"the body stopped after {arrived} bytes ({exc!r})") from exc
        raise
    return Received(staged, check.received, digest, check.infos, time.monotonic() - started)
