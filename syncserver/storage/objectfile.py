"""A safetensors object in the bucket, read a slice at a time with ranged GETs, behind
:class:`syncwire.format.TensorFile`'s interface: the merge, a reducer or a check reads either.

One GET per part of every slice made the reads request-bound (a 53 MB int8 update from SeaweedFS:
0.24 s by slice against 0.05 s by 16 MB GETs). So, with a ``window``, a miss fetches that many
bytes (never past the run the caller said it will read, :meth:`~ObjectTensorFile.expect`), a few
windows are kept, and the next is fetched meanwhile on a shared pool (a store serves a few streams
faster than one). With ``stream=True`` (a reducer's lease, every byte read about in order) each
run is one GET streamed on a thread of its own: 1 GET per update and lease, not one per window
(GPT-2 int8: 1 + 18).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from syncserver.storage.s3 import ObjectStore
from syncwire import FormatError
from syncwire.format import MAX_HEADER_BYTES, TensorFile, TensorInfo, parse_header
from syncwire.retry import retrying

__all__ = ["STREAM_AHEAD", "WINDOW", "ObjectTensorFile", "TensorReader"]

_FIRST_READ = 64 << 10  # one GET takes the header of any model with up to ~500 tensors
#: a reader's read-ahead: bytes per GET, and the windows kept (a quantized tensor's slices read
#: its values and its scales, two places of the file at once; topk reads three)
WINDOW = 8 << 20
WINDOWS = 6
#: a streamed run stops reading ahead once this many bytes came that nobody read yet, unless a
#: reader waits for bytes further on (a quantized slice's scales lie past its tensor's values)
STREAM_AHEAD = 32 << 20
STREAM_TRIES = 3  # a run's GET cut on the way is asked again from where it stopped, this often
_Window = tuple[int, int, Future[bytearray]]  # bytes [first, end), fetched or on their way


@functools.cache
def _ahead() -> ThreadPoolExecutor:
    """The pool that fetches the windows read ahead, shared."""
    return ThreadPoolExecutor(8, thread_name_prefix="objectfile-ahead")


class ObjectTensorFile:
    """One safetensors object, its header read at first use (a hub whose reducers merge opens
    each update only to name it in their leases, and reads none of it; a fault in the object
    raises there). ``size``, if the caller's record has it, saves a HEAD. ``window``: bytes read
    ahead per GET (0: none). ``stream``: the caller reads every byte it said it will
    (:meth:`expect`) once, about in order; a read outside those runs is its own GET."""

    def __init__(
        self, objects: ObjectStore, name: str, size: int | None = None, *, window: int = 0, stream: bool = False
    ) -> None:
        self.objects, self.name, self._size, self.window, self.stream = objects, name, size, window, stream
        self._streams: dict[int, _Run] = {}  # by the run's first byte
        self._opened: tuple[bytes, dict[str, TensorInfo], dict[str, str], int] | None = None
        self._lock = threading.Lock()  # slices are read from several threads at once
        self._expected: list[tuple[str, int, int]] = []
        self._runs: tuple[list[int], list[int]] | None = None  # starts and ends of the expected bytes
        self._windows: list[_Window] = []  # oldest first

    def expect(self, reads: Iterable[tuple[str, int, int]]) -> None:
        """The values ``(tensor, start, stop)`` the caller will read: a read-ahead stops at the
        end of the contiguous run of them it starts in (a lease's share, not the next lease's)."""
        self._expected.extend(reads)
        self._runs = None

    def _header(self) -> tuple[bytes, dict[str, TensorInfo], dict[str, str], int]:
        """(the first GET's bytes, infos, metadata, where the data starts). The first GET's bytes
        stay: a tiny model's update is one request, not one per slice (headers outweighed bytes)."""
        with self._lock:
            if self._opened is not None:
                return self._opened
            objects, name, size = self.objects, self.name, self._size
            if size is None:
                info = objects.head(name)
                if info is None:
                    raise FileNotFoundError(f"{objects.url}{name}: no such object")
                size = info.size
            head = bytes(objects.read(name, 0, min(size, _FIRST_READ)))
            base = 8 + int.from_bytes(head[:8], "little")
            if 8 <= len(head) < base <= min(size, 8 + MAX_HEADER_BYTES):
                head += bytes(objects.read(name, len(head), base))
            try:  # parse_header refuses a header that is short, over the limit or cut
                infos, metadata, data = parse_header(head[:base])
            except FormatError as exc:
                raise FormatError(f"{name}: {exc}") from None
            if size - base != data:
                raise FormatError(f"{name}: {size - base} data bytes, the header describes {data}")
            self._size, self._opened = size, (head, infos, metadata, base)
            return self._opened

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
        dtype = info.numpy_dtype
        first = base + info.start + start * dtype.itemsize
        end = first + (stop - start) * dtype.itemsize
        if end <= len(held):
            return np.frombuffer(bytearray(held[first:end]), dtype)
        if self.stream:
            raw = self._streamed(first, end, infos, base, held)
        elif self.window:
            raw = self._fetch(first, end, infos, base)
        else:
            raw = self.objects.read(self.name, first, end)
        if len(raw) != (stop - start) * dtype.itemsize:
            raise FormatError(f"{self.name}: ends inside tensor {name!r}")
        return np.frombuffer(raw, dtype)  # a bytearray: the array is writable

    def _fetch(self, first: int, end: int, infos: dict[str, TensorInfo], base: int) -> bytearray:
        """Bytes ``[first, end)`` from the windows that hold them, the rest fetched now as a window
        from where they end (one from the read's start would fetch held bytes again: 1.5x a
        lease's bytes at GPT-2, bench/lease_reads.py), and the run's next window meanwhile."""
        with self._lock:
            run = self._run(first, infos, base)
            run_end = run[1] if run is not None else self._size
            assert run_end is not None  # the size is known once the header is
            chain: list[_Window] = []
            at = first
            while at < end and (held := self._held(at)) is not None:
                chain.append(held)
                at = held[1]
            fetch: _Window | None = None
            if at < end:
                fetch = (at, max(end, min(at + self.window, run_end, self._next_held(at))), Future())
                self._keep(fetch)
                chain.append(fetch)
            hi = chain[-1][1]
            if hi < run_end and self._held(hi) is None:
                nxt = min(hi + self.window, run_end, self._next_held(hi))
                self._keep((hi, nxt, _ahead().submit(self.objects.read, self.name, hi, nxt)))
        if fetch is not None:  # outside the lock: the other threads' reads go on meanwhile
            try:
                fetch[2].set_result(self.objects.read(self.name, fetch[0], fetch[1]))
            except BaseException as exc:
                fetch[2].set_exception(exc)
        out = bytearray()
        for window in chain:
            lo, hi, future = window
            try:
                got = future.result()
            except BaseException:
                with self._lock:  # the next read fetches it again
                    if window in self._windows:
                        self._windows.remove(window)
                raise
            out += memoryview(got)[max(first, lo) - lo : min(end, hi) - lo]
        return out

    def _streamed(self, first: int, end: int, infos: dict[str, TensorInfo], base: int, head: bytes) -> bytearray:
        """Bytes ``[first, end)`` from their run's streamed GET (started at its first read, where
        ``head`` ends); their own GET if no run holds them all, or a chunk of them went already."""
        with self._lock:
            said, run = self._run(first, infos, base), None
            if said is not None and end <= said[1]:
                run = self._streams.get(said[0])
                if run is None:
                    run = self._streams[said[0]] = _Run(self.objects, self.name, max(said[0], len(head)), said[1])
        got = None if run is None else run.read(max(first, run.lo), end)
        if run is None or got is None:
            return self.objects.read(self.name, first, end)
        return bytearray(head[first : run.lo]) + got if first < run.lo else got

    def _held(self, at: int) -> _Window | None:
        """The window that holds byte ``at``, made the most recent."""
        for i, window in enumerate(self._windows):
            if window[0] <= at < window[1]:
                self._windows.append(self._windows.pop(i))
                return window
        return None

    def _next_held(self, at: int) -> int:
        """Where the first held window after byte ``at`` starts: a new window stops there."""
        return min((lo for lo, _, _ in self._windows if lo > at), default=1 << 62)

    def _keep(self, window: _Window) -> None:
        self._windows.append(window)
        del self._windows[:-WINDOWS]

    def _run(self, first: int, infos: dict[str, TensorInfo], base: int) -> tuple[int, int] | None:
        """The run of expected bytes ``[lo, hi)`` that holds byte ``first``, if any."""
        if self._runs is None:
            spans = []
            for name, start, stop in self._expected:
                at, size = base + infos[name].start, infos[name].numpy_dtype.itemsize
                spans.append((at + start * size, at + stop * size))
            starts: list[int] = []
            ends: list[int] = []
            for lo, hi in sorted(spans):
                if ends and lo <= ends[-1]:
                    ends[-1] = max(ends[-1], hi)
                else:
                    starts.append(lo)
                    ends.append(hi)
            self._runs = starts, ends
        starts, ends = self._runs
        i = bisect.bisect_right(starts, first) - 1
        return (starts[i], ends[i]) if i >= 0 and first < ends[i] else None

    def close(self) -> None:
        """Stop the streamed GETs under way and drop what they hold."""
        with self._lock:
            runs, self._streams = list(self._streams.values()), {}
        for run in runs:
            run.close()

    def __enter__(self) -> ObjectTensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: A safetensors file read a slice at a time: on the hub's disk, or an object of the store.
TensorReader = TensorFile | ObjectTensorFile


class _Run:
    """Bytes ``[lo, hi)`` of an object by one streamed GET on a thread of its own (resumed where
    it stopped if the link fails), each chunk kept until every byte of it was read."""

    def __init__(self, objects: ObjectStore, name: str, lo: int, hi: int) -> None:
        self.objects, self.name, self.lo, self.hi = objects, name, lo, hi
        self._cond = threading.Condition()
        self._starts: list[int] = []  # each kept chunk's first byte, in order
        self._chunks: dict[int, tuple[bytes, int]] = {}  # first byte -> (bytes, how many still unread)
        self._come = lo  # bytes [lo, _come) came
        self._held = 0  # unread bytes kept
        self._wanted = lo  # the furthest byte a reader waits for
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._pump, daemon=True, name="objectfile-stream")
        self._thread.start()

    def _pump(self) -> None:
        try:
            for attempt in retrying(lambda exc: isinstance(exc, Exception), attempts=STREAM_TRIES, stopped=self._done):
                with attempt:
                    self._get()
        except Exception as exc:
            with self._cond:
                if not self._closed:
                    self._error = exc
                    self._cond.notify_all()

    def _done(self) -> bool:
        with self._cond:
            return self._closed or self._come >= self.hi

    def _get(self) -> None:
        """One GET of the bytes not come yet, kept as they come."""
        if self._done():
            return
        with contextlib.closing(self.objects.stream(self.name, self._come, self.hi)) as chunks:
            for chunk in chunks:
                with self._cond:
                    while self._held >= STREAM_AHEAD and self._wanted <= self._come and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        return
                    self._starts.append(self._come)
                    self._chunks[self._come] = (chunk, len(chunk))
                    self._come += len(chunk)
                    self._held += len(chunk)
                    self._cond.notify_all()

    def read(self, first: int, end: int) -> bytearray | None:
        """Bytes ``[first, end)`` once they came (None: some of them were read, and dropped, before)."""
        with self._cond:
            if end > self._wanted:
                self._wanted = end
                self._cond.notify_all()
            while self._come < end and self._error is None and not self._closed:
                self._cond.wait()
            if self._come < end:
                if self._error is not None:
                    raise self._error
                return None
            out, at, taken = bytearray(), first, []
            for start in self._starts[max(bisect.bisect_right(self._starts, first) - 1, 0) :]:
                if at == end:
                    break
                data = self._chunks[start][0]
                if not start <= at < start + len(data):
                    return None  # a gap: those bytes were read and dropped
                take = min(end, start + len(data)) - at
                out += memoryview(data)[at - start : at - start + take]
                taken.append((start, take))
                at += take
            if at < end:
                return None
            for start, take in taken:
                data, unread = self._chunks[start]
                self._held -= take
                if unread > take:
                    self._chunks[start] = (data, unread - take)
                else:
                    del self._chunks[start]
                    self._starts.remove(start)
            self._cond.notify_all()
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._chunks.clear()
            self._starts.clear()
            self._cond.notify_all()
