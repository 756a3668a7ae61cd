"""The merge engine: fold updates, merge a round, build versions. Tensor work only.

Everything here runs in worker threads and works a slice at a time
(:func:`syncwire.codecs.slices`): reads are ``pread`` of a few MB, temporaries stay a few MB,
and the slices of a step are spread over one small thread pool, since numpy, ``pread`` and
``pwrite`` release the GIL. Nothing here decides *when* (that is :mod:`syncserver.core.policy`)
or touches HTTP; files are reached through :class:`~syncserver.storage.store.Store` keys.

A round's arithmetic (the weights and the divisor are the round policy's: samples and their
sum for a barrier, samples discounted by staleness over ``round_samples`` for async)::

    mean    = running weighted mean of decode(u) over acknowledged updates u,
              folded in acknowledgement order                               (float32, O(1) models)
              (those still unfolded when the round closes are folded by the merge, slice by slice)
    mean    = mean * (sum of the weights / total)       (1 for a barrier: its total is that sum)
    result  = encode(outer_step(mean, momentum))                            -> ResultKey(v)
    v + 1   = version v + decode(result)                                    -> VersionKey(v + 1)

A codec with ``hub_feedback`` (``topk``: a result sends a quarter of the merged update) gets
error feedback on the hub too, as peers keep it for their uploads: the result encodes
``outer_step(...) + residual(v)`` and ``residual(v + 1)`` is what that result left out
(``ResidualKey``, float32 on disk beside the momentum, read with ``pread``: hub memory stays
O(1) models, and a restarted hub goes on from the committed version's residual).

The hub and every peer apply the same decoded bytes, so all of them hold version v + 1 bit for bit.
The merge checks, slice by slice, that the new momentum and version v + decode(result) are
finite before the result is written whole; :class:`NonFinite` otherwise, and nothing is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from syncserver.reduce import aggregate
from syncserver.storage.bucket import object_name
from syncserver.storage.objectfile import WINDOW, ObjectTensorFile, TensorReader
from syncserver.storage.s3 import ObjectStore
from syncserver.storage.store import (
    Key,
    Missing,
    MomentumKey,
    ResidualKey,
    ResultKey,
    Store,
    UpdateKey,
    VersionKey,
)
from syncwire import Codec, FormatError, Schema, get_codec, layout_bytes, wire_layout, wire_name
from syncwire.codecs import slices
from syncwire.format import encode_header

__all__ = [
    "Accumulator",
    "Merge",
    "MergeEngine",
    "NonFinite",
    "Outer",
    "Resident",
    "RoundMerge",
    "SAFE",
    "Sink",
    "Step",
    "apply_slice",
    "fold_slice",
    "merge_slice",
    "run_slices",
    "version_layout",
]

Work = Callable[[str, int, int, dict[str, tuple[int, int]]], None]

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
    """A round's running mean as the reducers fold it ahead: held in their memory, slice by
    slice, under ``id`` (:data:`syncserver.reduce.lease.MEANS`), never written anywhere.
    ``updates``: the updates it holds (their keys and weights), in fold order: a lease whose
    reducer lacks a slice of it folds that slice from them again, to the same bits.
    ``holders``: which reducer holds each slice ((tensor, first value) -> name), so that the
    next lease over it is offered to that reducer first."""

    id: str
    updates: tuple[tuple[UpdateKey, float], ...]
    holders: dict[tuple[str, int], str] = field(default_factory=dict)


@dataclass
class Accumulator:
    """The open round's running weighted mean of ``decode(update)`` over folded updates
    (:func:`syncserver.reduce.aggregate.fold`), and the sum of the weights it holds: in the
    hub's memory (``mean``), or, with reducers, in theirs (``partial``,
    :class:`syncserver.core.leases.FoldAhead`)."""

    schema: Schema
    mean: dict[str, np.ndarray] | None = None  # allocated at the first fold
    folded: list[str] = field(default_factory=list)  # peers, in fold (= acknowledgement) order
    weight: float = 0.0  # the folded updates' weights, summed (exact: at most 2^53, whole for a barrier)
    partial: Resident | None = None  # the reducers': the mean of ``folded`` (then ``mean`` stays None)


@dataclass(frozen=True)
class RoundMerge:
    """A round's merge as the close fixes it: what :meth:`MergeEngine.merge`, :meth:`MergeEngine.open_merge`
    and the reducers' :func:`~syncserver.core.leases.merge_leased` all take.

    ``acc``: the updates folded before the close; ``unfolded``: those not in it yet (and their
    weights), folded after it in this order by the merge itself. ``total``: the policy's
    divisor of the weighted sum. ``fraction``: how much of a whole outer step this round is
    (Delayed Nesterov's clock; a barrier round is a whole one, ``inf``). ``final``: every
    update is its peer's last, so the round is plain averaging and the momentum passes on
    unchanged. ``bound``: a bound on ``|version v|`` per tensor, if known
    (:meth:`MergeEngine.open_merge`)."""

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
        # the same few threads fold and merge every round: fresh threads each round would each
        # get a fresh malloc arena, and the hub's memory crept up round after round
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="syncserver-slices")
        # run -> (v, the metadata of the momentum that goes with version v) as the last merge
        # wrote it: a momentum in the bucket is then not read for its clock (only after a restart)
        self._clocks: dict[str, tuple[int, dict[str, str]]] = {}

    def close(self) -> None:
        self._pool.shutdown()

    # ---- per update ----------------------------------------------------------------------
    def open_update(self, key: UpdateKey) -> TensorReader:
        """An acknowledged update, wherever it lives: its file on the hub's disk, or its object
        in the store (``key.object``), read with ranged GETs a slice at a time. Close it."""
        if key.object is None:
            return self.store.read(key)
        return self._object(key.object, key.size, f"update {key.peer!r} of round {key.round}")

    def _object(self, name: str, size: int | None, what: str) -> ObjectTensorFile:
        if self.objects is None:
            raise Missing(f"{what} is in an object store: start the hub with it")
        return ObjectTensorFile(self.objects, name, size, window=WINDOW)

    def _update(self, files: contextlib.ExitStack, key: UpdateKey) -> TensorReader:
        """:meth:`open_update`, closed with ``files``."""
        wire = self.open_update(key)
        files.callback(wire.close)
        return wire

    def _opened(
        self, files: contextlib.ExitStack, key: VersionKey | MomentumKey | ResidualKey, *, shared: bool = False
    ) -> TensorReader | None:
        """Version v, or the momentum or residual that goes with it, closed with ``files``: on the
        hub's disk, or else in the bucket (written there by the reducers that merged the round
        before); None for a momentum or residual not made yet. ``shared``: the bucket's copy first
        (version 0, uploaded for the reducers: a lease that named the hub's file would fail on a
        reducer of another machine)."""
        if self.store.exists(key) and not (shared and self.store.stored_object(key) is not None):
            return files.enter_context(self.store.read(key))
        if not isinstance(key, VersionKey) and self.store.stored_object(key) is None:
            return None
        wire = self._object(object_name(key), None, str(key))
        files.callback(wire.close)
        return wire

    @staticmethod
    def norm(wire: TensorReader, codec: Codec, schema: Schema) -> float:
        """An update's L2 norm as decoded (for the norm guard), a slice at a time like the fold.
        Static: a check that runs off the hub (:mod:`syncserver.reduce.check`) takes it too."""
        return aggregate.global_norm(
            codec.decode(_read_parts(wire, name, parts), (stop - start,))
            for name, shape in schema.items()
            for start, stop, parts in slices(codec, shape)
        )

    def fold(
        self, acc: Accumulator, key: UpdateKey, weight: float, codec: Codec, *, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Fold one acknowledged update, times ``weight``, into ``acc``, a slice at a time;
        True once it is folded.

        The file is read with ``pread`` a few MB at a time and decoded slice by slice, so
        folding holds one slice of temporaries, whatever the model's size.

        ``stop``, for a first fold only (nothing in ``acc`` yet), is asked before each slice:
        once it says so the fold gives up, leaves ``acc`` empty and returns False. A round that
        closes while its first update is being folded (its peers finished together) then folds
        every update within its merge (:meth:`merge`'s ``unfolded``) instead of waiting: a
        first fold also costs the accumulator's first touch, half a GB of fresh pages for
        GPT-2, and nothing folded is lost by stopping it.
        """
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
        """The largest magnitude in an update as decoded (to tell which update a non-finite
        merge must go without; a rare path, so not kept from the fold)."""
        peaks: list[float] = []
        with self.open_update(key) as wire:

            def peak(name: str, start: int, stop: int, parts: dict[str, tuple[int, int]]) -> None:
                decoded = codec.decode(_read_parts(wire, name, parts), (stop - start,))
                peaks.append(float(np.max(np.abs(decoded), initial=0.0)))  # list.append: atomic

            self._each_slice(codec, schema, peak)
        return max(peaks, default=0.0)

    # ---- per round -----------------------------------------------------------------------
    def merge(self, m: RoundMerge) -> int:
        """Write round ``m.round``'s result (``outer_step(mean * weight / total)``) and DiLoCo
        momentum; return the result's size. ``m.unfolded``: updates (and their weights)
        not in ``m.acc`` yet, folded after it, in this order, slice by slice as the merge
        goes (``acc`` itself is left as it was, but for a ``final`` round of a lossy
        codec: its result is fp32, cut into other slices, so the updates are folded
        into ``acc`` first). Closing a round is the one time every peer waits on the hub,
        and the updates acknowledged just before it (every one, when the peers upload
        at the same pace) would otherwise each be read, folded into the accumulator and
        read back before the merge: folded here, each costs one read of its file, and a
        round with nothing folded before its close needs no accumulator at all. The
        same folds in the same order: the same bits as folding first.
        The clock ``m.fraction`` advances is kept in the momentum file's metadata with the count
        of whole outer steps done, which DiLoCo's warm-up reads.
        :class:`NonFinite` if version ``m.round`` + the result, or the momentum, would not be
        finite (nothing is written then; ``m.bound``: see :meth:`open_merge`). With nothing folded,
        the result is zero and the momentum and its clock stay: the round changes nothing.

        The result is the encoded global update ``U``. Version v+1 (``version v + decode(U)``,
        exactly what every peer computes from the same bytes) is not written here but after
        the commit (:meth:`build_versions`): it can always be rebuilt from version v and the
        durable result, so its 4 bytes per parameter stay off the time every peer waits.
        The momentum is read with ``pread`` (no mapping that would count in the RSS); each
        slice's writeback starts as soon as it is written, so the fsyncs before the commit
        wait for little more than the last slices.
        """
        if m.unfolded and m.final and not m.codec.lossless:
            # a final round's result is fp32, cut into slices unlike its lossy updates: they
            # are folded into ``acc`` first (the same folds in the same order)
            for key, w in m.unfolded:
                self.fold(m.acc, key, w, m.codec)
            m = dataclasses.replace(m, unfolded=())
        with contextlib.ExitStack() as files:
            merge = self.open_merge(files, m)
            self._each_slice(get_codec(merge.step.codec), m.acc.schema, functools.partial(merge_slice, merge, m.acc))
        return merge.result_size

    def open_merge(
        self,
        files: contextlib.ExitStack,
        m: RoundMerge,
        into: Callable[[Key, int], AbstractContextManager[Any]] | None = None,
    ) -> Merge:
        """Everything round ``m.round``'s merge needs but its slices (see :meth:`merge`):
        the step fixed once for the whole round (scale, DiLoCo's clock and warm-up), the files
        it reads, and the outputs it writes with their headers written, all entered on
        ``files`` (leaving it publishes the outputs; an error discards them). The in-process
        merge and the reducers' leases (:mod:`syncserver.reduce.leases`) both work from it,
        slice by slice with :func:`merge_slice`: the same step, the same files, the same bits.

        ``into``: where the result goes instead of the hub's staged file (the reducers' parts of
        a multipart upload, :func:`syncserver.core.leases.merge_leased`): called with the key and
        the file's size, it gives a context whose value takes the header (``write``); version v
        is then read from the hub's disk if it is there, else from the bucket. Version v+1 is
        built after the commit, as in-process (:func:`apply_slice`).

        ``m.bound``: a bound on ``|version v|`` per tensor, if the hub knows one (the peaks the
        leases of round v-1 and the build of version v reported): a slice whose ``bound +
        max|decode(result)|`` stays under :data:`SAFE` cannot overflow, so its check needs no
        read of version v (the version's bytes stay off a close that reads it from the bucket);
        any other slice reads version v and checks exactly, as without a bound."""
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
        result_layout = [(wire, dtype, shape) for wire, (dtype, shape) in wire_layout(codec, schema).items()]
        meta = {"round": str(v), "version": str(v + 1), "codec": codec.spec}
        result_head, result_at = _header(result_layout, meta)
        old_momentum = self._opened(files, MomentumKey(run, v)) if diloco else None
        # the reducers' leases (``into``) read version v where any reducer can: in the bucket
        base = self._opened(files, VersionKey(run, v), shared=into is not None)
        assert base is not None  # a version is on the disk or else in the bucket
        # Delayed Nesterov's clock: the part of an outer step done before this round
        clock = self._clock(run, v, old_momentum)
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
        momentum_head, momentum_at = _header(_fp32_layout(schema), momentum_meta)
        result_size = len(result_head) + layout_bytes({n: (d, s) for n, d, s in result_layout})
        write = into or self.store.write
        result = files.enter_context(write(ResultKey(run, v), result_size))
        mom = files.enter_context(write(MomentumKey(run, v + 1), _fp32_size(momentum_head, schema))) if diloco else None
        result.write(result_head)
        if mom is not None:
            mom.write(momentum_head)
        # the hub's own residual (hub_feedback codecs) goes out with a final round, which leaves none
        old_residual, residual, residual_at = self._residuals(run, v, run_codec, schema, files, write, keep=not final)
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
            momentum_at=momentum_at if mom is not None else {},
            next_residual=residual,
            residual_at=residual_at,
            result_size=result_size,
            bound=m.bound,
        )

    def _clock(self, run: str, v: int, momentum: TensorReader | None) -> dict[str, str]:
        """The metadata of the momentum that goes with version ``v`` (its clock): as the merge
        that wrote it left it, or from its header (the hub's own file; an object in the bucket
        after a restart: its header's bytes, once)."""
        if momentum is None:
            return {}
        known = self._clocks.get(run)
        if known is not None and known[0] == v and isinstance(momentum, ObjectTensorFile):
            return known[1]
        return momentum.metadata

    def _residuals(
        self,
        run: str,
        v: int,
        codec: Codec,
        schema: Schema,
        files: contextlib.ExitStack,
        write: Callable[[Key, int], AbstractContextManager[Any]],
        *,
        keep: bool = True,
    ) -> tuple[TensorReader | None, Sink | None, dict[str, int]]:
        """The hub's error feedback for round ``v`` of a ``hub_feedback`` codec: the residual
        that goes with version v (None before the first result), the writer of version v+1's
        (its header written, opened with ``write``; none unless ``keep``: a lossless result
        leaves nothing out) and its tensors' offsets. Nothing for other codecs."""
        if not codec.hub_feedback:
            return None, None, {}
        old = self._opened(files, ResidualKey(run, v))
        if not keep:
            return old, None, {}
        head, at = _header(_fp32_layout(schema), {"version": str(v + 1)})
        new = files.enter_context(write(ResidualKey(run, v + 1), _fp32_size(head, schema)))
        new.write(head)
        return old, new, at

    def build_versions(self, run: str, target: int, codec: Codec, schema: Schema) -> None:
        """Write every missing version file up to ``target`` from the last one stored and the
        rounds' results: ``version j+1 = version j + decode(result j)``, each result decoded
        with the codec it names (a final round's is fp32, see :meth:`merge`)."""
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
        """Run ``work(name, start, stop, parts)`` for every slice of every tensor, on the pool.

        Closing a round is the one time the peers all wait on the hub, and a single thread left
        the other cores idle. Slices are independent (each reads and writes only its own values
        and file offsets), so the threads give the same bytes as one thread, in any order.
        """
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
    """Where a merge writes an output's values: a :class:`~syncserver.storage.store.BlobWriter`
    in the hub, the same over a reducer's own descriptor of the hub's staged file."""

    def write_at(self, array: np.ndarray, position: int) -> None: ...


@dataclass(frozen=True)
class Step:
    """What a round's merge does to every slice, fixed once for the round by the hub (and sent,
    as it is, in each reducer's lease): every slice of a round folds and steps alike."""

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
    """One round's merge, open: its step, what it reads, what it writes (see
    :meth:`MergeEngine.open_merge`); ``*_at``: each wire tensor's byte offset in its output."""

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
    """Merge one slice of tensor ``name`` (values ``[start, stop)``): fold the updates into the
    mean (after ``acc``'s, if any), apply the outer step, add the hub's residual, encode, and
    write the slice's result parts, next momentum and next residual; check that version v +
    decode(result) is finite. ``parts``: where the slice lies in the updates' wire parts;
    ``out_parts``: in the result's (the same but for a final round of a lossy codec read by a
    reducer, whose fp32 result is written at the values' own places). The one body of every
    merge, in the hub's threads and in reducers alike: the same inputs give the same bits.
    :class:`NonFinite` if the round would make a value that is not finite."""
    step, n = merge.step, stop - start
    codec, run_codec = get_codec(step.codec), get_codec(step.run_codec)
    diloco = step.outer == "diloco"
    m_old = (
        merge.momentum.read(name, start, stop)
        if merge.momentum is not None
        else (np.zeros(n, np.float32) if diloco else None)
    )
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
    """One slice of version v+1: version v's values ``[start, stop)`` of ``name`` plus the
    decoded result's (``parts``: where they lie in the result's wire parts, ``codec`` the
    result's). The hub's version files and the reducers' build leases both add with this: what
    every peer computes from the same bytes."""
    new = base.read(name, start, stop)
    np.add(new, codec.decode(_read_parts(result, name, parts), (stop - start,)), out=new)
    return new


def version_layout(schema: Schema, version: int) -> tuple[bytes, dict[str, int], int]:
    """A version file's header, each tensor's byte offset in it, and its size."""
    head, at = _header(_fp32_layout(schema), {"version": str(version)})
    return head, at, _fp32_size(head, schema)


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
    """One slice of the round's mean: ``held``, the mean of updates weighing ``before`` in all
    (None: none yet), with ``updates`` folded after it, in this order. Into a copy unless
    ``own`` (``held`` is the caller's to change): the hub's accumulator stays as it was, for a
    merge that is refused and tried again. Every merge and the reducers' folds ahead
    (:func:`syncserver.reduce.lease.work_fold`) fold with this, as the hub's own folds do
    (:func:`~syncserver.reduce.aggregate.fold`): the same updates in the same order give the same
    bits, however many of them each call folds."""
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


def _fp32_layout(schema: Schema) -> list[tuple[str, str, tuple[int, ...]]]:
    """The layout of a version (and of a DiLoCo momentum) file: every tensor in float32."""
    return [(name, "F32", shape) for name, shape in schema.items()]


def _fp32_size(head: bytes, schema: Schema) -> int:
    """The bytes of a float32 file of ``schema`` with header ``head`` (to pick a spare to write over)."""
    return len(head) + layout_bytes({name: ("F32", shape) for name, shape in schema.items()})


def _header(layout: Iterable[tuple[str, str, tuple[int, ...]]], meta: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``layout`` and each tensor's byte offset in the file."""
    head, infos = encode_header(layout, meta)
    return head, {i.name: len(head) + i.start for i in infos}
