"""Cutting a round's merge into leases: contiguous, byte-balanced runs of slices.

A round's merge works slice by slice (:func:`syncwire.codecs.slices`, in schema order), and a
slice's cost is the bytes of every update it reads: the same few bytes from each of the N
updates. :func:`plan` cuts the slices into at most K contiguous runs (*spans*), greedily, each
as near a K-th of those bytes as the cuts allowed let it be, as TensorFlow's parameter servers
place variables by size (round-robin would put GPT-2's 154 MB embedding on one reducer with
whatever else came its way).

Contiguous, because every output of a span is then one byte range of each output file (a
tensor's wire parts are adjacent in every file the hub writes): one ``pwrite`` region per file
on local disk, one part of a multipart upload in a bucket. Where the result's codec writes a
slice into two or more wire tensors (int8/int4: values and scales; topk: values, indices,
scales), a cut inside a tensor would split its parts into two ranges each, so spans end at
tensor boundaries only; a one-part result codec (fp32, bf16, a final round's fp32) is cut at any
slice. A span whose result is under ``min_writes`` bytes (S3 wants parts of 5 MiB but the last)
is merged into its smaller neighbour. Pure functions of the codecs and the schema: the hub and
a test get the same plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from syncwire import Codec, Schema, wire_name
from syncwire.codecs import slices
from syncwire.format import DTYPES

__all__ = ["PART_MIN", "Piece", "Span", "byte_range", "imbalance", "itemsizes", "multi_part", "pieces", "plan"]

#: S3's smallest part of a multipart upload but the last: a lease's output is one part.
PART_MIN = 5 * 1024**2


@dataclass(frozen=True)
class Piece:
    """One slice of a round's merge: values ``[start, stop)`` of tensor ``name``, where they lie
    in the updates' wire parts (``parts``) and in the result's (``out_parts``), and the bytes of
    one update it reads and of the result it writes."""

    name: str
    start: int
    stop: int
    parts: dict[str, tuple[int, int]]
    out_parts: dict[str, tuple[int, int]]
    reads: int
    writes: int


@dataclass(frozen=True)
class Span:
    """Pieces ``[first, stop)`` of a plan, merged by one lease; ``reads``/``writes``: their sums."""

    first: int
    stop: int
    reads: int
    writes: int


def multi_part(codec: Codec) -> bool:
    """Does ``codec`` write a slice into two wire tensors or more (then spans end at tensors)?"""
    return len(codec.layout((1,))) > 1


def itemsizes(codec: Codec) -> dict[str, int]:
    return {suffix: DTYPES[dtype].itemsize for suffix, (dtype, _) in codec.layout((1,)).items()}


def pieces(codec: Codec, result_codec: Codec, schema: Schema) -> list[Piece]:
    """Every slice of a round whose updates are in ``codec`` and whose result is in
    ``result_codec`` (``codec`` itself, or fp32 for a final round), in schema order. Slices are
    ``codec``'s (the updates are decoded a slice at a time); a different result codec is a
    one-part lossless one (fp32), whose part of a slice lies at the slice's own values."""
    if result_codec.spec != codec.spec and multi_part(result_codec):
        raise ValueError(f"a result codec other than the updates' must have one part, not {result_codec.spec}")
    read_sizes, write_sizes = itemsizes(codec), itemsizes(result_codec)
    out: list[Piece] = []
    for name, shape in schema.items():
        for start, stop, parts in slices(codec, shape):
            out_parts = (
                parts if result_codec.spec == codec.spec else {suffix: (start, stop - start) for suffix in write_sizes}
            )
            out.append(
                Piece(
                    name,
                    start,
                    stop,
                    parts,
                    out_parts,
                    sum(count * read_sizes[s] for s, (_, count) in parts.items()),
                    sum(count * write_sizes[s] for s, (_, count) in out_parts.items()),
                )
            )
    return out


def plan(items: list[Piece], k: int, *, whole_tensors: bool, min_writes: int = 0) -> list[Span]:
    """Cut ``items`` into at most ``k`` contiguous spans balanced by the bytes they read.

    Greedy: the j-th cut goes to the allowed cut nearest to j/k of the bytes (a tensor boundary
    if ``whole_tensors``, else any slice). Then every span that writes under ``min_writes``
    bytes joins its smaller neighbour, until none does or one span is left."""
    if k < 1:
        raise ValueError(f"a plan needs at least one span, not {k}")
    if not items:
        return []
    prefix = [0, *itertools.accumulate(p.reads for p in items)]
    total = prefix[-1]
    allowed = [i for i in range(1, len(items)) if not whole_tensors or items[i].name != items[i - 1].name]
    cuts: list[int] = []
    for j in range(1, k):
        target = total * j / k
        after = next((c for c in allowed if prefix[c] >= target), None)
        before = next((c for c in reversed(allowed) if prefix[c] < target), None)
        options = [c for c in (before, after) if c is not None and (not cuts or c > cuts[-1])]
        if options:
            cuts.append(min(options, key=lambda c: (abs(prefix[c] - target), c)))
    bounds = [0, *cuts, len(items)]
    spans = [_span(items, a, b) for a, b in itertools.pairwise(bounds)]
    while len(spans) > 1:
        small = [i for i, s in enumerate(spans) if s.writes < min_writes]
        if not small:
            break
        i = small[0]
        if i == 0:
            j = 1
        elif i == len(spans) - 1:
            j = i - 1
        else:
            j = i - 1 if spans[i - 1].reads <= spans[i + 1].reads else i + 1
        a, b = sorted((i, j))
        spans[a : b + 1] = [_span(items, spans[a].first, spans[b].stop)]
    return spans


def _span(items: list[Piece], first: int, stop: int) -> Span:
    chosen = items[first:stop]
    return Span(first, stop, sum(p.reads for p in chosen), sum(p.writes for p in chosen))


def byte_range(
    items: list[Piece], span: Span, offsets: dict[str, int], itemsizes: dict[str, int] | None = None
) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of a file that ``span`` writes. ``offsets``: each wire tensor's
    byte offset in the file (:func:`syncwire.wire_name` names); ``itemsizes``: the result's
    parts' value sizes, or None for a float32 file of the schema (a version, the momentum, the
    residual), whose values lie at the tensor's own. ValueError unless the range is contiguous."""
    ranges = []
    for p in items[span.first : span.stop]:
        where = p.out_parts if itemsizes is not None else {"": (p.start, p.stop - p.start)}
        sizes = itemsizes if itemsizes is not None else {"": 4}
        for suffix, (first, count) in where.items():
            lo = offsets[wire_name(p.name, suffix)] + first * sizes[suffix]
            ranges.append((lo, lo + count * sizes[suffix]))
    ranges.sort()
    for (_, end), (start, _) in itertools.pairwise(ranges):
        if start != end:
            raise ValueError(f"span [{span.first}, {span.stop}) writes bytes that are not contiguous at {end}")
    return ranges[0][0], ranges[-1][1]


def imbalance(spans: list[Span], k: int) -> float:
    """The largest span's reads over a K-th of them all: the merge's time with K reducers over
    a perfect split's (1.0: perfect; fewer spans than reducers count as idle reducers)."""
    total = sum(s.reads for s in spans)
    return max(s.reads for s in spans) * k / total if total else 1.0
