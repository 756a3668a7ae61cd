"""A peer's update maths without a hub: tiny arrays, hand-computed expectations.

The numbers are chosen to be exact in float32: with ``int8:block=2`` a block whose absmax is
``127 / 128`` has the scale ``1 / 128``, so every value is ``round(x * 128) / 128``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import syncwire.codecs
from syncclient.exceptions import SyncError
from syncclient.update import UpdateState
from syncwire import Codec, StreamReader, decode_tensor, encode_model, get_codec, iter_chunks

STEP = np.float32(1 / 128)  # the int8:block=2 scale of a block whose absmax is 127/128
TOP = np.float32(127 / 128)


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def wire(parts: list[tuple[str, np.ndarray, str]]) -> dict[str, np.ndarray]:
    return {name: array for name, array, _ in parts}


def test_lossless_encode_sends_the_delta_by_wire_name() -> None:
    state = UpdateState(get_codec("fp32"), {"w": f32(1.0, 2.0)})
    local = {"w": f32(1.5, 1.0)}
    update = state.encode(local).wait()
    assert [(name, dtype) for name, _, dtype in update.parts] == [("w", "F32")]
    np.testing.assert_array_equal(update.parts[0][1], f32(0.5, -1.0))
    assert update.ratio == 1.0 and update.error == 0.0 and state.residual == {}
    local["w"][:] = 9.0  # training goes on: what was encoded does not change
    np.testing.assert_array_equal(update.parts[0][1], f32(0.5, -1.0))


def test_error_feedback_carries_the_residual_into_the_next_update() -> None:
    state = UpdateState(get_codec("int8:block=2"), {"w": f32(0.0, 0.0)})
    small = np.float32(0.375) * STEP  # rounds to 0 on its own, every time
    local = {"w": f32(TOP, small)}

    first = state.encode(local).wait()
    assert [name for name, _, _ in first.parts] == ["w", "w:scale"]
    np.testing.assert_array_equal(wire(first.parts)["w"], np.array([127, 0], np.int8))
    np.testing.assert_array_equal(wire(first.parts)["w:scale"], f32(STEP))
    np.testing.assert_array_equal(state.residual["w"], f32(0.0, small))  # what rounding kept back
    assert first.ratio == pytest.approx(8 / 6)  # 2 float32 values / (2 int8 + 1 float32 scale)
    assert first.error == pytest.approx(float(small) / math.hypot(TOP, small), rel=1e-6)

    # the same local weights again: delta + residual = (TOP, 0.75 steps), which rounds to 1 step
    second = state.encode(local).wait()
    np.testing.assert_array_equal(wire(second.parts)["w"], np.array([127, 1], np.int8))
    np.testing.assert_array_equal(state.residual["w"], f32(0.0, 2 * small - STEP))


def test_a_lossless_codec_keeps_no_residual() -> None:
    state = UpdateState(get_codec("fp32"), {"w": f32(0.0)})
    state.encode({"w": f32(0.1)}).wait()
    assert state.residual == {}


def test_nan_in_the_model_refuses_the_update() -> None:
    state = UpdateState(get_codec("fp32"), {"w": f32(0.0, 0.0)})
    with pytest.raises(SyncError, match=r"'w' holds NaN or Inf"):
        state.encode({"w": f32(1.0, np.nan)}).wait()


def test_fold_adds_the_decoded_merged_update_by_hand() -> None:
    base = {"w": f32(1.0, 2.0), "b": f32(0.5)}
    state = UpdateState(get_codec("int8:block=2"), base)
    merged = {"w": np.array([64, -128], np.int8), "w:scale": f32(STEP), "b": np.array([1], np.int8), "b:scale": f32(2)}
    state.fold(merged)
    np.testing.assert_array_equal(state.base["w"], f32(1.5, 1.0))  # 64/128 and -128/128
    np.testing.assert_array_equal(state.base["b"], f32(2.5))
    assert state.base is base  # in place: no second copy of the model


@pytest.mark.parametrize("spec", ["fp32", "bf16", "int8", "int4:block=6"])
def test_fold_is_bit_identical_to_version_plus_decoded_result(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the hub computes for version v + 1: ``v + decode(result)``, tensor by tensor."""
    monkeypatch.setattr(syncwire.codecs, "SLICE_VALUES", 100)  # many slices in tiny arrays
    codec, rng = get_codec(spec), np.random.default_rng(3)
    version = {"w": rng.standard_normal((7, 61)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    update = {name: (rng.standard_normal(x.shape) * 1e-2).astype(np.float32) for name, x in version.items()}
    result = {wire_name: part for _, wire_name, part, _ in encode_model(codec, update)}
    state = UpdateState(codec, {name: x.copy() for name, x in version.items()})
    state.fold(result)
    for name, x in version.items():
        np.testing.assert_array_equal(state.base[name], x + decode_tensor(codec, result, name, x.shape))


@pytest.mark.parametrize("spec", ["fp32", "bf16", "int8", "int4", "topk", "int8:block=100"])
def test_the_sliced_threaded_encode_sends_the_bytes_of_a_whole_tensor_encode(spec: str) -> None:
    """``encode`` cuts tensors into slices (syncwire.codecs.slices) on a thread pool; the update
    must be the very bytes, and the residual the very values, of encoding each tensor whole."""
    codec = get_codec(spec)
    rng = np.random.default_rng(0)
    shapes = {"big": (3, 1_000_003), "odd": (777,), "scalar": ()}  # 3M values: several slices
    base = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    state = UpdateState(codec, {n: b.copy() for n, b in base.items()})
    residual = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    for round_ in range(2):  # the second round carries the first one's residual
        local = {n: b + rng.standard_normal(b.shape).astype(np.float32) for n, b in base.items()}
        sent = wire(state.encode(local).wait().parts)
        for name, x in local.items():
            delta = (x - base[name]) + (0 if codec.lossless else residual[name])
            whole = codec.encode(delta)
            for suffix, array in whole.items():
                wname = name + (f":{suffix}" if suffix else "")
                np.testing.assert_array_equal(sent[wname].reshape(-1), array.reshape(-1), err_msg=f"{wname} {round_}")
            if not codec.lossless:
                residual[name] = delta - codec.decode(whole, delta.shape)
                np.testing.assert_array_equal(state.residual[name], residual[name])


def test_a_refused_update_drops_the_residual() -> None:
    """The residual is updated in place, slice by slice: a NaN found midway would leave it part
    this update's, part the last one's, so it goes (what rounding kept back is all that is lost)."""
    state = UpdateState(get_codec("int8:block=2"), {"w": f32(0.0, 0.0), "v": f32(0.0, 0.0)})
    state.encode({"w": f32(TOP, np.float32(0.375) * STEP), "v": f32(0.0, 0.0)}).wait()
    assert state.residual
    with pytest.raises(SyncError, match=r"'v' holds NaN or Inf"):
        state.encode({"w": f32(0.5, 0.25), "v": f32(np.inf, 0.0)}).wait()
    assert state.residual == {}


def test_the_next_encode_reuses_the_wire_buffers() -> None:
    """The parts are the state's buffers (fresh ones cost page faults every sync); valid until
    the next encode, which the client starts only once the update was sent."""
    state = UpdateState(get_codec("int8:block=2"), {"w": f32(0.0, 0.0)})
    first = state.encode({"w": f32(0.5, 0.25)}).wait().parts
    second = state.encode({"w": f32(0.25, 0.5)}).wait().parts
    assert all(np.shares_memory(a, b) for (_, a, _), (_, b, _) in zip(first, second, strict=True))


def result_body(codec: Codec, update: dict[str, np.ndarray], spec: str | None = None) -> bytes:
    """A merged update's body as the hub serves it (``codec`` metadata: the result's codec)."""
    parts = [(wire_name, part, dtype) for _, wire_name, part, dtype in encode_model(codec, update)]
    return b"".join(bytes(c) for c in iter_chunks(parts, {"codec": spec or codec.spec}))


@pytest.mark.parametrize(("spec", "result"), [("fp32", "fp32"), ("int8", "int8"), ("int4", "int4"), ("int8", "fp32")])
def test_a_streamed_fold_is_the_fold_of_the_whole_body(spec: str, result: str) -> None:
    """Tensors folded as their bytes arrive (any cut of the body) give the bits of ``fold``;
    ("int8", "fp32"): a final round's fp32 result in an int8 run."""
    rng = np.random.default_rng(5)
    version = {n: rng.standard_normal(s).astype(np.float32) for n, s in {"w": (300, 7001), "b": (5,), "c": ()}.items()}
    update = {n: (rng.standard_normal(x.shape) * 1e-2).astype(np.float32) for n, x in version.items()}
    body = result_body(get_codec(result), update)
    whole = UpdateState(get_codec(spec), {n: x.copy() for n, x in version.items()})
    reader = StreamReader()
    reader.feed(body)
    whole.fold(reader.tensors, reader.metadata["codec"])

    state = UpdateState(get_codec(spec), {n: x.copy() for n, x in version.items()})
    fold = state.stream_fold()
    streamed = StreamReader(on_tensor=fold.take)
    cuts = sorted(rng.integers(0, len(body), 40))
    for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
        streamed.feed(body[a:b])
    assert streamed.tensors == {}, "the reader keeps nothing it handed on"
    fold.finish()
    assert not state.torn
    for name in version:
        np.testing.assert_array_equal(state.base[name], whole.base[name])


def test_a_streamed_fold_that_stops_midway_leaves_the_state_torn() -> None:
    version = {"a": f32(1.0, 2.0), "b": f32(3.0)}
    body = result_body(get_codec("fp32"), {"a": f32(0.5, 0.5), "b": f32(0.5)})
    state = UpdateState(get_codec("fp32"), {n: x.copy() for n, x in version.items()})
    fold = state.stream_fold()
    StreamReader(on_tensor=fold.take).feed(body[:-4])  # "b"'s last bytes never came
    np.testing.assert_array_equal(state.base["a"], f32(1.5, 2.5))
    assert state.torn
    with pytest.raises(SyncError, match=r"lacks 1 tensor\(s\), e.g. 'b'"):
        fold.finish()
    assert state.torn, "only a whole version mends it"


def test_a_streamed_fold_refuses_a_tensor_the_model_does_not_have() -> None:
    state = UpdateState(get_codec("fp32"), {"a": f32(1.0)})
    fold = state.stream_fold()
    with pytest.raises(SyncError, match=r"holds 'zz'"):
        StreamReader(on_tensor=fold.take).feed(result_body(get_codec("fp32"), {"a": f32(1.0), "zz": f32(2.0)}))
