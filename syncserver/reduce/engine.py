"""The merge engine: fold updates, merge a round, build versions. Tensor work only: no HTTP, no
*when* (:mod:`syncserver.core.policy`); files through :class:`~syncserver.storage.store.Store` keys.

Everything works a slice at a time (:func:`syncwire.codecs.slices`: a few MB read with ``pread``, a
few MB of temporaries) on one small thread pool: numpy, ``pread`` and ``pwrite`` release the GIL.
A round (weights and divisor are the policy's: docs/concepts/rounds.md)::

    mean    = running weighted mean of decode(u) over acknowledged updates u, in acknowledgement
              order (float32; those unfolded at the close are folded by the merge, slice by slice)
    mean    = mean * (sum of the weights / total)       (1 for a barrier: its total is that sum)
    result  = encode(outer_step(mean, momentum) + residual(v))              -> ResultKey(v)
    v + 1   = version v + decode(result)                                    -> VersionKey(v + 1)

``residual(v)``, for a ``hub_feedback`` codec only (``topk`` sends a quarter of the update): what
result v-1 left out, the hub's error feedback (``ResidualKey``, float32 beside the momentum: hub
memory stays O(1) models, and a restarted hub goes on from the committed version's). Every peer
applies the same decoded bytes, so all hold version v + 1 bit for bit. The merge checks each slice's
new momentum and version v + decode(result) finite before the result is written whole
(:class:`NonFinite` otherwise: nothing is kept).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from syncserver.reduce import aggregate
from syncserver.storage.bucket import object_name
from syncserver.storage.objectfile import WINDOW, ObjectTensorFile, TensorReader
from syncserver.storage.s3 import ObjectStore
from syncserver.storage.store import Key, Missing, MomentumKey, ResidualKey, ResultKey, Store, UpdateKey, VersionKey
from syncwire import Codec, FormatError, Schema, get_codec, layout_bytes, wire_layout, wire_name
from syncwire.codecs import Layout, slices
from syncwire.format import encode_header

__all__ = [
    "Accumulator",
    "Into",
    "Merge",
    "MergeEngine",
    "NonFinite",
    "Outer",
    "Resident",
    "RoundMerge",
    "Step",
    "apply_slice",
    "fold_slice",
    "merge_slice",
    "run_slices",
    "version_layout",
]

Work = Callable[[str, int, int, dict[str, tuple[int, int]]], None]
#: where a merge's outputs go: called with a key and the file's size, a context whose value takes the header
Into = Callable[[Key, int], AbstractContextManager[Any]]

#: ``|a| + |b| <= SAFE`` for float32 values a and b: their float32 sum is finite (rounded, it is at
#: most ``2^127``, half of what float32 holds)
SAFE = 2.0**127


@dataclass(frozen=True)
class Outer:
    """The outer optimizer of a run."""

    kind: str  # "avg" or "diloco"
    lr: float
    momentum: float
    warmup: int = 0  # diloco: outer steps over which momentum ramps up (aggregate.warmup); 0: none


class _Stopped(Exception):
    """A first fold was told to stop (see :meth:`MergeEngine.fold`)."""


class NonFinite(ArithmeticError):
    """A round's merge would make a value that is not finite (the new version or momentum)."""


@dataclass(frozen=True)
class Resident:
    """A round's mean folded ahead, in the reducers' memory under ``id`` (never written); ``updates``:
    the ones it holds, in order (a slice not held is folded from them again, to the same bits);
    ``holders``: who holds each slice ((tensor, first value) -> reducer), offered its next lease."""

    id: str
    updates: tuple[tuple[UpdateKey, float], ...]
    holders: dict[tuple[str, int], str] = field(default_factory=dict)


@dataclass
class Accumulator:
    """The open round's running weighted mean of the folded updates and their weights' sum: in
    the hub's memory (``mean``) or, with reducers, in theirs (``partial``, ``FoldAhead``)."""

    schema: Schema
    mean: dict[str, np.ndarray] | None = None  # allocated at the first fold
    folded: list[str] = field(default_factory=list)  # peers, in fold (= acknowledgement) order
    weight: float = 0.0  # the folded updates' weights, summed (exact: at most 2^53, whole for a barrier)
    partial: Resident | None = None  # the reducers': the mean of ``folded`` (then ``mean`` stays None)


@dataclass(frozen=True)
class RoundMerge:
    """A round's merge as the close fixes it. ``unfolded``: updates the merge folds after ``acc``, in
    order; ``total``: the policy's divisor; ``fraction``: the part of an outer step this round is
    (Delayed Nesterov's clock; a barrier round: ``inf``); ``final``: every update is its peer's last
    (plain averaging, the momentum passes on); ``bound``: on ``|version v|`` per tensor, if known."""

    run: str
    round: int
    acc: Accumulator
    codec: Codec
    outer: Outer
    total: float
    fraction: float
    final: bool = False
    unfolded: Sequence[tuple[UpdateKey, float]] = ()
    bound: dict[str, float] | None = None


class MergeEngine:
    """Fold, merge and version building for every run of one hub, on one slice pool."""

    def __init__(self, store: Store, threads: int, objects: ObjectStore | None = None) -> None:
        self.store = store
        self.threads = threads
        self.objects = objects  # SYNC_STORE: where the updates peers uploaded there are read
        # one pool for every round: fresh threads got fresh malloc arenas, and the hub's memory crept up
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="syncserver-slices")
        # run -> (v, version v's momentum metadata) as the last merge wrote it: read only after a restart
        self._clocks: dict[str, tuple[int, dict[str, str]]] = {}

    def close(self) -> None:
        self._pool.shutdown()

    def open_update(self, key: UpdateKey) -> TensorReader:
        """An acknowledged update: its file on the hub's disk, or its object (``key.object``),
        read with ranged GETs a slice at a time. Close it."""
        if key.object is None:
            return self.store.read(key)
        return self._object(key.object, key.size, f"update {key.peer!r} of round {key.round}")

    def _object(self, name: str, size: int | None, what: str) -> ObjectTensorFile:
        if self.objects is None:
            raise Missing(f"{what} is in an object store: start the hub with it")
        return ObjectTensorFile(self.objects, name, size, window=WINDOW)

    def _update(self, files: contextlib.ExitStack, key: UpdateKey) -> TensorReader:
        wire = self.open_update(key)
        files.callback(wire.close)
        return wire

    def _opened(
        self, files: contextlib.ExitStack, key: VersionKey | MomentumKey | ResidualKey, *, shared: bool = False
    ) -> TensorReader | None:
        """Version v, or its momentum or residual (None: not made yet), on the hub's disk or else in
        the bucket; ``shared``: the bucket's copy first (version 0, uploaded for the reducers: a
        lease naming the hub's file would fail on a reducer of another machine)."""
        if self.store.exists(key) and not (shared and self.store.stored_object(key) is not None):
            return files.enter_context(self.store.read(key))
        if not isinstance(key, VersionKey) and self.store.stored_object(key) is None:
            return None
        return files.enter_context(self._object(object_name(key), None, str(key)))

    @staticmethod
    def norm(wire: TensorReader, codec: Codec, schema: Schema) -> float:
        """An update's decoded L2 norm (the norm guard), a slice at a time; static: a reducer's
        check (:mod:`syncserver.reduce.check`) takes it too."""
        return aggregate.global_norm(
            codec.decode(_read_parts(wire, name, parts), (stop - start,))
            for name, shape in schema.items()
            for start, stop, parts in slices(codec, shape)
        )

    def fold(
        self, acc: Accumulator, key: UpdateKey, weight: float, codec: Codec, *, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Fold one update, times ``weight``, into ``acc``; True once folded. ``stop`` (a first fold
        only) is asked before each slice: once it says so ``acc`` is left empty (False), and a round
        closing meanwhile folds every update in its merge instead of waiting for this one, whose
        first touch of the accumulator alone costs half a GB of fresh pages for GPT-2."""
        if stop is not None and acc.folded:
            raise ValueError("only a first fold can be stopped: a stopped fold leaves the accumulator empty")
        if acc.mean is None:
            acc.mean = {name: np.zeros(shape, np.float32) for name, shape in acc.schema.items()}
        mean, before = acc.mean, acc.weight
        with self.open_update(key) as wire:

            def fold(name: str, start: int, stop_: int, parts: dict[str, tuple[int, int]]) -> None:
                if stop is not None and stop():
                    raise _Stopped
                decoded = codec.decode(_read_parts(wire, name, parts), (stop_ - start,))
                aggregate.fold(mean[name].reshape(-1)[start:stop_], decoded, weight, before)

            try:
                self._each_slice(codec, acc.schema, fold)
            except _Stopped:
                acc.mean = None  # part folded: dropped, and acc is as it was, empty
                return False
        acc.folded.append(key.peer)
        acc.weight += weight
        return True

    def peak(self, key: UpdateKey, codec: Codec, schema: Schema) -> float:
        """An update's largest decoded magnitude (which update a non-finite merge goes without;
        rare, so not kept from the fold)."""
        peaks: list[float] = []
        with self.open_update(key) as wire:

            def peak(name: str, start: int, stop: int, parts: dict[str, tuple[int, int]]) -> None:
                decoded = codec.decode(_read_parts(wire, name, parts), (stop - start,))
                peaks.append(float(np.max(np.abs(decoded), initial=0.0)))  # list.append: atomic

            self._each_slice(codec, schema, peak)
        return max(peaks, default=0.0)

    def merge(self, m: RoundMerge) -> int:
        """Write round ``m.round``'s result and DiLoCo momentum; return the result's size (version
        v+1 comes after the commit, :meth:`build_versions`: docs/concepts/rounds.md says why).
        ``m.unfolded`` are folded after ``m.acc`` slice by slice, ``acc`` left as it was: the close
        is the one time every peer waits, and an update acknowledged just before it would
        otherwise be read, folded and read back; here it costs one read, and a round with nothing
        folded before needs no accumulator. The same folds in the same order: the same bits.
        The momentum's metadata keeps the clock ``m.fraction`` advances and the whole outer steps
        DiLoCo's warm-up counts. :class:`NonFinite`: nothing written. Nothing folded: a zero result.
        The momentum is read with ``pread`` (a mapping would count in the RSS); each slice's
        writeback starts once written, so the fsyncs before the commit wait for the last few."""
        if m.unfolded and m.final and not m.codec.lossless:
            # a final round's fp32 result is cut unlike its lossy updates: they are folded into acc first
            for key, w in m.unfolded:
                self.fold(m.acc, key, w, m.codec)
            m = dataclasses.replace(m, unfolded=())
        with contextlib.ExitStack() as files:
            merge = self.open_merge(files, m)
            self._each_slice(get_codec(merge.step.codec), m.acc.schema, functools.partial(merge_slice, merge, m.acc))
        return merge.result_size

    def open_merge(self, files: contextlib.ExitStack, m: RoundMerge, into: Into | None = None) -> Merge:
        """Everything the merge needs but its slices, entered on ``files`` (leaving it publishes the
        outputs, an error discards them): the step fixed once for the round (scale, DiLoCo's clock
        and warm-up), the files it reads, the outputs with their headers. The hub's threads and
        the reducers' leases both work from it with :func:`merge_slice`. ``into``: where the
        outputs go instead of staged files (``merge_leased``'s parts of a multipart upload);
        version v is then read from the bucket if it is there. ``m.bound`` (the peaks round v-1's
        leases and version v's build reported): a slice whose ``bound + max|decode(result)|``
        stays under :data:`SAFE` cannot overflow, so its check reads no version v."""
        run, v, acc, codec, outer = m.run, m.round, m.acc, m.codec, m.outer
        total, fraction, final, unfolded = m.total, m.fraction, m.final, m.unfolded
        schema = acc.schema
        empty = acc.mean is None and acc.partial is None and not unfolded  # every update was left out
        if not empty and not total > 0:
            raise ValueError(f"round {v} of run {run!r}: total {total} must be positive")
        weight = acc.weight
        for _, w in unfolded:
            weight += w  # summed as Accumulator.weight is, fold by fold
        # the running mean is sum(w u) / sum(w); the policy divides sum(w u) by ``total``. For a
        # barrier the two are the same float (the same integers summed): scale 1, the very same bits
        scale = None if empty or weight == total else float(np.float32(weight / total))
        diloco = outer.kind == "diloco"
        # a final round's result is lossless: the model the run ends with carries no
        # quantisation error of it (the peers flush their own residual with a last round)
        run_codec, codec = codec, get_codec("fp32") if final else codec
        meta = {"round": str(v), "version": str(v + 1), "codec": codec.spec}
        result_head, result_at, result_size = _file(wire_layout(codec, schema), meta)
        old_momentum = self._opened(files, MomentumKey(run, v)) if diloco else None
        # the reducers' leases (``into``) read version v where any reducer can: in the bucket
        base = self._opened(files, VersionKey(run, v), shared=into is not None)
        assert base is not None  # a version is on the disk or else in the bucket
        # Delayed Nesterov's clock: the part of an outer step done before this round, in the metadata
        # of version v's momentum as the last merge left it (an object's header is read after a restart)
        known = self._clocks.get(run)
        if known is not None and known[0] == v and isinstance(old_momentum, ObjectTensorFile):
            clock = known[1]
        else:
            clock = old_momentum.metadata if old_momentum is not None else {}
        done, steps = float(clock.get("progress", "0")), int(clock.get("steps", "0"))
        fresh, complete = done == 0.0, done + fraction >= 1.0
        lr, mu = aggregate.warmup(outer.lr, outer.momentum, steps, outer.warmup)
        if empty or final:  # the clock stands still
            progress = done
        else:
            progress, steps = (0.0, steps + 1) if complete else (done + fraction, steps)
        momentum_meta = {"version": str(v + 1), "progress": repr(progress), "steps": str(steps)}
        if diloco:
            self._clocks[run] = (v + 1, momentum_meta)
        momentum_head, momentum_at, momentum_size = _fp32(schema, momentum_meta)
        write = into or self.store.write

        def output(key: Key, head: bytes, size: int) -> Any:
            out = files.enter_context(write(key, size))
            out.write(head)
            return out

        result = output(ResultKey(run, v), result_head, result_size)
        mom = output(MomentumKey(run, v + 1), momentum_head, momentum_size) if diloco else None
        # the hub's error feedback (hub_feedback codecs): none before a first result; a final one leaves none
        old_residual = self._opened(files, ResidualKey(run, v)) if run_codec.hub_feedback else None
        residual: Sink | None = None
        residual_at: dict[str, int] = {}
        if run_codec.hub_feedback and not final:
            residual_head, residual_at, residual_size = version_layout(schema, v + 1)
            residual = output(ResidualKey(run, v + 1), residual_head, residual_size)
        step = Step(
            round=v,
            outer=outer.kind,
            kind="avg" if final else outer.kind,
            lr=lr,
            mu=mu,
            fresh=fresh,
            complete=complete,
            scale=scale,
            empty=empty,
            codec=codec.spec,
            run_codec=run_codec.spec,
        )
        return Merge(
            step=step,
            base=base,
            mean=acc.partial.id if acc.partial is not None else None,
            held=len(acc.partial.updates) if acc.partial is not None else 0,
            folded=acc.weight,
            # a reducer lacking a slice of the mean folds it again from every update
            updates=[
                (self._update(files, key), w)
                for key, w in [*(acc.partial.updates if acc.partial is not None else ()), *unfolded]
            ],
            momentum=old_momentum,
            residual=old_residual,
            result=result,
            result_at=result_at,
            next_momentum=mom,
            momentum_at=momentum_at if diloco else {},
            next_residual=residual,
            residual_at=residual_at,
            result_size=result_size,
            bound=m.bound,
        )

    def build_versions(self, run: str, target: int, codec: Codec, schema: Schema) -> None:
        """Write every missing version up to ``target``: ``version j+1 = version j + decode(result j)``,
        each result decoded with the codec it names (a final round's is fp32)."""
        first = max((v for v in self.store.versions(run) if v <= target), default=0)
        for v in range(first, target):
            self._next_version(run, v, codec, schema)

    def _next_version(self, run: str, v: int, codec: Codec, schema: Schema) -> None:
        head, at, size = version_layout(schema, v + 1)
        with contextlib.ExitStack() as files:
            current = files.enter_context(self.store.read(VersionKey(run, v)))
            result = files.enter_context(self.store.read(ResultKey(run, v)))
            codec = get_codec(result.metadata.get("codec", codec.spec))
            version = files.enter_context(self.store.write(VersionKey(run, v + 1), size))
            version.write(head)

            def add(name: str, start: int, stop: int, parts: dict[str, tuple[int, int]]) -> None:
                version.write_at(apply_slice(current, result, codec, name, start, stop, parts), at[name] + start * 4)

            self._each_slice(codec, schema, add)

    def _each_slice(self, codec: Codec, schema: Schema, work: Work) -> None:
        """``work(name, start, stop, parts)`` for every slice, on the pool (one thread left cores idle
        while every peer waited); slices touch only their own values: the same bytes in any order."""
        jobs = [(name, *piece) for name, shape in schema.items() for piece in slices(codec, shape)]
        run_slices(self._pool if self.threads > 1 else None, jobs, work)


def run_slices(pool: ThreadPoolExecutor | None, jobs: Sequence[tuple[Any, ...]], work: Callable[..., None]) -> None:
    """``work(*job)`` for every job, on ``pool`` (None: here, in order); the first failure is
    raised once nothing runs any more (a failed merge's files are discarded right after)."""
    if pool is None or len(jobs) == 1:
        for job in jobs:
            work(*job)
        return
    futures = [pool.submit(work, *job) for job in jobs]
    try:
        for future in futures:
            future.result()  # re-raises the first failure
    finally:
        for future in futures:
            future.cancel()  # after a failure: the rest is moot (a cancelled round starts over)
        wait(futures)  # nothing may still write to the files the caller is about to discard


class Sink(Protocol):
    """Where a merge writes an output's values (a staged file's writer, or a lease's parts)."""

    def write_at(self, array: np.ndarray, position: int) -> None: ...


@dataclass(frozen=True)
class Step:
    """What a round's merge does to every slice, fixed once by the hub (sent as it is in each
    merge lease)."""

    round: int  # the version merged from
    outer: str  # the run's outer optimizer ("avg" or "diloco")
    kind: str  # the step applied: "avg" for a final round, else ``outer``
    lr: float  # after DiLoCo's warm-up
    mu: float
    fresh: bool  # Delayed Nesterov's clock (see aggregate.outer_step)
    complete: bool
    scale: float | None  # a float32 value: the weights' sum over the policy's total; None: 1
    empty: bool  # every update was left out: the round changes nothing
    codec: str  # the result's codec (fp32 for a final round)
    run_codec: str  # the updates' codec


@dataclass
class Merge:
    """One round's merge, open (:meth:`MergeEngine.open_merge`); ``*_at``: each wire tensor's byte
    offset in its output."""

    step: Step
    base: TensorReader  # version v
    updates: list[tuple[TensorReader, float]]  # folded in this order, with these weights
    momentum: TensorReader | None  # DiLoCo's, that goes with version v
    residual: TensorReader | None  # the hub's error feedback (topk), that goes with version v
    result: Sink
    result_at: dict[str, int]
    next_momentum: Sink | None
    momentum_at: dict[str, int]
    next_residual: Sink | None
    residual_at: dict[str, int]
    result_size: int = 0
    bound: dict[str, float] | None = None  # a bound on |version v| per tensor (see MergeEngine.open_merge)
    peaks: list[tuple[str, float]] | None = None  # if kept: (tensor, a bound on |version v+1|) per slice
    mean: str | None = None  # the id of the reducers' running mean folded ahead (Resident), if any
    held: int = 0  # how many of ``updates`` that mean holds (the first ones)
    folded: float = 0.0  # and their weight
    take: Callable[[str, str, int], np.ndarray | None] | None = None  # a reducer's: its slice of a mean, if held


def merge_slice(
    merge: Merge,
    acc: Accumulator | None,
    name: str,
    start: int,
    stop: int,
    parts: dict[str, tuple[int, int]],
    out_parts: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Merge values ``[start, stop)`` of ``name`` (fold after ``acc``'s mean, step, add the residual,
    encode, write), or :class:`NonFinite`. ``parts``/``out_parts``: where the slice lies in the
    updates' wire parts and the result's (None: the same; a lease's final round of a lossy codec:
    at the values' own places). The one body of every merge, hub or reducer: same inputs, same bits."""
    step, n = merge.step, stop - start
    codec, run_codec = get_codec(step.codec), get_codec(step.run_codec)
    diloco = step.outer == "diloco"
    m_old = merge.momentum.read(name, start, stop) if merge.momentum is not None else None
    if m_old is None and diloco:
        m_old = np.zeros(n, np.float32)
    if step.empty:  # every update was left out: this round changes nothing
        update, m_new = np.zeros(n, np.float32), m_old
    else:
        updates = merge.updates
        held: np.ndarray | None
        if acc is not None and acc.mean is not None:  # the hub's own accumulator: left as it is
            held, before, own = acc.mean[name].reshape(-1)[start:stop], acc.weight, False
        else:  # the reducers' running mean, if this reducer holds the slice: its own to change
            held = merge.take(merge.mean, name, start) if merge.mean is not None and merge.take else None
            before, own = (merge.folded, True) if held is not None else (0.0, False)
            if held is not None:
                updates = updates[merge.held :]
        mean = fold_slice(name, start, stop, parts, held, before, updates, run_codec, own=own)
        if step.scale is not None:
            with np.errstate(over="ignore"):  # an overflow is refused below
                mean = mean * np.float32(step.scale)
        update, m_new = aggregate.outer_step(
            step.kind, mean, m_old, lr=step.lr, mu=step.mu, fresh=step.fresh, complete=step.complete
        )
        if step.kind != step.outer:  # a final round of a DiLoCo run: its momentum passes on
            m_new = m_old
        if m_new is not None and not (_finite(update) and _finite(m_new)):
            raise NonFinite(f"tensor {name!r}: the outer step overflows float32")
    carried = merge.residual.read(name, start, stop) if merge.residual is not None else None
    if carried is not None and not step.empty:  # an empty round sends nothing, keeps all
        with np.errstate(over="ignore"):
            update = update + carried
        if not _finite(update):
            raise NonFinite(f"tensor {name!r}: the update and the hub's residual overflow float32")
    encoded = codec.encode(update)
    applied = update if codec.lossless else codec.decode(encoded, (n,))
    if merge.next_residual is not None:  # what this result leaves out, for the next one
        left = carried if step.empty and carried is not None else update - applied
        merge.next_residual.write_at(np.ascontiguousarray(left, np.float32), merge.residual_at[name] + start * 4)
    # what every peer will hold, version v + decode(result), must be finite: under a known bound
    # it is (a NaN fails the comparison); else version v is read and the sum checked
    known = merge.bound.get(name) if merge.bound is not None else None
    peak = known + float(np.max(np.abs(applied), initial=0.0)) if known is not None else None
    if peak is None or not peak <= SAFE:
        new = merge.base.read(name, start, stop)
        with np.errstate(over="ignore"):  # an overflow is refused just below
            np.add(new, applied, out=new)
        if not _finite(new):
            raise NonFinite(f"tensor {name!r}: version {step.round} + this round's update overflows float32")
        peak = float(np.max(np.abs(new), initial=0.0)) if merge.peaks is not None else None
    if merge.peaks is not None and peak is not None:
        merge.peaks.append((name, peak))  # list.append: atomic across the pool's threads
    for suffix, (first, count) in (parts if out_parts is None else out_parts).items():
        part = np.ascontiguousarray(encoded[suffix]).reshape(-1)
        if part.size != count:
            raise FormatError(f"codec {codec.spec}: a slice's part {suffix!r} has {part.size} values")
        merge.result.write_at(part, merge.result_at[wire_name(name, suffix)] + first * part.itemsize)
    if merge.next_momentum is not None and m_new is not None:
        merge.next_momentum.write_at(np.ascontiguousarray(m_new, np.float32), merge.momentum_at[name] + start * 4)


def apply_slice(
    base: TensorReader,
    result: TensorReader,
    codec: Codec,
    name: str,
    start: int,
    stop: int,
    parts: dict[str, tuple[int, int]],
) -> np.ndarray:
    """Values ``[start, stop)`` of ``name`` in version v+1: version v's plus the result's, decoded
    with ``codec`` (``parts``: where they lie in it); the hub's versions and the build leases alike."""
    new = base.read(name, start, stop)
    np.add(new, codec.decode(_read_parts(result, name, parts), (stop - start,)), out=new)
    return new


def version_layout(schema: Schema, version: int) -> tuple[bytes, dict[str, int], int]:
    """A version file's header, each tensor's byte offset in it, and its size."""
    return _fp32(schema, {"version": str(version)})


def fold_slice(
    name: str,
    start: int,
    stop: int,
    parts: dict[str, tuple[int, int]],
    held: np.ndarray | None,
    before: float,
    updates: Sequence[tuple[TensorReader, float]],
    codec: Codec,
    *,
    own: bool = False,
) -> np.ndarray:
    """One slice of the mean: ``held`` (weighing ``before``; None: none yet) with ``updates`` folded
    after it, in order; into a copy unless ``own``, so the hub's accumulator stays as it was for a
    merge refused and tried again. The same updates in the same order give the same bits, however
    many each call folds."""
    mean, copied = held, own
    for wire, weight in updates:
        decoded = codec.decode(_read_parts(wire, name, parts), (stop - start,))
        if mean is None:  # the first fold: the mean *is* the update
            mean, copied = np.array(decoded, np.float32), True
        else:
            if not copied:
                mean, copied = mean.copy(), True
            aggregate.fold(mean, decoded, weight, before)
        before += weight
    if mean is None:
        raise ValueError(f"tensor {name!r}: a merge with no update to fold is an empty one")
    return mean


def _finite(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).all())


def _read_parts(wire: TensorReader, name: str, parts: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """One slice of tensor ``name``'s wire parts (``parts``: suffix -> (first value, count))."""
    return {
        suffix: wire.read(wire_name(name, suffix), first, first + count) for suffix, (first, count) in parts.items()
    }


def _fp32(schema: Schema, meta: dict[str, str]) -> tuple[bytes, dict[str, int], int]:
    """:func:`_file` of a float32 file of ``schema`` (a version, a momentum, a residual)."""
    return _file({name: ("F32", shape) for name, shape in schema.items()}, meta)


def _file(layout: Layout, meta: dict[str, str]) -> tuple[bytes, dict[str, int], int]:
    """A safetensors header for ``layout``, each tensor's byte offset in the file, and its size."""
    head, infos = encode_header(((name, dtype, shape) for name, (dtype, shape) in layout.items()), meta)
    return head, {i.name: len(head) + i.start for i in infos}, len(head) + layout_bytes(layout)
