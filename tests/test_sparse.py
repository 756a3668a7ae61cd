"""The ``topk`` codec: what it sends, its edge cases, its error feedback on both sides.

The codec's own properties are checked on arrays; the hub's error feedback (its residual file)
on a real :class:`~syncserver.storage.store.Store` and :class:`~syncserver.reduce.engine.MergeEngine`, across a
restart; and two peers on a real hub, SIGKILLed between rounds, end bit-identical.
"""

from __future__ import annotations

import base64
import hashlib
import math
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from syncclient import SyncClient
from syncclient.weights import ModelView
from syncserver.reduce.engine import Accumulator, MergeEngine, Outer, RoundMerge
from syncserver.storage.store import ResidualKey, ResultKey, Store, VersionKey
from syncwire import Codec, FormatError, encode_model, get_codec, iter_chunks, layout_bytes, wire_layout
from syncwire.codecs import slices
from syncwire.sparse import TopK
from tests.conftest import Hub
from tests.harness import HTTP, hub_model, perturb, run_peers, wait_for
from tests.models import tiny_gpt2


@pytest.fixture(scope="module")
def hub(module_hub: Hub) -> Hub:
    """One hub for the tests here that take ``hub``, each on runs of its own names (tests/conftest.py)."""
    return module_hub


SPECS = [
    "topk",
    "topk:chunk=16,k=2,bits=2",
    "topk:chunk=5,k=2,bits=1,block=15",
    "topk:chunk=1024,k=48",
    "topk:chunk=16,k=3,block=48",
    "topk:chunk=100,k=7,bits=4,block=300",
    "topk:chunk=2,k=2,bits=8,block=2",
]


def topk(spec: str) -> TopK:
    codec = get_codec(spec)
    assert isinstance(codec, TopK)
    return codec


def check_sent(codec: TopK, x: np.ndarray, y: np.ndarray) -> None:
    """``y`` (the decoding) keeps, in each chunk, at most ``min(k, size)`` values, at positions of
    largest magnitude, each rounded to its block's levels (within half a step, same sign), and
    is zero elsewhere."""
    flat, out = x.reshape(-1).astype(np.float64), y.reshape(-1).astype(np.float64)
    for block in range(0, flat.size, codec.block):
        top = np.concatenate(
            [
                np.sort(np.abs(flat[i : min(i + codec.chunk, block + codec.block, flat.size)]))[-codec.k :]
                for i in range(block, min(block + codec.block, flat.size), codec.chunk)
            ]
        )
        # bits=1: one level, the mean of what was sent: within max - min of each value
        step = (top.max() - top.min()) / (codec.levels - 1) if codec.levels > 1 else 2 * (top.max() - top.min())
        for start in range(block, min(block + codec.block, flat.size), codec.chunk):
            xs, ys = flat[start : start + codec.chunk], out[start : start + codec.chunk]
            m = min(codec.k, xs.size)
            sent = np.flatnonzero(ys)
            assert sent.size <= m
            if sent.size:  # nothing larger was left out
                assert np.abs(xs).max() == np.abs(xs[sent]).max()
                assert np.sort(np.abs(xs))[-m] <= np.abs(xs[sent]).min()
            assert (np.sign(ys[sent]) == np.sign(xs[sent])).all()
            assert (np.abs(ys[sent] - xs[sent]) <= step / 2 * (1 + 2**-20) + 1e-44).all()


# --- the codec -------------------------------------------------------------------------------------


def test_spec_names_only_what_differs_from_the_defaults() -> None:
    assert topk("topk").spec == "topk" == topk("topk:chunk=4,k=1,bits=1,block=1024").spec
    assert topk("topk:bits=3,k=2").spec == "topk:k=2,bits=3"
    assert topk("topk:block=64,chunk=32").spec == "topk:chunk=32,block=64"
    assert topk("topk:k=2") != topk("topk") == get_codec("topk")
    assert not topk("topk").lossless and topk("topk").hub_feedback
    assert not get_codec("int8").hub_feedback


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("topk:k=0", "k must be"),
        ("topk:chunk=16,k=17", "k must be"),
        ("topk:k=5", "k must be"),
        ("topk:chunk=1", "chunk must be"),
        ("topk:chunk=131072", "chunk must be"),
        ("topk:chunk=16,block=8", "block must be"),
        ("topk:block=42", "multiple of chunk"),
        ("topk:bits=0", "bits must be"),
        ("topk:bits=9", "bits must be"),
        ("topk:zero=1", "takes no parameter"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (5,), (16,), (1023,), (1025,), (3, 700), (2, 0, 3)])
def test_round_trip_sends_the_top_k_of_each_chunk(spec: str, shape: tuple[int, ...]) -> None:
    codec = topk(spec)
    x = (np.random.default_rng(1).standard_t(3, shape) * 0.01).astype(np.float32)  # heavy tails
    parts = codec.encode(x)
    layout = codec.layout(shape)
    assert parts.keys() == layout.keys()
    for suffix, (dtype, part_shape) in layout.items():
        assert parts[suffix].shape == part_shape and parts[suffix].dtype == {"U8": np.uint8, "F32": np.float32}[dtype]
    y = codec.decode(parts, shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    check_sent(codec, x, y)
    # exact for what was sent: what was decoded goes through again bit for bit
    assert codec.decode(codec.encode(y), shape).tobytes() == y.tobytes()


def test_two_magnitudes_per_chunk_travel_exactly() -> None:
    codec = topk("topk:chunk=8,k=3,bits=2,block=8")
    x = np.array([0, 0.5, 0, -2, 0, 0, 0.5, 0, 7, 0, 0, 0, 0, 0, 0, -7], np.float32)
    y = codec.decode(codec.encode(x), x.shape)
    np.testing.assert_array_equal(y, x)
    signs = topk("topk")  # one magnitude per block: signs of equal magnitudes travel exactly
    x = np.tile(np.array([0, -0.25, 0, 0, 0.25, 0, 0, 0], np.float32), 300)
    np.testing.assert_array_equal(signs.decode(signs.encode(x), x.shape), x)


def test_a_chunk_larger_than_the_tensor_sends_its_top_k() -> None:
    codec = topk("topk:chunk=1024,k=48")
    x = np.arange(1, 101, dtype=np.float32) * np.float32(0.01)
    y = codec.decode(codec.encode(x), x.shape)
    assert np.flatnonzero(y).tolist() == list(range(52, 100))  # the 48 largest
    wide = topk("topk:chunk=4096,k=200,block=4096")
    y = wide.decode(wide.encode(x), x.shape)
    assert np.count_nonzero(y) == 100  # k above the size: everything is sent, on its levels


def test_zeros_and_ties() -> None:
    codec = topk("topk:chunk=64,k=5,block=64")
    with np.errstate(all="raise"):
        zeros = codec.encode(np.zeros(200, np.float32))
        np.testing.assert_array_equal(codec.decode(zeros, (200,)), np.zeros(200, np.float32))
    assert (zeros["scale"] == 0).all()
    ties = np.full(200, -0.25, np.float32)
    parts = codec.encode(ties)
    y = codec.decode(parts, ties.shape)
    assert np.count_nonzero(y) == 3 * 5 + 5 and set(y[y != 0].tolist()) == {-0.25}
    assert all(np.count_nonzero(y[i : i + 64]) == 5 for i in range(0, 200, 64))
    again = codec.encode(ties)
    assert all(again[s].tobytes() == parts[s].tobytes() for s in parts)  # the same ties every time


def test_extremes_stay_finite() -> None:
    f32 = np.finfo(np.float32)
    x = np.array([f32.max, -f32.max, 1e-45, -1e-45, 1e-40, 0.0, 1.0, -3e38], np.float32)
    for spec in ["topk:chunk=4,k=2,block=4", "topk:chunk=8,k=8,bits=8,block=8", "topk:chunk=2,k=1,block=2", "topk"]:
        codec = topk(spec)
        y = codec.decode(codec.encode(x), x.shape)
        assert np.isfinite(y).all()
        check_sent(codec, x, y)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = np.ones(3000, np.float32)
    x[2500] = bad  # not among the top k of its chunk: still refused
    x[:100] = 5
    for spec in ("topk", "topk:chunk=1024,k=48"):
        with pytest.raises(ValueError, match="NaN or Inf"):
            topk(spec).encode(x)


def test_bad_parts_are_format_errors() -> None:
    codec = topk("topk:chunk=16,k=4,block=16")
    shape = (40,)  # chunks (and blocks) of 16, 16 and 8
    parts = codec.encode(np.arange(40, dtype=np.float32) - 20)

    def decode(**changed: np.ndarray) -> np.ndarray:
        return codec.decode({**parts, **changed}, shape)

    decode()
    for suffix in parts:
        with pytest.raises(FormatError, match="expected"):
            decode(**{suffix: parts[suffix][:-1]})
    with pytest.raises(FormatError, match="expected"):
        decode(scale=parts["scale"].astype(np.float64))
    for lo, hi in [(np.nan, 1.0), (0.0, np.inf), (-1.0, 1.0), (2.0, 1.0)]:
        scale = parts["scale"].copy()
        scale[2:4] = lo, hi
        with pytest.raises(FormatError, match="scales"):
            decode(scale=scale)
    index = parts["index"].copy()
    index[0] = 0x33  # offsets 3, 3: a repeated offset
    with pytest.raises(FormatError, match="increasing"):
        decode(index=index)
    index = parts["index"].copy()
    index[-1] = 0xFF  # the short last chunk holds 8 values: offset 15 is outside it
    with pytest.raises(FormatError, match="inside their chunk"):
        decode(index=index)


def test_hostile_but_well_formed_parts_decode_finite() -> None:
    codec = topk("topk:chunk=16,k=4,bits=3,block=16")
    layout = codec.layout((64,))
    codes = np.full(layout[""][1], 0xFF, np.uint8)
    index = codec.encode(np.arange(64, dtype=np.float32))["index"]  # valid offsets
    scale = np.tile(np.array([0.0, np.finfo(np.float32).max], np.float32), 4)
    y = codec.decode({"": codes, "index": index, "scale": scale}, (64,))
    assert np.isfinite(y).all() and np.abs(y).max() == np.finfo(np.float32).max


def test_slices_decode_like_the_whole_tensor() -> None:
    """The hub and the peers work a slice (whole chunks) at a time: the parts must tile."""
    codec = topk("topk")
    x = np.random.default_rng(2).standard_normal(2_500_003).astype(np.float32)
    parts = codec.encode(x)
    whole = codec.decode(parts, x.shape)
    pieces = slices(codec, x.shape)
    assert len(pieces) == 3
    for start, stop, where in pieces:
        piece = {suffix: parts[suffix][first : first + count] for suffix, (first, count) in where.items()}
        assert codec.decode(piece, (stop - start,)).tobytes() == whole[start:stop].tobytes()
        encoded = codec.encode(x[start:stop])
        assert all(encoded[s].tobytes() == piece[s].tobytes() for s in encoded)


def test_bytes_ratio_on_gpt2_shapes() -> None:
    schema = {"w": (768, 3072), "b": (3072,), "wte": (50257, 768), "ln": (768,)}
    fp32 = 4 * sum(math.prod(s) for s in schema.values())
    assert layout_bytes(wire_layout(get_codec("topk"), schema)) / fp32 < 0.026
    assert layout_bytes(wire_layout(get_codec("topk:chunk=1024,k=64"), schema)) / fp32 < 0.026


def test_error_feedback_sends_everything_in_the_end() -> None:
    """The client's loop: send ``x + residual``, keep ``residual = sent - decoded``. The sum of
    what was decoded approaches the sum of the deltas (the residual stays bounded while the sum
    grows); without feedback, the values top-k never picks are never sent."""
    codec = topk("topk:chunk=256,k=12,block=256")
    rng = np.random.default_rng(3)
    shape = (8, 256)
    residual = np.zeros(shape, np.float32)
    true_sum, sent_sum, naive_sum = (np.zeros(shape) for _ in range(3))
    errors = []
    for r in range(400):
        x = (0.01 + rng.standard_normal(shape) * 0.005).astype(np.float32)
        x[:, 0] = 0.05  # one large value per chunk: without feedback it takes a slot every time
        v = x + residual
        y = codec.decode(codec.encode(v), shape)
        residual = v - y
        true_sum += x
        sent_sum += y
        naive_sum += codec.decode(codec.encode(x), shape)
        if r in (49, 399):
            errors.append(np.linalg.norm(true_sum - sent_sum) / np.linalg.norm(true_sum))
    assert errors[1] < errors[0] / 4 and errors[1] < 0.1
    assert np.linalg.norm(true_sum - naive_sum) / np.linalg.norm(true_sum) > 0.8


# --- the hub's error feedback ---------------------------------------------------------------------


def _store(path: Path, base: dict[str, np.ndarray]) -> tuple[Store, MergeEngine]:
    store = Store(path)
    if not store.exists(VersionKey("r", 0)):
        with store.write(VersionKey("r", 0)) as f:
            for chunk in iter_chunks([(n, a, None) for n, a in base.items()]):
                f.write(bytes(chunk))
    return store, MergeEngine(store, threads=1)


def _merge(engine: MergeEngine, round_: int, mean: dict[str, np.ndarray], codec: TopK) -> dict[str, np.ndarray]:
    """Merge one round whose folded mean is ``mean``; return the round's decoded result."""
    acc = Accumulator({n: a.shape for n, a in mean.items()}, mean={n: a.copy() for n, a in mean.items()}, weight=1.0)
    engine.merge(RoundMerge("r", round_, acc, codec, Outer("avg", 1.0, 0.0), total=1.0, fraction=math.inf))
    engine.build_versions("r", round_ + 1, codec, acc.schema)
    with engine.store.read(ResultKey("r", round_)) as f:
        return {
            n: codec.decode(
                {s: f.read(w) for s, w in (("", n), ("index", n + ":index"), ("scale", n + ":scale"))}, a.shape
            )
            for n, a in mean.items()
        }


def test_the_hub_keeps_what_its_results_leave_out_across_a_restart(tmp_path: Path) -> None:
    codec = topk("topk:chunk=64,k=4,block=64")
    rng = np.random.default_rng(4)
    base = {"w": np.zeros((10, 64), np.float32), "b": np.zeros(37, np.float32)}
    means = [{n: rng.standard_normal(a.shape).astype(np.float32) for n, a in base.items()} for _ in range(6)]
    # one hub that never stops, and one that is restarted (a new Store on its data dir) every round
    _, steady = _store(tmp_path / "steady", base)
    results = [_merge(steady, r, m, codec) for r, m in enumerate(means)]
    for r, m in enumerate(means):
        store, engine = _store(tmp_path / "restarted", base)
        store.recover("r", r)
        assert store.exists(ResidualKey("r", r)) == (r > 0)
        got = _merge(engine, r, m, codec)
        assert all(got[n].tobytes() == results[r][n].tobytes() for n in base), r
        engine.close()
    # the residual is what the results left out: results + residual = the sum of the means
    with steady.store.read(ResidualKey("r", len(means))) as f:
        for n in base:
            total = sum(m[n].astype(np.float64) for m in means)
            sent = sum(res[n].astype(np.float64) for res in results)
            np.testing.assert_allclose(sent + f.read(n).reshape(base[n].shape), total, atol=1e-5)
    # an empty round sends nothing and keeps the residual as it was
    acc = Accumulator({n: a.shape for n, a in base.items()})
    steady.merge(RoundMerge("r", len(means), acc, codec, Outer("avg", 1.0, 0.0), total=1.0, fraction=math.inf))
    with (
        steady.store.read(ResidualKey("r", len(means))) as old,
        steady.store.read(ResidualKey("r", len(means) + 1)) as new,
    ):
        assert all(old.read(n).tobytes() == new.read(n).tobytes() for n in base)
    steady.close()


def test_a_codec_without_hub_feedback_writes_no_residual(tmp_path: Path) -> None:
    store, engine = _store(tmp_path, {"w": np.zeros(100, np.float32)})
    acc = Accumulator({"w": (100,)}, mean={"w": np.ones(100, np.float32)}, weight=1.0)
    engine.merge(RoundMerge("r", 0, acc, get_codec("int8"), Outer("avg", 1.0, 0.0), total=1.0, fraction=math.inf))
    assert store.exists(ResultKey("r", 0)) and not store.exists(ResidualKey("r", 1))
    engine.close()


# --- end to end -------------------------------------------------------------------------------------


def test_two_peers_end_bit_identical_through_a_hub_restart(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--min-peers", "2")
    rounds, n, run, codec = 4, 2, "sparse-e2e", "topk"
    finals: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    synced = [0] * n
    restarted = threading.Event()

    def peer(i: int) -> None:
        model = tiny_gpt2(seed=i)
        client = SyncClient(hub.url, run=run, peer=f"p{i}", min_peers=n, codec=codec, retry_seconds=60)
        client.join(model)
        for r in range(rounds):
            if r == 2:  # the hub is SIGKILLed and restarted after round 1
                assert restarted.wait(120), "the hub was not restarted"
            perturb(model, seed=i, round_=r)
            result = client.sync(model, samples=1 + i)
            assert result.version == r + 1 and not result.caught_up and result.compression > 30
            synced[i] += 1
        finals[i] = {k: v.copy() for k, v in ModelView(model).export().items()}
        client.leave()

    def restart() -> None:
        wait_for(lambda: synced == [2, 2], "two rounds", 120)
        hub.kill()
        hub.start()
        restarted.set()

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    run_peers(n, peer, timeout=240)
    thread.join(10)
    final = hub_model(hub, run)
    assert set(final) == set(finals[0])
    for name, value in final.items():
        assert value.tobytes() == finals[0][name].tobytes() == finals[1][name].tobytes(), name
    # the hub kept its error feedback through the restart: there is a residual for the last version
    residual = hub.data_dir / "runs" / run / "residual" / f"{rounds:08d}.safetensors"
    assert set(safetensors.numpy.load_file(str(residual))) == set(final)
    assert HTTP.get(f"{hub.url}/v1/runs/{run}", timeout=10).json()["config"]["codec"] == codec


def test_a_last_sync_of_topk_makes_no_flush_round(hub: Hub) -> None:
    """``sync(final=True)`` with topk: the final round (its result fp32, the hub's residual in
    it) and no round after it for the peers' residuals (``Codec.flush``: flushing topk's made
    the model worse); the peers end bit-identical to the hub."""
    n, run = 2, "sparse-final"
    ends: list[tuple[int, dict[str, np.ndarray]]] = []

    def peer(i: int) -> None:
        model = tiny_gpt2(seed=i)
        client = SyncClient(hub.url, run=run, peer=f"p{i}", min_peers=n, codec="topk")
        client.join(model)
        perturb(model, seed=i, round_=0)
        client.sync(model, samples=2)
        perturb(model, seed=i, round_=1)
        result = client.sync(model, samples=2, final=True)
        ends.append((result.version, {k: v.copy() for k, v in ModelView(model).export().items()}))
        client.leave()

    run_peers(n, peer)
    assert [v for v, _ in ends] == [2, 2], "two rounds, the last one final, and no flush round"
    final = hub_model(hub, run)
    for name, value in final.items():
        assert value.tobytes() == ends[0][1][name].tobytes() == ends[1][1][name].tobytes(), name
    result = hub.data_dir / "runs" / run / "rounds" / f"{1:08d}" / "result.safetensors"
    with safe_open(str(result), "numpy") as f:
        assert f.metadata()["codec"] == "fp32"


def test_bad_offsets_are_refused_before_the_acknowledgement(hub: Hub) -> None:
    """Parts with the run's layout and finite scales, but a repeated offset: a 422 that says why,
    and the round goes on with the honest updates."""
    run, codec = "sparse-bad", get_codec("topk:chunk=16,k=4,block=16")
    api = httpx.Client(base_url=f"{hub.url}/v1/runs/{run}", timeout=30)
    model = {"w": np.zeros((8, 8), np.float32)}
    assert api.post("/peers", json={"peer": "a", "min_peers": 2, "codec": codec.spec}).json()["state"] == "initialise"
    assert api.put("/versions/0", params={"peer": "a"}, content=_body(model, None)).status_code == 200
    assert api.post("/peers", json={"peer": "b"}).json()["state"] == "ready"
    delta = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    parts = codec.encode(delta["w"])
    parts["index"][0] = 0x11  # offsets 1, 1
    bad = b"".join(
        iter_chunks([("w", parts[""], "U8"), ("w:index", parts["index"], "U8"), ("w:scale", parts["scale"], "F32")])
    )
    r = api.put("/rounds/0/updates/a", content=bad, headers=_headers(bad))
    assert r.status_code == 422 and r.json()["error"] == "invalid_update", r.text
    assert "increasing" in r.json()["detail"]
    for peer in ("a", "b"):
        good = _body(delta, codec)
        assert api.put(f"/rounds/0/updates/{peer}", content=good, headers=_headers(good)).status_code == 200
    assert api.get("/rounds/0/result", params={"wait": 30}).status_code == 200
    api.close()


def _body(arrays: dict[str, np.ndarray], codec: Codec | None) -> bytes:
    if codec is None:
        return b"".join(iter_chunks([(n, a, "F32") for n, a in arrays.items()]))
    return b"".join(iter_chunks([(wire, part, dtype) for _, wire, part, dtype in encode_model(codec, arrays)]))


def _headers(data: bytes) -> dict[str, str]:
    digest = base64.b64encode(hashlib.sha256(data).digest()).decode()
    return {"Content-Digest": f"sha-256=:{digest}:", "X-Sync-Samples": "1"}
