"""A merge lease: one span of a round's slices (:mod:`syncserver.reduce.plan`), as the hub hands
it to a reducer, and the reducer's work on it. No HTTP here and no hub state.

The hub opens the round's merge once (:meth:`MergeEngine.open_merge
<syncserver.reduce.engine.MergeEngine.open_merge>`: the step, the files it reads, the outputs
staged and pre-sized, their headers written) and describes each span as a :class:`Job`: the
step, where every input lies, and where each output tensor starts in its staged file. A
reducer (on the hub's machine: the same files) ``pread``\\ s its slices of every update (or
reads them with ranged GETs from the bucket, for updates peers uploaded there), of version v,
of the momentum and residual, and ``pwrite``\\ s its byte ranges of each output,
through :func:`~syncserver.reduce.engine.merge_slice`, the one body the hub's own
threads run: the same step and the same inputs give the same bits whoever runs a slice, and
an expired lease redone by another reducer writes the very same bytes again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from pydantic import BaseModel, ConfigDict, Field, model_validator

from syncserver.reduce.engine import Merge, NonFinite, Step, merge_slice, run_slices
from syncserver.reduce.plan import Piece, Span, multi_part, pieces, plan
from syncserver.storage.objectfile import ObjectTensorFile, TensorReader
from syncserver.storage.s3 import ObjectStore
from syncserver.storage.store import BlobWriter
from syncwire import Schema, get_codec, wire_name
from syncwire.format import TensorFile

__all__ = ["Done", "Job", "LeaseStopped", "Output", "SliceJob", "StepModel", "UpdateSource", "jobs", "work"]

MAX_DETAIL = 2000


class StepModel(BaseModel):
    """:class:`~syncserver.reduce.engine.Step`, on the wire."""

    model_config = ConfigDict(extra="forbid")
    round: int = Field(ge=0)
    outer: str
    kind: str
    lr: float
    mu: float
    fresh: bool
    complete: bool
    scale: float | None
    empty: bool
    codec: str
    run_codec: str


class SliceJob(BaseModel):
    """One slice: values ``[start, stop)`` of ``name``; ``parts``/``out_parts``: where they lie
    in the updates' wire parts and in the result's (suffix -> (first value, count))."""

    model_config = ConfigDict(extra="forbid")
    name: str
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    parts: dict[str, tuple[int, int]]
    out_parts: dict[str, tuple[int, int]]


class UpdateSource(BaseModel):
    """Where one update lies, and its weight: a file on the hub's disk (``path``) or an object
    in the hub's bucket (``object``, read with the store's credentials from the environment)."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    object: str | None = None
    weight: float

    @model_validator(mode="after")
    def _one_place(self) -> UpdateSource:
        if (self.path is None) == (self.object is None):
            raise ValueError("an update lies at a path or in an object, exactly one of them")
        return self


class Output(BaseModel):
    """A staged output file and the byte offset of each of its tensors that the lease writes."""

    model_config = ConfigDict(extra="forbid")
    path: str
    at: dict[str, int]


class Job(BaseModel):
    """A lease as the hub hands it out (``POST /v1/reduce/lease``)."""

    model_config = ConfigDict(extra="forbid")
    lease: str = Field(description="The lease's id: renew it and report it done by this id.")
    run: str
    round: int
    seconds: float = Field(description="The lease's length: renew it within this many seconds.")
    step: StepModel
    base: str = Field(description="Version v (float32), read with pread.")
    momentum: str | None = Field(description="DiLoCo's momentum of version v, if any.")
    residual: str | None = Field(description="The hub's residual of version v (topk), if any.")
    updates: list[UpdateSource] = Field(description="The updates and their weights, folded in this order.")
    slices: list[SliceJob]
    result: Output
    next_momentum: Output | None
    next_residual: Output | None
    reads: int = Field(description="Bytes of one update this lease reads.")
    writes: int = Field(description="Bytes of the result it writes.")


class Done(BaseModel):
    """A reducer's report of a lease (``POST /v1/reduce/leases/{lease}/done``)."""

    model_config = ConfigDict(extra="forbid")
    reducer: str = Field(min_length=1, max_length=128)
    seconds: float = Field(ge=0, le=86_400, description="Wall time the lease's work took.")
    bytes: int = Field(ge=0, le=2**50, description="Bytes read and written.")
    error: str | None = Field(
        None, pattern="^(non_finite|failed)$", description="non_finite: the round would not be finite; failed: other."
    )
    detail: str = Field("", max_length=MAX_DETAIL)


class LeaseStopped(Exception):
    """The reducer was told its lease is lost: the rest of its slices are moot."""


def jobs(merge: Merge, schema: Schema, k: int, *, min_writes: int = 0) -> list[Job]:
    """The leases of an open merge: its slices cut into at most ``k`` spans (:func:`plan`).
    The outputs must be :class:`BlobWriter` with paths (the local-disk store), and are
    pre-sized here, so that writers in other processes can fill any range of them."""
    step = merge.step
    codec, result_codec = get_codec(step.run_codec), get_codec(step.codec)
    items = pieces(codec, result_codec, schema)
    fp32_bytes = 4 * sum(p.stop - p.start for p in items)
    outputs = [
        (merge.result, merge.result_at, merge.result_size),
        (merge.next_momentum, merge.momentum_at, min(merge.momentum_at.values(), default=0) + fp32_bytes),
        (merge.next_residual, merge.residual_at, min(merge.residual_at.values(), default=0) + fp32_bytes),
    ]
    for writer, _, size in outputs:
        if writer is not None:
            if not isinstance(writer, BlobWriter) or writer.path is None:
                raise TypeError("a leased merge writes into staged files on this machine")
            writer.reserve(size)
    spans = plan(items, k, whole_tensors=multi_part(result_codec), min_writes=min_writes)
    return [_job(merge, items, span) for span in spans]


def _job(merge: Merge, items: list[Piece], span: Span) -> Job:
    chosen = items[span.first : span.stop]
    names = list(dict.fromkeys(p.name for p in chosen))

    def output(writer: object, at: dict[str, int], wires: list[str]) -> Output | None:
        if writer is None:
            return None
        assert isinstance(writer, BlobWriter) and writer.path is not None
        return Output(path=os.fspath(writer.path), at={w: at[w] for w in wires})

    result = output(
        merge.result, merge.result_at, list(dict.fromkeys(wire_name(p.name, s) for p in chosen for s in p.out_parts))
    )
    assert result is not None
    step = merge.step
    return Job(
        lease="",
        run="",
        round=step.round,
        seconds=0.0,
        step=StepModel(**asdict(step)),
        base=merge.base.path,
        momentum=merge.momentum.path if merge.momentum is not None else None,
        residual=merge.residual.path if merge.residual is not None else None,
        updates=[
            UpdateSource(path=f.path, weight=w) if isinstance(f, TensorFile) else UpdateSource(object=f.name, weight=w)
            for f, w in merge.updates
        ],
        slices=[
            SliceJob(name=p.name, start=p.start, stop=p.stop, parts=p.parts, out_parts=p.out_parts) for p in chosen
        ],
        result=result,
        next_momentum=output(merge.next_momentum, merge.momentum_at, names),
        next_residual=output(merge.next_residual, merge.residual_at, names),
        reads=span.reads,
        writes=span.writes,
    )


def work(
    job: Job,
    reducer: str,
    stop: Callable[[], bool] = lambda: False,
    pool: ThreadPoolExecutor | None = None,
    objects: Callable[[], ObjectStore] | None = None,
) -> Done:
    """Do a lease's slices as ``reducer``, on ``pool`` if given, as the hub's own threads do
    (``objects``: the bucket, for updates that lie there; ``stop`` is asked before each slice:
    :class:`LeaseStopped` once it says so) and say how it went:
    ``error="non_finite"`` if the round would not be finite (the hub
    then leaves an update out, as it does merging in-process); any other failure raises."""
    started = time.monotonic()
    with contextlib.ExitStack() as files:

        def read(path: str) -> TensorFile:
            return files.enter_context(TensorFile(path))

        def update(source: UpdateSource) -> TensorReader:
            if source.path is not None:
                return read(source.path)
            if objects is None:
                raise RuntimeError(
                    f"lease {job.lease} reads updates in the object store: give this reducer SYNC_STORE and the "
                    "AWS_* variables, as the hub has them"
                )
            assert source.object is not None
            wire = ObjectTensorFile(objects(), source.object)
            files.callback(wire.close)
            return wire

        def sink(out: Output | None) -> BlobWriter | None:
            if out is None:
                return None
            fd = os.open(out.path, os.O_WRONLY)
            files.callback(os.close, fd)
            return BlobWriter(fd)

        result = sink(job.result)
        assert result is not None
        merge = Merge(
            step=Step(**job.step.model_dump()),
            base=read(job.base),
            updates=[(update(source), source.weight) for source in job.updates],
            momentum=read(job.momentum) if job.momentum is not None else None,
            residual=read(job.residual) if job.residual is not None else None,
            result=result,
            result_at=job.result.at,
            next_momentum=sink(job.next_momentum),
            momentum_at=job.next_momentum.at if job.next_momentum is not None else {},
            next_residual=sink(job.next_residual),
            residual_at=job.next_residual.at if job.next_residual is not None else {},
        )

        def one(s: SliceJob) -> None:
            if stop():
                raise LeaseStopped(f"lease {job.lease} was lost")
            merge_slice(merge, None, s.name, s.start, s.stop, s.parts, s.out_parts)

        try:
            run_slices(pool, [(s,) for s in job.slices], one)
        except NonFinite as exc:
            return Done(
                reducer=reducer,
                seconds=time.monotonic() - started,
                bytes=0,
                error="non_finite",
                detail=str(exc)[:MAX_DETAIL],
            )
    values = sum(s.stop - s.start for s in job.slices)
    outputs = sum(o is not None for o in (job.next_momentum, job.next_residual))
    nbytes = job.reads * len(job.updates) + job.writes + 4 * values * (1 + outputs)
    return Done(reducer=reducer, seconds=time.monotonic() - started, bytes=nbytes)
