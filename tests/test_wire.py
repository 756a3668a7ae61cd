"""Tests for syncwire: the safetensors framing, the codecs, and the properties both sides rely on.

The hub parses bodies that strangers send, so the parser is fuzzed: whatever the bytes, it
answers with a :class:`FormatError` (a 400), never another exception (a 500). The codecs are
checked against their documented error bounds, on ordinary tensors and on the awkward ones
(zeros, one value, odd sizes, subnormals, float32's extremes).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from syncwire import (
    FormatError,
    HeaderReader,
    available_codecs,
    check_layout,
    decode_tensor,
    encode_model,
    get_codec,
    iter_chunks,
    layout_bytes,
    parse_header,
    read_tensors,
    wire_layout,
)
from syncwire.format import MAX_HEADER_BYTES

F32_MAX = float(np.finfo(np.float32).max)
#: The largest float32 that bf16 rounds to a finite value; above it bf16 (and torch) give inf.
BF16_FINITE = float(np.array(0x7F7F7FFF, np.uint32).view(np.float32))
#: Slack on top of ``scale / 2`` for float32 rounding in ``x / scale`` and ``q * scale``.
ROUNDING = 1 + 2**-14
QUANT = ["int8", "int4", "int8:block=2", "int8:block=7", "int4:block=2", "int4:block=6"]
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def body(tensors: Sequence[tuple[str, np.ndarray, str | None]], metadata: dict[str, str] | None = None) -> bytes:
    return b"".join(iter_chunks(tensors, metadata))


def frame(header: object) -> bytes:
    """A length-prefixed header; ``header`` is JSON-encoded unless it is already bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def entry(dtype: str, shape: list[object], start: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def scales_per_value(codec: object, parts: dict[str, np.ndarray], n: int) -> np.ndarray:
    return np.repeat(parts["scale"].astype(np.float64), codec.block)[:n]  # type: ignore[attr-defined]


def assert_quantized(spec: str, x: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Round-trip ``x`` through a quantizer; check finiteness and ``|x - y| <= scale / 2``."""
    codec = get_codec(spec)
    parts = codec.encode(x)
    y = codec.decode(parts, x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.isfinite(y).all()
    assert np.isfinite(parts["scale"]).all() and (parts["scale"] >= 0).all()
    err = np.abs(x.astype(np.float64) - y.astype(np.float64)).reshape(-1)
    bound = scales_per_value(codec, parts, x.size) / 2 * ROUNDING
    worst = int(np.argmax(err - bound)) if x.size else 0
    assert (err <= bound).all(), f"{spec}: value {x.reshape(-1)[worst]!r} off by {err[worst]!r}"
    return parts, y


# --- format -------------------------------------------------------------------------------------


def test_iter_chunks_is_what_safetensors_reads(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "i8": rng.integers(-128, 128, 11).astype(np.int8),
        "u8": rng.integers(0, 256, (2, 3, 4)).astype(np.uint8),
        "empty": np.zeros((0, 4), np.float32),
        "tail": rng.standard_normal(257).astype(np.float32),
    }
    chunks = list(iter_chunks([(k, v, None) for k, v in arrays.items()], {"step": "3"}, chunk_bytes=7))
    assert all(len(c) <= 7 for c in chunks[1:])
    raw = b"".join(chunks)
    loaded = safetensors.numpy.load(raw)
    assert loaded.keys() == arrays.keys()
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape
        np.testing.assert_array_equal(loaded[name], array)
    path = tmp_path / "body.safetensors"
    path.write_bytes(raw)
    with safetensors.safe_open(str(path), "np") as f:
        assert f.metadata() == {"step": "3"}


def test_iter_chunks_copies_no_tensor() -> None:
    x = np.arange(1000, dtype=np.float32)
    chunks = list(iter_chunks([("x", x, None)], chunk_bytes=1024))
    assert len(chunks) == 1 + 4
    assert all(np.shares_memory(np.frombuffer(c, np.uint8), x) for c in chunks[1:])


def test_iter_chunks_keeps_zero_dim_shape() -> None:
    loaded = safetensors.numpy.load(body([("s", np.array(2.5, np.float32), None)]))
    assert loaded["s"].shape == ()


def test_bf16_reads_as_torch_bfloat16() -> None:
    torch = pytest.importorskip("torch")
    import safetensors.torch

    x = np.random.default_rng(1).standard_normal((4, 33)).astype(np.float32)
    codec = get_codec("bf16")
    raw = body([(wire, part, dtype) for _, wire, part, dtype in encode_model(codec, {"w": x})])
    w = safetensors.torch.load(raw)["w"]
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == x.shape
    assert torch.equal(w, torch.from_numpy(x).to(torch.bfloat16))


def test_header_reader_byte_by_byte_equals_parse_header() -> None:
    raw = body([("a", np.ones(3, np.float32), None), ("b", np.zeros(5, np.int8), None)], metadata={"k": "v"})
    (n,) = struct.unpack("<Q", raw[:8])
    reader = HeaderReader()
    done_at = next(i for i in range(len(raw)) if reader.feed(raw[i : i + 1]))
    assert done_at == 8 + n - 1 and reader.header_bytes == 8 + n
    assert reader.result == parse_header(raw)
    infos, metadata, size = parse_header(raw)
    assert metadata == {"k": "v"} and size == 3 * 4 + 5
    assert [(i.name, i.dtype, i.shape, i.start, i.end) for i in infos.values()] == [
        ("a", "F32", (3,), 0, 12),
        ("b", "I8", (5,), 12, 17),
    ]


@SETTINGS
@given(cuts=st.lists(st.integers(0, 400), max_size=12))
def test_header_reader_any_chunking_gives_the_same_header(cuts: list[int]) -> None:
    raw = body([("a", np.ones(3, np.float32), None), ("b", np.zeros(5, np.int8), None)])
    bounds = [0, *sorted(c % (len(raw) + 1) for c in cuts), len(raw)]
    reader = HeaderReader()
    for lo, hi in itertools.pairwise(bounds):
        reader.feed(raw[lo:hi])
    assert reader.result == parse_header(raw)


def _base(a: object) -> bool:
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = getattr(a, "base", None)
    return False


def test_read_tensors_memory_maps(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    q = np.arange(-3, 4, dtype=np.int8)
    path = tmp_path / "t.safetensors"
    path.write_bytes(body([("x", x, None), ("q", q, None)], metadata={"a": "b"}))
    arrays, metadata = read_tensors(str(path))
    assert metadata == {"a": "b"}
    np.testing.assert_array_equal(arrays["x"], x)
    np.testing.assert_array_equal(arrays["q"], q)
    for array in arrays.values():
        assert _base(array) and not array.flags.writeable


def test_read_tensors_without_data(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    path.write_bytes(body([("e", np.zeros((0, 3), np.float32), None)]))
    arrays, _ = read_tensors(str(path))
    assert arrays["e"].shape == (0, 3) and arrays["e"].dtype == np.float32


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\x01\x02", "shorter than the 8-byte"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1), "over the"),
        (struct.pack("<Q", 100) + b'{"a":', "ends inside the header"),
        (frame(b'{"a": 1,'), "not valid JSON"),
        (frame(b"\xff\xfe\xfd"), "not valid JSON"),
        (frame([1, 2]), "not a JSON object"),
        (frame("text"), "not a JSON object"),
        (
            frame(b'{"a": %s, "a": %s}' % ((json.dumps(entry("U8", [1], 0, 1)).encode(),) * 2)),
            "duplicate key",
        ),
        (frame({"a": entry("F64", [1], 0, 8)}), "unsupported dtype"),
        (frame({"a": entry("BOOL", [1], 0, 1)}), "unsupported dtype"),
        (frame({"a": entry("F32", [2], 0, 4)}), "do not hold shape"),
        (frame({"a": entry("F32", [2, 3], 0, 8)}), "do not hold shape"),
        (frame({"a": entry("F32", [-1], 0, 4)}), "shape must be"),
        (frame({"a": entry("F32", [True], 0, 4)}), "shape must be"),
        (frame({"a": entry("F32", [1.0], 0, 4)}), "shape must be"),
        (frame({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}), "entry must have"),
        (frame({"a": {"dtype": "F32", "shape": [1]}}), "entry must have"),
        (frame({"a": [1]}), "entry must have"),
        (frame({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}), "data_offsets must be"),
        (frame({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}), "data_offsets must be"),
        (frame({"a": {"dtype": "F32", "shape": [1], "data_offsets": "0-4"}}), "data_offsets must be"),
        (frame({"a": entry("F32", [1], 4, 8)}), "does not start where"),  # gap at the start
        (frame({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}), "does not start where"),
        (frame({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}), "does not start where"),
        (frame({"a": entry("U8", [1], 0, 1), "__metadata__": {"k": 1}}), "__metadata__ must map"),
        (frame({"__metadata__": ["k", "v"]}), "__metadata__ must map"),
        (frame({"__metadata__": "k=v"}), "__metadata__ must map"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_header_is_a_format_error(raw: bytes, reason: str) -> None:
    with pytest.raises(FormatError, match=reason):
        parse_header(raw)
    reader = HeaderReader()
    with pytest.raises(FormatError, match=reason):
        reader.feed(raw)
        if reader.result is None:  # truncated: the stream's owner calls parse_header at EOF
            parse_header(raw)


def test_deeply_nested_header_is_a_format_error() -> None:
    with pytest.raises(FormatError):
        parse_header(frame(b"[" * 100_000))


@pytest.mark.parametrize("dtype", [[], {"a": 1}])
def test_unhashable_dtype_is_a_format_error(dtype: object) -> None:
    with pytest.raises(FormatError, match="dtype"):
        parse_header(frame({"a": {"dtype": dtype, "shape": [0], "data_offsets": [0, 0]}}))


def test_read_tensors_rejects_truncated_header(tmp_path: Path) -> None:
    raw = body([("a", np.arange(100, dtype=np.float32), None)])
    path = tmp_path / "t.safetensors"
    for cut in (3, 20):
        path.write_bytes(raw[:cut])
        with pytest.raises(FormatError):
            read_tensors(str(path))


def test_read_tensors_rejects_truncated_data(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    path.write_bytes(body([("a", np.arange(100, dtype=np.float32), None)])[:-10])
    with pytest.raises(FormatError, match=r"\w"):
        read_tensors(str(path))


#: JSON values of every kind, nested: what an attacker's header could hold.
JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
#: Headers shaped like the real thing, with every field liable to be wrong.
ENTRY = st.fixed_dictionaries(
    {
        # Leaves only until test_unhashable_dtype_is_a_format_error passes; then use JSON.
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "F64", ""]) | JSON_LEAF,
        "shape": st.lists(st.integers(-2, 6), max_size=3) | JSON,
        "data_offsets": st.lists(st.integers(-4, 64), min_size=2, max_size=2) | JSON,
    },
    optional={"extra": JSON},
)
HEADER = st.dictionaries(st.text(max_size=6), ENTRY | JSON, max_size=4) | st.fixed_dictionaries({"__metadata__": JSON})


@SETTINGS
@given(raw=st.binary(max_size=256))
def test_fuzz_bytes_only_raise_format_error(raw: bytes) -> None:
    with contextlib.suppress(FormatError):
        parse_header(raw)
    reader = HeaderReader()
    with contextlib.suppress(FormatError):
        for i in range(0, len(raw), 5):
            reader.feed(raw[i : i + 5])


@SETTINGS
@given(header=HEADER | JSON, pad=st.binary(max_size=8))
def test_fuzz_json_headers_only_raise_format_error(header: object, pad: bytes) -> None:
    raw = frame(json.dumps(header).encode() + pad)
    try:
        infos, metadata, size = parse_header(raw)
    except FormatError:
        return
    assert size == sum(i.end - i.start for i in infos.values())
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    reader = HeaderReader()
    assert reader.feed(raw) and reader.result == (infos, metadata, size)


# --- codecs -------------------------------------------------------------------------------------


def test_registry() -> None:
    assert {"fp32", "bf16", "int8", "int4"} <= set(available_codecs())
    for spec in ["fp32", "bf16", "int8", "int4", "int8:block=128", "int4:block=64"]:
        codec = get_codec(spec)
        assert codec.spec == spec
        assert not codec.lossless or spec == "fp32"
    assert get_codec("int8:block=64") == get_codec("int8") != get_codec("int8:block=32")
    assert get_codec("int8:block=64").spec == "int8"
    assert get_codec("int4") != get_codec("int8")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("int3", "unknown codec"),
        ("", "unknown codec"),
        ("int8:block=1", "block must be an integer >= 2"),
        ("int8:block=0", "block must be an integer >= 2"),
        ("int4:block=1", "block must be an integer >= 2"),
        ("int4:block=63", "block must be even"),
        ("int8:block=-4", "key=integer"),
        ("int8:block=x", "key=integer"),
        ("int8:block", "key=integer"),
        ("int8:bits=4", "takes no parameter"),
        ("fp32:block=4", "takes no parameter"),
    ],
)
def test_get_codec_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


def test_fp32_is_exact() -> None:
    x = np.random.default_rng(2).standard_normal((7, 9)).astype(np.float32)
    x[0, :4] = [np.inf, -np.inf, 1e-45, -0.0]
    codec = get_codec("fp32")
    y = codec.decode(codec.encode(x), x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("spec", ["fp32", "bf16"])
def test_fp32_bf16_keep_zero_dim_shape(spec: str) -> None:
    codec = get_codec(spec)
    assert codec.encode(np.array(1.5, np.float32))[""].shape == codec.layout(())[""][1] == ()


def _bf16_cases() -> np.ndarray:
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16) | np.uint32(0x8000)  # exactly halfway
    x = np.concatenate([bits, ties]).view(np.float32)
    return x[~np.isnan(x)]


def test_bf16_rounds_to_nearest_even_like_torch() -> None:
    torch = pytest.importorskip("torch")
    x = _bf16_cases()
    ours = get_codec("bf16").encode(x)[""]
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


def test_bf16_relative_error() -> None:
    x = _bf16_cases()
    x = x[np.isfinite(x) & (np.abs(x) >= np.finfo(np.float32).tiny) & (np.abs(x) <= BF16_FINITE)]
    codec = get_codec("bf16")
    y = codec.decode(codec.encode(x), x.shape)
    assert np.isfinite(y).all()
    rel = np.abs(y.astype(np.float64) - x) / np.abs(x.astype(np.float64))
    assert rel.max() <= 2**-8


@pytest.mark.parametrize("spec", QUANT)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (2,), (3,), (127,), (129,), (1001,), (7, 13), (3, 0, 2)])
def test_quantizers_bound_every_shape(spec: str, shape: tuple[int, ...]) -> None:
    x = (np.random.default_rng(4).standard_normal(shape) * 3).astype(np.float32)
    parts, _ = assert_quantized(spec, x)
    codec = get_codec(spec)
    layout = codec.layout(shape)
    assert parts.keys() == layout.keys()
    for suffix, (dtype, part_shape) in layout.items():
        assert parts[suffix].shape == part_shape
        assert parts[suffix].dtype == {"I8": np.int8, "U8": np.uint8, "F32": np.float32}[dtype]


@pytest.mark.parametrize("spec", ["int8", "int4", "int8:block=1000", "int4:block=6", "int8:block=1000000"])
def test_quantizers_across_chunks(spec: str) -> None:
    """Tensors bigger than the codec's internal chunk, with a partial last block and odd size."""
    x = np.random.default_rng(5).standard_normal(600_001).astype(np.float32)
    x[:1000] *= 1e-30  # blocks of very different scales
    x[-3:] = [F32_MAX, -F32_MAX, 0.0]
    assert_quantized(spec, x)


@pytest.mark.parametrize("spec", QUANT)
def test_quantizers_zeros(spec: str) -> None:
    x = np.zeros((5, 37), np.float32)
    codec = get_codec(spec)
    with np.errstate(all="raise"):
        parts = codec.encode(x)
        y = codec.decode(parts, x.shape)
    assert (parts["scale"] == 0).all()
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("spec", QUANT)
def test_quantizers_extremes(spec: str) -> None:
    tiny = np.float32(1e-45)  # the smallest subnormal
    x = np.array(
        [F32_MAX, -F32_MAX, 1.0, tiny, -tiny, 3 * tiny, 190 * tiny, 1e-40, 1e30, -1e-38, 5e-39, 0.0],
        np.float32,
    )
    assert_quantized(spec, x)
    for value in x:  # each alone in its block: the scale comes from the value itself
        assert_quantized(spec, np.full(9, value, np.float32))


@pytest.mark.parametrize("spec", ["int8", "int4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantizers_refuse_non_finite(spec: str, bad: float) -> None:
    x = np.ones(300, np.float32)
    x[200] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        get_codec(spec).encode(x)


def test_int4_packing() -> None:
    """Low nibble first, two's complement, zero padding: the documented byte layout."""
    codec = get_codec("int4:block=6")
    parts = codec.encode(np.array([7, -7, 1, -1, 0, 3, -2], np.float32))
    np.testing.assert_allclose(parts["scale"], [1, 2 / 7], rtol=1e-6)
    assert parts[""].tolist() == [0x97, 0xF1, 0x30, 0x09]  # 7|-7<<4, 1|-1<<4, 0|3<<4, -7|pad


@pytest.mark.parametrize("spec", ["int8", "int4", "int4:block=2"])
def test_decode_is_total_on_hostile_parts(spec: str) -> None:
    """Bytes no honest encoder writes (int8 -128, int4 nibble -8) still decode to finite values."""
    codec = get_codec(spec)
    shape = (301,)
    layout = codec.layout(shape)
    main_dtype = np.int8 if layout[""][0] == "I8" else np.uint8
    main = np.full(layout[""][1], 0x88 if main_dtype == np.uint8 else -128, dtype=main_dtype)
    scale = np.full(layout["scale"][1], F32_MAX, np.float32)
    scale[::2] = -1e-45
    y = codec.decode({"": main, "scale": scale}, shape)
    assert np.isfinite(y).all() and np.abs(y).max() == F32_MAX
    assert codec.decode({"": main.copy(), "scale": scale.copy()}, shape).tobytes() == y.tobytes()


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_decode_rejects_bad_parts(spec: str) -> None:
    codec = get_codec(spec)
    shape = (100,)
    parts = codec.encode(np.ones(shape, np.float32))
    for bad in (np.nan, np.inf):
        scale = parts["scale"].copy()
        scale[0] = bad
        with pytest.raises(FormatError, match="finite"):
            codec.decode({"": parts[""], "scale": scale}, shape)
    with pytest.raises(FormatError, match="scale"):
        codec.decode({"": parts[""], "scale": parts["scale"][:-1]}, shape)
    with pytest.raises(FormatError, match="main part"):
        codec.decode({"": parts[""][:-1], "scale": parts["scale"]}, shape)
    with pytest.raises(FormatError, match="main part"):
        codec.decode({"": parts[""].astype(np.int16), "scale": parts["scale"]}, shape)


GPT2_LIKE: dict[str, tuple[int, ...]] = {
    "wte": (1001, 64),
    "h.0.ln_1.weight": (64,),
    "h.0.attn.c_attn.weight": (64, 192),
    "h.0.attn.c_attn.bias": (193,),
    "h.0.mlp.c_fc.weight": (64, 256),
    "scalar": (1,),
    "empty": (0, 3),
}


@pytest.mark.parametrize("spec", ["fp32", "bf16", "int8", "int4", "int8:block=7", "int4:block=2"])
def test_layout_matches_encode_model(spec: str, tmp_path: Path) -> None:
    codec = get_codec(spec)
    rng = np.random.default_rng(6)
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in GPT2_LIKE.items()}
    layout = wire_layout(codec, GPT2_LIKE)
    wire = [(w, a, d) for _, w, a, d in encode_model(codec, arrays)]
    assert [w for w, _, _ in wire] == list(layout)
    raw = body(wire)
    infos, _, size = parse_header(raw)
    check_layout(infos, layout)
    assert size == layout_bytes(layout) == len(raw) - (8 + struct.unpack("<Q", raw[:8])[0])
    path = tmp_path / "b.safetensors"
    path.write_bytes(raw)
    mapped, _ = read_tensors(str(path))
    for name, x in arrays.items():
        y = decode_tensor(codec, mapped, name, x.shape)
        np.testing.assert_array_equal(y, codec.decode(codec.encode(x), x.shape))
    with pytest.raises(FormatError, match="missing"):
        check_layout({k: v for k, v in infos.items() if k != "wte"}, layout)
    with pytest.raises(FormatError, match="expects"):
        check_layout(infos, {**layout, "wte": ("F16", layout["wte"][1])})


@pytest.mark.parametrize(("spec", "limit"), [("bf16", 0.5), ("int8", 0.27), ("int4", 0.14)])
def test_bytes_ratio(spec: str, limit: float) -> None:
    schema = {"w": (768, 3072), "b": (3072,), "wte": (50257, 768)}
    ratio = layout_bytes(wire_layout(get_codec(spec), schema)) / (4 * sum(math.prod(s) for s in schema.values()))
    assert ratio <= limit


@pytest.mark.parametrize("spec", ["int8", "int4", "int8:block=16"])
def test_error_feedback_tracks_the_true_sum(spec: str) -> None:
    """What the client does: send ``x + residual``, keep ``residual = sent - decoded``."""
    codec = get_codec(spec)
    rng = np.random.default_rng(7)
    shape = (50, 40)
    true_sum = np.zeros(shape)
    sent_sum = np.zeros(shape)
    naive_sum = np.zeros(shape)
    residual = np.zeros(shape, np.float32)
    unit = float(codec.encode(np.ones(1, np.float32))["scale"][0])  # the step when absmax is 1
    for _ in range(60):
        # One 1.0 per block sets the step; the rest drift by 0.3 steps a round, which a
        # quantizer without feedback rounds to zero every time.
        x = (0.3 * unit + rng.standard_normal(shape) * 0.05 * unit).astype(np.float32)
        x.reshape(-1)[::16] = 1.0
        v = x + residual
        parts = codec.encode(v)
        y = codec.decode(parts, shape)
        residual = v - y
        true_sum += x
        sent_sum += y
        naive_sum += codec.decode(codec.encode(x), shape)
        step = scales_per_value(codec, parts, x.size).reshape(shape)
        assert (np.abs(true_sum - sent_sum) <= step).all()
    assert np.abs(true_sum - naive_sum).max() > 5 * step.max()  # without feedback, error piles up


@SETTINGS
@given(
    spec=st.sampled_from(QUANT),
    x=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=40),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True),
    ),
)
def test_fuzz_quantizers(spec: str, x: np.ndarray) -> None:
    assert_quantized(spec, x)


@SETTINGS
@given(
    x=hnp.arrays(
        np.float32,
        st.integers(0, 200),
        elements=st.floats(-BF16_FINITE, BF16_FINITE, width=32, allow_subnormal=True),
    )
)
def test_fuzz_lossless_and_bf16(x: np.ndarray) -> None:
    fp32, bf16 = get_codec("fp32"), get_codec("bf16")
    np.testing.assert_array_equal(fp32.decode(fp32.encode(x), x.shape), x)
    y = bf16.decode(bf16.encode(x), x.shape).astype(np.float64)
    assert np.isfinite(y).all()
    x64 = x.astype(np.float64)
    normal = np.abs(x64) >= np.finfo(np.float32).tiny
    assert (np.abs(y - x64)[normal] <= np.abs(x64)[normal] * 2**-8).all()
    assert (np.abs(y - x64)[~normal] <= 2.0**-134).all()  # bf16's subnormal spacing is 2^-133
