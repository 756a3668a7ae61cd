"""Work leases: what the hub hands a reducer, and the work on each by kind (:data:`KINDS`, shared
by the reducers and the hub working a lease itself); what each kind does and why:
docs/object-store.md. No HTTP here, no hub state. ("Lease" alone, elsewhere, is a peer's liveness.)

- :class:`MergeJob`: a span of a round's merge (:meth:`~syncserver.reduce.engine.MergeEngine.open_merge`),
  writing its bytes of each output into the hub's staged files or as parts of an upload (:class:`ObjectOutput`).
- :class:`FoldJob`: a span of the round's mean folded ahead, kept in this process's memory (:data:`MEANS`).
- :class:`BuildJob`: a span of version v+1 after the commit (version v + the decoded result).
- :class:`~syncserver.reduce.checklease.CheckJob`: an uploaded body's check.

Every slice lease runs one skeleton (:func:`_sliced`) through the hub's own per-slice functions
(:func:`~syncserver.reduce.engine.merge_slice`, ``fold_slice``, ``apply_slice``): the same inputs give
the same bits whoever runs a slice, and a lease redone writes the very same bytes.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, NamedTuple, TypeVar

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from syncserver.reduce.checklease import MAX_DETAIL, CheckJob, CheckReport, work_check
from syncserver.reduce.engine import Merge, NonFinite, Resident, Step, apply_slice, fold_slice, merge_slice, run_slices
from syncserver.reduce.plan import PART_MIN, Piece, Span, byte_range, itemsizes, multi_part, pieces, plan
from syncserver.storage.objectfile import WINDOW, ObjectTensorFile, TensorReader
from syncserver.storage.s3 import ObjectStore
from syncserver.storage.store import BlobWriter
from syncwire import Codec, Schema, get_codec, wire_name
from syncwire.format import TensorFile
from syncwire.retry import retrying

__all__ = [
    "KINDS",
    "MEANS",
    "BuildJob",
    "Done",
    "FoldJob",
    "Means",
    "MergeJob",
    "ObjectOutput",
    "SliceJob",
    "UpdateSource",
    "WorkJob",
    "WorkLeaseLost",
    "build_jobs",
    "fold_jobs",
    "highest",
    "jobs",
    "object_reader",
    "parse",
    "work",
]

#: a lease's range of an output in the bucket goes up as parts of about this size, a few at once:
#: SeaweedFS took 2.2 s for one 200 MB part and 0.95 s for 8 of 25 MB, 4 at once
CHUNK = 16 << 20
CHUNKS_AT_ONCE = 4
MAX_PEAKS = 100_000  # tensors a lease may report a peak of (a model has a few hundred)
PUT_TRIES = 3  # a part PUT to the bucket, before the lease fails

Objects = Callable[[], ObjectStore]
log = logging.getLogger(__name__)


class SliceJob(BaseModel):
    """Values ``[start, stop)`` of ``name``, and where they lie in the updates' wire parts and the
    result's (suffix -> (first value, count))."""

    model_config = ConfigDict(extra="forbid")
    name: str
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    parts: dict[str, tuple[int, int]]
    out_parts: dict[str, tuple[int, int]]


class UpdateSource(BaseModel):
    """Where an update lies (a file on the hub's disk, or an object in its bucket), and its weight."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    object: str | None = None
    weight: float

    @model_validator(mode="after")
    def _one_place(self) -> UpdateSource:
        if (self.path is None) == (self.object is None):
            raise ValueError("an update lies at a path or in an object, exactly one of them")
        return self

    @classmethod
    def of(cls, wire: TensorReader, weight: float) -> UpdateSource:
        if isinstance(wire, ObjectTensorFile):
            return cls(object=wire.name, weight=weight)
        return cls(path=wire.path, weight=weight)


class Chunk(BaseModel):
    """One part of a multipart upload: its number, its presigned UploadPart URL, its bytes."""

    model_config = ConfigDict(extra="forbid")
    part: int = Field(ge=1, le=10_000)
    url: str
    size: int = Field(ge=0, le=5 * 1024**3)


class Output(BaseModel):
    """Where a lease writes one output (a staged file on the hub's disk, or ``parts`` of an upload:
    together the file's bytes ``[start, start + size)``, with ``head``, base64, if they start
    it), and each tensor's byte offset in the file (``at``)."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    parts: list[Chunk] = Field(default_factory=list, max_length=10_000)
    start: int = Field(0, ge=0)
    size: int = Field(0, ge=0, le=5 * 1024**4)
    head: str = ""
    at: dict[str, int]

    @model_validator(mode="after")
    def _one_place(self) -> Output:
        if (self.path is None) == (not self.parts):
            raise ValueError("an output goes to a path or to part URLs, exactly one of them")
        if self.parts and sum(c.size for c in self.parts) != self.size:
            raise ValueError(f"the parts hold {sum(c.size for c in self.parts)} bytes, the range {self.size}")
        return self


class _SliceLease(BaseModel):
    """What every slice lease carries (the board sets its id, length, run, round); reported by :class:`Done`."""

    model_config = ConfigDict(extra="forbid")
    report: ClassVar[str] = "done"
    lease: str = Field("", description="The lease's id: renew it and report it done by this id.")
    run: str = ""
    round: int = Field(0, ge=0)
    seconds: float = Field(0.0, description="The lease's length: renew it within this many seconds.")
    slices: list[SliceJob]
    reads: int = Field(description="Bytes of one update (a build: of the result) this lease reads.")


class MergeJob(_SliceLease):
    """A merge lease (``POST /v1/reduce/lease``; its JSON names no ``kind``)."""

    kind: ClassVar[Literal["merge"]] = "merge"
    step: Step  # validated as a dataclass: no extra field either
    base: str | None = Field(description="Version v (float32) on the hub's disk, read with pread.")
    base_object: str | None = Field(None, description="Version v in the bucket (ranged GETs), instead of base.")
    momentum: str | None = Field(description="DiLoCo's momentum of version v on the hub's disk, if any.")
    residual: str | None = Field(description="The hub's residual of version v (topk) on the hub's disk, if any.")
    momentum_object: str | None = Field(None, description="DiLoCo's momentum of version v in the bucket, if any.")
    residual_object: str | None = Field(None, description="The hub's residual of version v in the bucket, if any.")
    mean: str | None = Field(
        None, description="The id of the round's mean folded ahead, if any: held in the reducers' memory."
    )
    held: int = Field(0, ge=0, description="How many of the updates (the first ones) that mean holds.")
    folded: float = Field(0.0, ge=0, description="The weight that mean holds: the rest are folded after it.")
    updates: list[UpdateSource] = Field(
        description="Every update and its weight, folded in this order (a slice of the mean not held: from the first)."
    )
    result: Output
    next_momentum: Output | None
    next_residual: Output | None
    bound: dict[str, float] | None = Field(
        None, description="A bound on |version v| per tensor of the lease: slices under it skip reading version v."
    )
    writes: int = Field(description="Bytes of the result it writes.")


class BuildJob(_SliceLease):
    """A build lease: a span of version v+1 (``round`` = v), version v plus round v's decoded result,
    both in the bucket, written as its parts of version v+1's upload."""

    kind: Literal["build"] = "build"
    base_object: str = Field(description="Version v in the bucket.")
    result_object: str = Field(description="Round v's result in the bucket (its header names its codec).")
    codec: str = Field(description="The run's codec: the slices' cuts and parts are its.")
    version: Output = Field(description="Where this lease's range of version v+1 goes (part URLs).")


class FoldJob(_SliceLease):
    """A fold lease: a span of the mean so far (``base``, holding the first ``held`` of ``updates``)
    with the rest folded after it, kept as ``mean`` in memory (a slice not held: from the first)."""

    kind: Literal["fold"] = "fold"
    codec: str = Field(description="The updates' codec: the slices' parts are its.")
    mean: str = Field(min_length=1, max_length=64, description="The id the new mean is kept under.")
    base: str | None = Field(None, max_length=64, description="The id of the mean so far, if any.")
    held: int = Field(0, ge=0, description="How many of the updates (the first ones) the mean so far holds.")
    folded: float = Field(0.0, ge=0, description="The weight the mean so far holds.")
    updates: list[UpdateSource] = Field(min_length=1, description="Every update of the new mean, in fold order.")


WorkJob = MergeJob | FoldJob | BuildJob | CheckJob


class Done(BaseModel):
    """A reducer's report of a slice lease (``POST /v1/reduce/leases/{lease}/done``)."""

    model_config = ConfigDict(extra="forbid")
    reducer: str = Field(min_length=1, max_length=128)
    seconds: float = Field(ge=0, le=86_400, description="Wall time the lease's work took.")
    bytes: int = Field(ge=0, le=2**50, description="Bytes read and written.")
    error: str | None = Field(
        None, pattern="^(non_finite|failed)$", description="non_finite: the round would not be finite; failed: other."
    )
    detail: str = Field("", max_length=MAX_DETAIL)
    peaks: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict,
        max_length=MAX_PEAKS,
        description="A bound on |version v+1| per tensor the lease worked on (the next round's jobs carry it).",
    )


class Means:
    """This process's share of the reducers' running means, by id and slice ((tensor, first value) ->
    float32), kept between leases so no mean is written or read back. Entries are exact (an id
    names one fold of given updates): a lease uses what it finds, folds the rest from the updates,
    and *takes* a slice to fold into (one that dies leaves it to be folded again). A lease drops the
    run's other means (superseded) and any idle for :data:`MEAN_IDLE_SECONDS` (a run ended elsewhere)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._means: dict[str, tuple[str, dict[tuple[str, int], np.ndarray]]] = {}  # id -> (run, slices)
        self._used: dict[str, float] = {}  # id -> when a lease last started on it

    def start(self, run: str, keep: Iterable[str | None]) -> None:
        """A lease of ``run`` works on the means ``keep``: drop the run's others, and idle ones."""
        kept, now = {m for m in keep if m is not None}, time.monotonic()
        with self._lock:
            for mean in kept:
                self._used[mean] = now
            for mean, (r, _) in list(self._means.items()):
                if mean not in kept and (r == run or now - self._used.get(mean, now) > MEAN_IDLE_SECONDS):
                    del self._means[mean]
            self._used = {m: t for m, t in self._used.items() if m in self._means or m in kept}

    def has(self, mean: str, name: str, start: int) -> bool:
        with self._lock:
            return (name, start) in self._means.get(mean, ("", {}))[1]

    def take(self, mean: str, name: str, start: int) -> np.ndarray | None:
        """That slice of ``mean``, now the caller's; None if not held."""
        with self._lock:
            return self._means.get(mean, ("", {}))[1].pop((name, start), None)

    def put(self, run: str, mean: str, name: str, start: int, values: np.ndarray) -> None:
        with self._lock:
            self._means.setdefault(mean, (run, {}))[1][(name, start)] = values

    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for _, slices in self._means.values() for a in slices.values())


MEANS = Means()  # this process's (a reducer's; the hub's when it works leases itself)
MEAN_IDLE_SECONDS = 3600.0  # a mean no lease started on for this long is dropped at the next start


class WorkLeaseLost(Exception):
    """The reducer was told its work lease is lost: the rest is moot."""


class ObjectOutput:
    """The hub's side of an output the reducers upload as parts of one multipart upload: the header,
    ``url(number)``, and (set by :func:`jobs`) each part's size and each lease's parts."""

    def __init__(self, name: str, size: int, upload_id: str, url: Callable[[int], str]) -> None:
        self.name, self.size, self.upload_id, self.url = name, size, upload_id, url
        self.head = b""
        self.parts: dict[int, int] = {}
        self.leases: dict[int, list[int]] = {}

    def write(self, data: bytes) -> None:
        if self.head:
            raise ValueError(f"{self.name}: the header is written once")
        self.head = bytes(data)

    def write_at(self, array: np.ndarray, position: int) -> None:
        raise TypeError(f"{self.name}: the reducers write this output, not the hub")


def jobs(merge: Merge, schema: Schema, k: int) -> list[MergeJob]:
    """The leases of an open merge, at most ``k`` (:func:`plan`). Staged outputs are pre-sized here,
    so that other processes can fill any range; one in the bucket (:class:`ObjectOutput`) is cut
    into each span's parts (spans of at least :data:`~syncserver.reduce.plan.PART_MIN`, S3's)."""
    codec, result_codec = get_codec(merge.step.run_codec), get_codec(merge.step.codec)
    items = pieces(codec, result_codec, schema)
    fp32_bytes = 4 * sum(p.stop - p.start for p in items)
    in_parts = isinstance(merge.result, ObjectOutput)
    spans = plan(items, k, whole_tensors=multi_part(result_codec), min_writes=PART_MIN if in_parts else 0)
    outputs = [  # DiLoCo's momentum and the hub's residual are float32 files (value sizes None)
        (merge.result, merge.result_at, merge.result_size, itemsizes(result_codec)),
        (merge.next_momentum, merge.momentum_at, min(merge.momentum_at.values(), default=0) + fp32_bytes, None),
        (merge.next_residual, merge.residual_at, min(merge.residual_at.values(), default=0) + fp32_bytes, None),
    ]
    for writer, at, size, sizes in outputs:
        if isinstance(writer, ObjectOutput):
            _cut_parts(writer, items, spans, at, sizes)
        elif writer is not None:
            if not isinstance(writer, BlobWriter) or writer.path is None:
                raise TypeError("a leased merge writes into staged files on this machine")
            writer.reserve(size)
    return [_job(merge, items, span, number) for number, span in enumerate(spans, 1)]


def build_jobs(
    schema: Schema, codec: Codec, base: str, result: str, out: ObjectOutput, at: dict[str, int], k: int
) -> list[BuildJob]:
    """The build leases of version v+1 into ``out`` (its header written; ``at``: each tensor's offset),
    at most ``k``, cut as the run's ``codec`` cuts. The hub does not read the result: a final
    round's is fp32, whose values the reducer finds at their own places (:func:`_build`)."""
    items = pieces(codec, get_codec("fp32"), schema)  # out_parts: the values' own places, as in a float32 file
    spans = plan(items, k, whole_tensors=False, min_writes=PART_MIN)
    _cut_parts(out, items, spans, at, None)
    return [
        BuildJob(
            base_object=base,
            result_object=result,
            codec=codec.spec,
            slices=_slices(items, span, out_parts=False),
            version=_part(out, number, {p.name: at[p.name] for p in items[span.first : span.stop]}),
            reads=span.reads,
        )
        for number, span in enumerate(spans, 1)
    ]


def fold_jobs(
    schema: Schema, codec: Codec, k: int, mean: str, base: Resident | None, folded: float, updates: list[UpdateSource]
) -> list[FoldJob]:
    """The fold leases of one step ahead into mean ``mean``: ``updates`` after the mean so far
    (``base``, holding the first of them; None: the first step), cut as the merge's leases are, so
    each merge lease finds its slices of the mean with the reducer that folded them."""
    items = pieces(codec, codec, schema)
    return [
        FoldJob(
            codec=codec.spec,
            mean=mean,
            base=base.id if base is not None else None,
            held=len(base.updates) if base is not None else 0,
            folded=folded if base is not None else 0.0,
            updates=updates,
            slices=_slices(items, span, out_parts=False),
            reads=span.reads,
        )
        for span in plan(items, k, whole_tensors=multi_part(codec))
    ]


def _slices(items: list[Piece], span: Span, *, out_parts: bool) -> list[SliceJob]:
    """The span's slices, as its lease names them (``out_parts``: with where they lie in the result)."""
    return [
        SliceJob(name=p.name, start=p.start, stop=p.stop, parts=p.parts, out_parts=p.out_parts if out_parts else {})
        for p in items[span.first : span.stop]
    ]


def _part(out: ObjectOutput, number: int, at: dict[str, int]) -> Output:
    """Lease ``number``'s range of ``out``: its parts' URLs, its bytes, the header if it is the first."""
    numbers = out.leases[number]
    start = sum(out.parts[n] for n in range(1, numbers[0]))
    head = base64.b64encode(out.head).decode() if number == 1 else ""
    parts = [Chunk(part=n, url=out.url(n), size=out.parts[n]) for n in numbers]
    return Output(parts=parts, start=start, size=sum(c.size for c in parts), head=head, at=at)


def _cut_parts(
    out: ObjectOutput, items: list[Piece], spans: list[Span], at: dict[str, int], sizes: dict[str, int] | None
) -> None:
    """Each span's range of ``out`` (the first from byte 0, the header too) cut into parts of about
    :data:`CHUNK` (at most 10,000 in all). ValueError unless the ranges tile the file exactly."""
    chunk = max(CHUNK, -(-out.size // 9_000))
    end, number = 0, 0
    for lease, span in enumerate(spans, 1):
        lo, hi = byte_range(items, span, at, sizes)
        if lease == 1:
            if lo != len(out.head):
                raise ValueError(f"{out.name}: the first tensor starts at {lo}, after a header of {len(out.head)}")
            lo = 0
        if lo != end:
            raise ValueError(f"{out.name}: lease {lease} starts at {lo}, not at {end}")
        count = max(1, (hi - lo) // chunk)  # each part at least ``chunk`` bytes when the range is
        each, extra = divmod(hi - lo, count)
        out.leases[lease] = list(range(number + 1, number + count + 1))
        out.parts.update(dict.fromkeys(out.leases[lease], each))
        number += count
        out.parts[number] += extra
        end = hi
    if end != out.size:
        raise ValueError(f"{out.name}: the leases end at {end}, the file at {out.size}")


def _job(merge: Merge, items: list[Piece], span: Span, number: int) -> MergeJob:
    chosen = items[span.first : span.stop]
    names = list(dict.fromkeys(p.name for p in chosen))

    def output(writer: object, at: dict[str, int], wires: list[str]) -> Output | None:
        if writer is None:
            return None
        where = {w: at[w] for w in wires}
        if isinstance(writer, ObjectOutput):
            return _part(writer, number, where)
        assert isinstance(writer, BlobWriter) and writer.path is not None
        return Output(path=os.fspath(writer.path), at=where)

    result = output(
        merge.result, merge.result_at, list(dict.fromkeys(wire_name(p.name, s) for p in chosen for s in p.out_parts))
    )
    assert result is not None
    base, momentum, residual = merge.base, merge.momentum, merge.residual
    return MergeJob(
        step=merge.step,
        base=base.path if isinstance(base, TensorFile) else None,
        base_object=base.name if isinstance(base, ObjectTensorFile) else None,
        momentum=momentum.path if isinstance(momentum, TensorFile) else None,
        residual=residual.path if isinstance(residual, TensorFile) else None,
        momentum_object=momentum.name if isinstance(momentum, ObjectTensorFile) else None,
        residual_object=residual.name if isinstance(residual, ObjectTensorFile) else None,
        mean=merge.mean,
        held=merge.held,
        folded=merge.folded,
        updates=[UpdateSource.of(wire, weight) for wire, weight in merge.updates],
        slices=_slices(items, span, out_parts=True),
        result=result,
        next_momentum=output(merge.next_momentum, merge.momentum_at, names),
        next_residual=output(merge.next_residual, merge.residual_at, names),
        bound={n: merge.bound[n] for n in names if n in merge.bound} if merge.bound is not None else None,
        reads=span.reads,
        writes=span.writes,
    )


class _Part:
    """A lease's range of an output in the bucket, built in memory and then PUT as its parts."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.buffer = bytearray(out.size)
        head = base64.b64decode(out.head)
        self.buffer[: len(head)] = head

    def write_at(self, array: np.ndarray, position: int) -> None:
        view = array.reshape(-1).view(np.uint8)
        first = position - self.out.start
        if first < 0 or first + view.size > self.out.size:
            raise ValueError(f"bytes [{position}, +{view.size}) lie outside [{self.out.start}, +{self.out.size})")
        self.buffer[first : first + view.size] = view.data

    def send(self) -> None:
        """PUT the parts, :data:`CHUNKS_AT_ONCE` at once; the first failure raises. A part sent
        twice (a lease redone) holds the same bytes, and the hub completes with the last."""
        offsets = itertools.accumulate((chunk.size for chunk in self.out.parts), initial=0)
        with (
            httpx.Client(timeout=httpx.Timeout(30.0, write=300.0)) as http,
            ThreadPoolExecutor(CHUNKS_AT_ONCE, thread_name_prefix="reducer-parts") as pool,
        ):
            run_slices(pool, [(http, chunk, at) for chunk, at in zip(self.out.parts, offsets, strict=False)], self._put)

    def _put(self, http: httpx.Client, chunk: Chunk, offset: int) -> None:
        """PUT one part; a store that hiccups (no answer, a 5xx) is not worth a lease: tried
        :data:`PUT_TRIES` times, with backoff."""
        body = bytes(memoryview(self.buffer)[offset : offset + chunk.size])
        try:
            for attempt in retrying(_hiccup, attempts=PUT_TRIES):
                with attempt:
                    http.put(chunk.url, content=body).raise_for_status()
        except httpx.TransportError as exc:
            raise RuntimeError(f"part {chunk.part}: cannot reach the object store: {exc}") from None
        except httpx.HTTPStatusError as exc:
            answer = exc.response
            raise RuntimeError(
                f"part {chunk.part}: the object store answered {answer.status_code}: {answer.text[:200]}"
            ) from None


def _hiccup(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, httpx.TransportError)


@dataclass(frozen=True)
class _At:
    """Where a lease opens what it reads and writes: its id (errors name it), its files, the bucket (if any)."""

    lease: str
    files: contextlib.ExitStack
    objects: Objects | None

    def bucket(self, what: str) -> ObjectStore:
        """The bucket the lease reads ``what`` in (one line if there is none here)."""
        if self.objects is None:
            raise RuntimeError(
                f"lease {self.lease} reads {what} in the object store: give this reducer SYNC_STORE and the "
                "AWS_* variables, as the hub has them"
            )
        return self.objects()


class _Opened(NamedTuple):
    """A slice lease, opened: its slices, the work on one, then its finish (bytes moved, peaks)."""

    slices: list[SliceJob]
    one: Callable[[SliceJob], None]
    finish: Callable[[], tuple[int, list[tuple[str, float]]]]


J = TypeVar("J", MergeJob, FoldJob, BuildJob)


def _sliced(
    opens: Callable[[J, _At], _Opened],
    job: J,
    reducer: str,
    stop: Callable[[], bool],
    pool: ThreadPoolExecutor | None,
    objects: Objects | None,
) -> Done:
    """The one skeleton of a slice lease: open it by its kind, do its slices on ``pool`` asking
    ``stop`` before each, finish, and report (``non_finite``: the hub leaves an update out, as in-process)."""
    started = time.monotonic()
    with contextlib.ExitStack() as files:
        opened = opens(job, _At(job.lease, files, objects))

        def one(s: SliceJob) -> None:
            _going(stop, job.lease)
            opened.one(s)

        try:
            run_slices(pool, [(s,) for s in opened.slices], one)
        except NonFinite as exc:
            seconds = time.monotonic() - started
            return Done(reducer=reducer, seconds=seconds, bytes=0, error="non_finite", detail=str(exc)[:MAX_DETAIL])
    _going(stop, job.lease)
    nbytes, peaks = opened.finish()
    return Done(reducer=reducer, seconds=time.monotonic() - started, bytes=nbytes, peaks=highest(peaks))


def _merge(job: MergeJob, at: _At) -> _Opened:
    """A merge lease: each slice folded (after the mean folded ahead, where this process holds the
    slice) and stepped, its bytes of each output written or built for PUT."""
    values = [(s.name, s.start, s.stop) for s in job.slices]  # of version v, the momentum, the residual

    def state(path: str | None, name: str | None, what: str) -> TensorReader | None:
        return None if path is None and name is None else _opened(at, path, name, what, values)

    # the files on the hub's disk first: a reducer elsewhere fails before any request
    momentum = state(job.momentum, job.momentum_object, "DiLoCo's momentum")
    residual = state(job.residual, job.residual_object, "the hub's residual")
    parts: list[_Part] = []
    peaks: list[tuple[str, float]] = []
    result = _sink(at, job.result, parts)
    if job.mean is not None:
        MEANS.start(job.run, [job.mean])
    assert result is not None
    merge = Merge(
        step=job.step,
        base=_opened(at, job.base, job.base_object, "version v", values),
        updates=_updates(at, job.updates, job.slices, job.mean, job.held),
        momentum=momentum,
        residual=residual,
        result=result,
        result_at=job.result.at,
        next_momentum=_sink(at, job.next_momentum, parts),
        momentum_at=job.next_momentum.at if job.next_momentum is not None else {},
        next_residual=_sink(at, job.next_residual, parts),
        residual_at=job.next_residual.at if job.next_residual is not None else {},
        bound=job.bound,
        peaks=peaks,
        mean=job.mean,
        held=job.held,
        folded=job.folded,
        take=MEANS.take,
    )

    def finish() -> tuple[int, list[tuple[str, float]]]:
        for part in parts:
            part.send()
        count = sum(s.stop - s.start for s in job.slices)
        states = sum(o is not None for o in (job.next_momentum, job.next_residual))
        return job.reads * (len(job.updates) - job.held) + job.writes + 4 * count * states, peaks

    return _Opened(
        job.slices, lambda s: merge_slice(merge, None, s.name, s.start, s.stop, s.parts, s.out_parts), finish
    )


def _fold(job: FoldJob, at: _At) -> _Opened:
    """A fold lease, into :data:`MEANS`: a slice of the mean so far held here is taken and folded in
    place, any other folded from the first update. Nothing is written: the hub records who holds
    which slices once the lease is reported, and a lost lease's slices are folded again."""
    codec = get_codec(job.codec)
    MEANS.start(job.run, [job.base, job.mean])
    whole = job.base is not None and all(MEANS.has(job.base, s.name, s.start) for s in job.slices)
    updates = _updates(at, job.updates, job.slices, job.base, job.held)

    def one(s: SliceJob) -> None:
        held = MEANS.take(job.base, s.name, s.start) if job.base is not None else None
        after, folded = (updates[job.held :], job.folded) if held is not None else (updates, 0.0)
        mean = fold_slice(s.name, s.start, s.stop, s.parts, held, folded, after, codec, own=True)
        MEANS.put(job.run, job.mean, s.name, s.start, mean)

    return _Opened(job.slices, one, lambda: (job.reads * (len(job.updates) - (job.held if whole else 0)), []))


def _build(job: BuildJob, at: _At) -> _Opened:
    """A build lease's range of version v+1 (version v + the decoded result, each by ranged GETs),
    PUT as its parts; its peaks: each tensor's largest ``|value|`` (the next merge's bound)."""
    store = at.bucket(f"version {job.round}")
    result = ObjectTensorFile(store, job.result_object, window=WINDOW)
    codec = get_codec(result.metadata.get("codec", job.codec))
    slices = job.slices
    if codec.spec != job.codec:  # a final round's fp32 result: each slice's values at their own places
        if multi_part(codec):
            raise RuntimeError(f"build lease {job.lease}: a result in {codec.spec} is not cut as {job.codec}")
        suffixes = itemsizes(codec)
        slices = [s.model_copy(update={"parts": dict.fromkeys(suffixes, (s.start, s.stop - s.start))}) for s in slices]
    base = object_reader(store, job.base_object, [(s.name, s.start, s.stop) for s in slices])
    result.expect(_wire_reads(slices))
    part = _Part(job.version)
    peaks: list[tuple[str, float]] = []

    def one(s: SliceJob) -> None:
        new = apply_slice(base, result, codec, s.name, s.start, s.stop, s.parts)
        part.write_at(new, job.version.at[s.name] + s.start * 4)
        peaks.append((s.name, float(np.max(np.abs(new), initial=0.0))))

    def finish() -> tuple[int, list[tuple[str, float]]]:
        part.send()
        return job.reads + 8 * sum(s.stop - s.start for s in job.slices), peaks

    return _Opened(slices, one, finish)


class Kind(NamedTuple):
    """A kind of work lease: its job on the wire, and the function that works it."""

    job: type[WorkJob]
    work: Callable[..., Done | CheckReport]


#: every kind of work lease: the one table the reducers and the hub (no reducer left) work leases by
KINDS: dict[str, Kind] = {
    "merge": Kind(MergeJob, functools.partial(_sliced, _merge)),
    "fold": Kind(FoldJob, functools.partial(_sliced, _fold)),
    "build": Kind(BuildJob, functools.partial(_sliced, _build)),
    "check": Kind(CheckJob, work_check),
}


def parse(lease: object) -> WorkJob:
    """A work lease as the hub answers ``POST /v1/reduce/lease`` (a merge lease names no kind);
    ValueError (pydantic's ValidationError is one) if it is none."""
    kind = lease.get("kind", "merge") if isinstance(lease, dict) else None
    if kind not in KINDS:
        raise ValueError(f"not a work lease of a known kind: {kind!r}")
    return KINDS[kind].job.model_validate(lease)


def work(
    job: WorkJob,
    reducer: str,
    *,
    stop: Callable[[], bool] = lambda: False,
    pool: ThreadPoolExecutor | None = None,
    objects: Objects | None = None,
) -> Done | CheckReport:
    """Work ``job`` as ``reducer`` by its kind (:data:`KINDS`): the report for ``job.report``. A
    failure (the store, a file of the hub's out of reach) is a report that it failed (the hub
    retries the close later); :class:`WorkLeaseLost` leaves as itself."""
    try:
        return KINDS[job.kind].work(job, reducer, stop=stop, pool=pool, objects=objects)
    except WorkLeaseLost:
        raise
    except Exception as exc:
        log.exception("%s lease %s failed (reducer %s)", job.kind, job.lease, reducer)
        return Done(reducer=reducer, seconds=0.0, bytes=0, error="failed", detail=repr(exc)[:MAX_DETAIL])


def _updates(
    at: _At, updates: list[UpdateSource], slices: list[SliceJob], mean: str | None, held: int
) -> list[tuple[TensorReader, float]]:
    """A lease's readers of its updates, each told what it will read: the first ``held`` (in the
    mean) only the slices not held here, the others every slice. In the bucket each run is one
    streamed GET: a stream over slices nobody reads would hold their bytes to the end."""
    every = _wire_reads(slices)
    lacking = _wire_reads(s for s in slices if mean is None or not MEANS.has(mean, s.name, s.start))
    return [
        (_opened(at, u.path, u.object, "updates", lacking if i < held else every, stream=True), u.weight)
        for i, u in enumerate(updates)
    ]


def _opened(
    at: _At, path: str | None, name: str | None, what: str, reads: list[tuple[str, int, int]], *, stream: bool = False
) -> TensorReader:
    """A file on the hub's disk (``path``), or an object in the bucket (:func:`object_reader`)."""
    if path is not None:
        if not os.path.exists(path):
            raise RuntimeError(
                f"lease {at.lease} reads {path} on the hub's disk ({what}; DiLoCo's momentum, topk's residual or "
                "a hub without a store): run this reducer on the hub's machine"
            )
        return at.files.enter_context(TensorFile(path))
    assert name is not None
    return at.files.enter_context(object_reader(at.bucket(what), name, reads, stream=stream))


def _sink(at: _At, out: Output | None, parts: list[_Part]) -> BlobWriter | _Part | None:
    """Where a lease writes an output: its range built in memory (PUT after the slices, collected
    in ``parts``), or its own descriptor of the hub's staged file."""
    if out is None:
        return None
    if out.parts:
        parts.append(_Part(out))
        return parts[-1]
    assert out.path is not None
    if not os.path.exists(out.path):
        raise RuntimeError(
            f"lease {at.lease} writes {out.path} on the hub's disk: run this reducer on the hub's machine"
        )
    fd = os.open(out.path, os.O_WRONLY)
    at.files.callback(os.close, fd)
    return BlobWriter(fd)


def object_reader(
    store: ObjectStore, name: str, reads: list[tuple[str, int, int]], *, stream: bool = False
) -> ObjectTensorFile:
    """An object as a lease reads it: in windows, never past the lease's ``reads`` into the next's;
    ``stream``: all of them read about in order (an update's), each contiguous run one streamed GET."""
    wire = ObjectTensorFile(store, name, window=0 if stream else WINDOW, stream=stream)
    wire.expect(reads)
    return wire


def _going(stop: Callable[[], bool], lease: str) -> None:
    if stop():
        raise WorkLeaseLost(f"lease {lease} was lost")


def _wire_reads(slices: Iterable[SliceJob]) -> list[tuple[str, int, int]]:
    """What the slices read of a file in their codec (for :meth:`ObjectTensorFile.expect`)."""
    return [
        (wire_name(s.name, suffix), first, first + count) for s in slices for suffix, (first, count) in s.parts.items()
    ]


def highest(peaks: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Each tensor's largest peak over its slices (or over leases)."""
    out: dict[str, float] = {}
    for name, peak in peaks:
        out[name] = max(out.get(name, 0.0), peak)
    return out
