"""Cutting a round's merge into leases: at most K contiguous runs of slices (*spans*) balanced by the
bytes they read of every update (why: docs/object-store.md, "How a merge is cut"). Each output of a
span is then one byte range; spans end at tensor boundaries where the result's codec writes a slice
into several wire tensors, and one under ``min_writes`` bytes of result (S3 wants parts of 5 MiB but
the last) joins its smaller neighbour. Pure functions: the hub and a test get the same plan.
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
    """One slice of a round's merge: values ``[start, stop)`` of ``name``, where they lie in the
    updates' and the result's wire parts, the bytes it reads of one update and writes of the result."""

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
    """Every slice, in schema order, of a round with updates in ``codec`` (its slices) and the
    result in ``result_codec``: ``codec``, or else a one-part one (a final round's fp32) whose part
    of a slice lies at the slice's own values."""
    same = result_codec.spec == codec.spec
    if not same and multi_part(result_codec):
        raise ValueError(f"a result codec other than the updates' must have one part, not {result_codec.spec}")
    read_sizes, write_sizes = itemsizes(codec), itemsizes(result_codec)
    out: list[Piece] = []
    for name, shape in schema.items():
        for start, stop, parts in slices(codec, shape):
            out_parts = parts if same else {suffix: (start, stop - start) for suffix in write_sizes}
            reads = sum(count * read_sizes[s] for s, (_, count) in parts.items())
            writes = sum(count * write_sizes[s] for s, (_, count) in out_parts.items())
            out.append(Piece(name, start, stop, parts, out_parts, reads, writes))
    return out


def plan(items: list[Piece], k: int, *, whole_tensors: bool, min_writes: int = 0) -> list[Span]:
    """Cut ``items`` into at most ``k`` contiguous spans balanced by the bytes they read: the j-th
    cut at the allowed cut (a tensor boundary if ``whole_tensors``, else any slice) nearest to j/k
    of the bytes; then each span writing under ``min_writes`` bytes joins its smaller neighbour."""
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
        i = next((i for i, s in enumerate(spans) if s.writes < min_writes), None)
        if i is None:
            break
        # spans a and a + 1 join: i and its smaller neighbour (the one there is, at an end)
        a = i - 1 if i == len(spans) - 1 or (i > 0 and spans[i - 1].reads <= spans[i + 1].reads) else i
        spans[a : a + 2] = [_span(items, spans[a].first, spans[a + 1].stop)]
    return spans


def _span(items: list[Piece], first: int, stop: int) -> Span:
    chosen = items[first:stop]
    return Span(first, stop, sum(p.reads for p in chosen), sum(p.writes for p in chosen))


def byte_range(
    items: list[Piece], span: Span, offsets: dict[str, int], itemsizes: dict[str, int] | None = None
) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of a file that ``span`` writes (ValueError unless contiguous); ``offsets``:
    each wire tensor's in the file; ``itemsizes``: the result's parts' value sizes, or None for a
    float32 file of the schema (a version, the momentum, the residual)."""
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
