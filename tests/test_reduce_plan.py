"""The lease plan: contiguous spans of slices, balanced by the bytes they read, each one byte
range of every output file; cut at tensors for multi-part result codecs."""

from __future__ import annotations

import itertools

import pytest

from syncserver.reduce.engine import version_layout
from syncserver.reduce.lease import ObjectOutput, build_jobs
from syncserver.reduce.plan import byte_range, imbalance, itemsizes, multi_part, pieces, plan
from syncwire import get_codec, wire_layout
from syncwire.codecs import SLICE_VALUES
from syncwire.format import encode_header

# a GPT-2-like list at a small width: one big embedding, many small tensors, some over a slice
SCHEMA = {"wte": (3 * SLICE_VALUES // 256 + 7, 256), "wpe": (64, 256)}
for _i in range(3):
    SCHEMA |= {f"h{_i}.ln": (256,), f"h{_i}.attn": (256, 768), f"h{_i}.fc": (256, 1024), f"h{_i}.b": (1024,)}


def offsets(codec_spec: str | None) -> dict[str, int]:
    """Each wire tensor's byte offset in a file of the schema (None: float32, a version)."""
    if codec_spec is None:
        layout = [(n, "F32", s) for n, s in SCHEMA.items()]
    else:
        layout = [(w, d, s) for w, (d, s) in wire_layout(get_codec(codec_spec), SCHEMA).items()]
    head, infos = encode_header(layout)
    return {i.name: len(head) + i.start for i in infos}


@pytest.mark.parametrize("spec", ["fp32", "bf16", "int8", "int4", "topk"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_spans_tile_the_slices_in_order_and_each_writes_one_range(spec: str, k: int) -> None:
    codec = get_codec(spec)
    items = pieces(codec, codec, SCHEMA)
    spans = plan(items, k, whole_tensors=multi_part(codec))
    assert 1 <= len(spans) <= k
    assert spans[0].first == 0 and spans[-1].stop == len(items)
    assert all(a.stop == b.first for a, b in itertools.pairwise(spans))  # contiguous, in order
    assert sum(s.reads for s in spans) == sum(p.reads for p in items)
    result_ranges = [byte_range(items, s, offsets(spec), itemsizes(codec)) for s in spans]
    fp32_ranges = [byte_range(items, s, offsets(None)) for s in spans]
    for ranges in (result_ranges, fp32_ranges):  # the ranges tile each file's data, in order
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert result_ranges[-1][1] - result_ranges[0][0] == sum(s.writes for s in spans)
    if multi_part(codec):  # cut at tensors only
        assert all(items[s.first].name != items[s.first - 1].name for s in spans[1:])


def test_one_part_codec_balances_within_a_slice() -> None:
    codec = get_codec("fp32")
    items = pieces(codec, codec, SCHEMA)
    slice_bytes = SLICE_VALUES * 4
    for k in (2, 3, 4):
        spans = plan(items, k, whole_tensors=False)
        assert len(spans) == k
        assert max(s.reads for s in spans) - sum(s.reads for s in spans) / k <= slice_bytes
        assert imbalance(spans, k) < 1.5


def test_the_cut_is_deterministic_and_a_contiguity_break_is_refused() -> None:
    codec = get_codec("int8")
    items = pieces(codec, codec, SCHEMA)
    assert plan(items, 3, whole_tensors=True) == plan(items, 3, whole_tensors=True)
    # cut inside a tensor, an int8 span's values and scales are two ranges: refused
    inside = plan(items, 3, whole_tensors=False)
    broken = [s for s in inside if items[s.first].name == items[s.first - 1].name and s.first > 0]
    assert broken
    with pytest.raises(ValueError, match="not contiguous"):
        byte_range(items, broken[0], offsets("int8"), itemsizes(codec))


def test_small_spans_join_a_neighbour() -> None:
    codec = get_codec("fp32")
    items = pieces(codec, codec, SCHEMA)
    total = sum(p.writes for p in items)
    spans = plan(items, 8, whole_tensors=False, min_writes=total // 3)
    assert all(s.writes >= total // 3 for s in spans)
    assert spans[0].first == 0 and spans[-1].stop == len(items)
    assert plan(items, 4, whole_tensors=False, min_writes=10 * total) == plan(items, 1, whole_tensors=False)


def test_a_final_round_writes_fp32_at_the_slices_of_its_lossy_updates() -> None:
    items = pieces(get_codec("int8"), get_codec("fp32"), SCHEMA)
    assert all(p.out_parts == {"": (p.start, p.stop - p.start)} for p in items)
    assert all(p.writes == 4 * (p.stop - p.start) for p in items)
    spans = plan(items, 3, whole_tensors=False)
    ranges = [byte_range(items, s, offsets("fp32"), itemsizes(get_codec("fp32"))) for s in spans]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    with pytest.raises(ValueError, match="one part"):
        pieces(get_codec("fp32"), get_codec("int8"), SCHEMA)


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        plan([], 0, whole_tensors=False)
    assert plan([], 3, whole_tensors=False) == []


@pytest.mark.parametrize(("values", "k"), [(30_000_000, 3), (10_000_000_000, 4)])
def test_a_lease_s_range_goes_up_as_parts_of_16_mib_and_the_parts_tile_the_file(values: int, k: int) -> None:
    """A version built by k leases (120 MB; 40 GB): each lease's range is consecutive parts of
    about 16 MiB (SeaweedFS takes a few such parts at once faster than one big one), none under
    S3's 5 MiB but the last, at most 10,000 in all, numbered in file order; the first lease's
    range starts at byte 0 and carries the header."""
    schema = {"w": (values,)}
    head, at, size = version_layout(schema, 1)
    out = ObjectOutput("v", size, "id", lambda n: f"https://store/v?partNumber={n}")
    out.write(head)
    leases = build_jobs(schema, get_codec("int8"), "base", "result", out, at, k)
    assert len(leases) == k
    numbers = [c.part for job in leases for c in job.version.parts]
    assert numbers == list(range(1, len(numbers) + 1)) == sorted(out.parts) and len(numbers) <= 10_000
    sizes = [out.parts[n] for n in numbers]
    assert sum(sizes) == size and min(sizes[:-1]) >= 5 * 1024**2
    assert max(sizes) <= 2 * max(16 << 20, size // 9_000)
    end = 0
    for job in leases:
        assert job.version.start == end and bool(job.version.head) == (end == 0)
        end += job.version.size
    assert end == size
