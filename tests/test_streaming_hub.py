"""The streaming hub's pieces: slices that codecs encode and decode on their own, the NaN scan
that runs while a body streams in, ``pread`` reads, and the sliced fold and merge end to end.

Folding and merging a few MB at a time (instead of a tensor at a time) must not change a single
bit: the hub and the peers apply the same decoded bytes, so every slice boundary is checked
against whole-tensor encoding and decoding, and a real hub with tensors bigger than a slice
must still publish the exact weighted mean that every peer holds bit for bit.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import syncwire.codecs
from syncclient import SyncClient
from syncclient.weights import ModelView
from syncserver.api.factory import choose_modes
from syncserver.errors import BadRequest, InvalidUpdate
from syncserver.reduce.engine import Accumulator, MergeEngine, Outer, RoundMerge
from syncserver.settings import HubSettings, default_fold_threads
from syncserver.storage import uploads as uploads_module
from syncserver.storage.store import MomentumKey, ResidualKey, ResultKey, Store, UpdateKey, Upload, VersionKey
from syncserver.storage.uploads import Held, Received, receive
from syncwire import Codec, FormatError, decode_tensor, get_codec, iter_chunks, read_tensors, wire_name
from syncwire.codecs import slices
from syncwire.format import TensorFile
from tests.conftest import REPO, Hub
from tests.harness import run_peers, version_file


@pytest.fixture(scope="module")
def hub(module_hub: Hub) -> Hub:
    """One hub for the tests here that take ``hub``, each on runs of its own names (tests/conftest.py)."""
    return module_hub


CODECS = ["fp32", "bf16", "int8", "int4", "int8:block=100", "int4:block=6"]


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> int:
    """Slices of about 1,000 values (instead of 2^20), so that small arrays have many of them."""
    monkeypatch.setattr(syncwire.codecs, "SLICE_VALUES", 1000)
    return 1000


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("shape", [(), (7,), (4321,), (3, 1001), (2000,)])
def test_slices_encode_and_decode_like_the_whole_tensor(small_slices: int, spec: str, shape: tuple[int, ...]) -> None:
    codec = get_codec(spec)
    x = np.random.default_rng(sum(shape) + len(spec)).standard_normal(shape).astype(np.float32)
    whole = {k: np.ascontiguousarray(v).reshape(-1) for k, v in codec.encode(x).items()}
    decoded = codec.decode(codec.encode(x), shape).reshape(-1)
    cuts = slices(codec, shape)
    n = math.prod(shape)
    assert cuts[0][0] == 0 and cuts[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts)), "slices must tile the tensor"
    if n > 2 * max(small_slices, getattr(codec, "block", 1)):
        assert len(cuts) > 1, "big tensors are cut into slices"
    ends = dict.fromkeys(whole, 0)
    for start, stop, parts in cuts:
        encoded = codec.encode(x.reshape(-1)[start:stop])
        for suffix, (first, count) in parts.items():
            assert first == ends[suffix], "part ranges must tile each part"
            ends[suffix] = first + count
            got = np.ascontiguousarray(encoded[suffix]).reshape(-1)
            assert np.array_equal(got, whole[suffix][first : first + count])
        piece = {suffix: whole[suffix][first : first + count] for suffix, (first, count) in parts.items()}
        assert np.array_equal(codec.decode(piece, (stop - start,)), decoded[start:stop])
    assert ends == {k: v.size for k, v in whole.items()}


class _OneScale(Codec):
    """A codec with one scale for the whole tensor: its parts cannot be cut into slices."""

    spec = "onescale"
    lossless = False

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"": ("I8", shape), "scale": ("F32", (1,))}

    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        scale = np.float32(max(float(np.abs(x).max()), 1e-30) / 127)
        return {"": np.rint(x / scale).astype(np.int8), "scale": np.array([scale], np.float32)}

    def decode(self, parts: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        return (parts[""].astype(np.float32) * parts["scale"][0]).reshape(shape)


def test_a_codec_that_cannot_be_sliced_gets_the_whole_tensor(small_slices: int) -> None:
    assert slices(_OneScale(), (5000,)) == [(0, 5000, {"": (0, 5000), "scale": (0, 1)})]


def _body(arrays: dict[str, np.ndarray]) -> bytes:
    """A safetensors body; uint16 arrays travel as the bits of bfloat16 values."""
    items = ((k, v, "BF16" if v.dtype == np.uint16 else None) for k, v in arrays.items())
    return b"".join(bytes(c) for c in iter_chunks(items))


async def _pieces(data: bytes, seed: int) -> AsyncIterator[bytes]:
    """The body in chunks of random sizes, 1 byte to 100 kB: values split across chunks."""
    rng = random.Random(seed)
    i = 0
    while i < len(data):
        n = rng.choice([1, 2, 3, 5, 4096, 65536, 100_003])
        yield data[i : i + n]
        i += n


def _receive(data: bytes, store: Store, seed: int = 0):  # type: ignore[no-untyped-def]
    upload = store.fresh_upload()
    return asyncio.run(
        receive(_pieces(data, seed), upload, max_bytes=len(data), content_length=len(data), check_header=lambda i: None)
    )


@pytest.mark.parametrize("seed", range(4))
def test_the_scan_refuses_nan_and_inf_wherever_they_fall(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    arrays = {
        "a": rng.standard_normal(30_001).astype(np.float32),
        "q": rng.integers(-128, 127, 50_000).astype(np.int8),  # integers: never "non-finite"
        "h": rng.standard_normal((70, 33)).astype(np.float16),
        "b": (rng.integers(0, 0x7F00, 20_001)).astype(np.uint16),  # bits of finite bfloat16 values
    }
    good = _body(arrays)
    store = Store(tmp_path)
    received = _receive(good, store, seed)
    assert received.digest == hashlib.sha256(good).hexdigest()
    with received.staged.reader() as stored:
        for name, array in arrays.items():
            assert np.array_equal(stored.read(name), array.reshape(-1))
    received.staged.discard()
    for name, bad in [("a", np.float32(np.nan)), ("a", np.float32(-np.inf)), ("h", np.float16(np.inf)), ("b", 0x7FC0)]:
        poisoned = {k: v.copy() for k, v in arrays.items()}
        poisoned[name].reshape(-1)[int(rng.integers(poisoned[name].size))] = bad
        with pytest.raises(InvalidUpdate, match="NaN or Inf"):
            _receive(_body(poisoned), store, seed)
        assert not list((tmp_path / "tmp").iterdir()), "a refused body leaves no file"


@pytest.mark.parametrize("fault", ["wrong tensors", "one byte too many"])
def test_a_fault_is_refused_as_it_arrives_not_after_the_rest(tmp_path: Path, fault: str) -> None:
    """The header's bytes are checked as they come, and so is a chunk past the body's end: the
    refusal comes while the sender still holds the rest (here: never sends it)."""
    data = _body({"a": np.zeros(300_000, np.float32)})
    header = 8 + int.from_bytes(data[:8], "little")
    sent = data[: header + 100] if fault == "wrong tensors" else data + b"!"

    async def then_nothing() -> AsyncIterator[bytes]:
        step = 7 if fault == "wrong tensors" else 65536  # a slow link's pieces, or a socket's
        for i in range(0, len(sent), step):
            yield sent[i : i + step]
        await asyncio.Event().wait()  # the rest never comes

    def layout(infos: Mapping[str, object]) -> None:
        if fault == "wrong tensors":
            raise FormatError("tensors do not match the run's schema: unexpected ['a']")

    async def go() -> None:
        upload = Store(tmp_path).fresh_upload()
        got = receive(then_nothing(), upload, max_bytes=len(data) + 10, content_length=None, check_header=layout)
        await asyncio.wait_for(got, 30)

    error, said = (InvalidUpdate, "schema") if fault == "wrong tensors" else (BadRequest, "longer than")
    with pytest.raises(error, match=said):
        asyncio.run(go())
    assert not list((tmp_path / "tmp").iterdir()), "a refused body leaves no file"


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield


@pytest.mark.parametrize("forgotten", [False, True])
def test_a_held_body_completes_with_the_digest_of_every_byte(tmp_path: Path, forgotten: bool) -> None:
    """A body held for its digest (``complete=False``) is completed by an empty body from its
    end: from the hash state kept in memory, or, if that was dropped, by reading it back."""
    rng = np.random.default_rng(5)
    arrays = {"a": rng.standard_normal(30_001).astype(np.float32), "q": rng.integers(-9, 9, 7).astype(np.int8)}
    data = _body(arrays)
    store = Store(tmp_path)

    def upload() -> Upload:
        return store.resumable_upload("r", 0, "p", "key-" + "k" * 16)

    def run(chunks: AsyncIterator[bytes], offset: int, complete: bool) -> Received | Held:
        return asyncio.run(
            receive(
                chunks,
                upload(),
                max_bytes=len(data),
                content_length=len(data) - offset,
                check_header=lambda i: None,
                offset=offset,
                complete=complete,
            )
        )

    assert run(_pieces(data, 1), 0, complete=False) == Held(len(data))
    assert upload().held() == len(data) and upload().ident in uploads_module._kept
    if forgotten:
        uploads_module._kept.clear()
    received = run(_nothing(), len(data), complete=True)
    assert isinstance(received, Received) and upload().ident not in uploads_module._kept
    assert received.digest == hashlib.sha256(data).hexdigest() and received.nbytes == len(data)
    with received.staged.reader() as stored:
        assert all(np.array_equal(stored.read(n), a.reshape(-1)) for n, a in arrays.items())
    received.staged.discard()

    # a held body is checked like any other: NaN is refused before it is held
    arrays["a"][77] = np.nan
    with pytest.raises(InvalidUpdate, match="NaN or Inf"):
        run(_pieces(_body(arrays), 2), 0, complete=False)
    assert upload().held() == 0 and upload().ident not in uploads_module._kept


def test_tensor_file_reads_slices_like_the_memory_map(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays = {"w": rng.standard_normal((300, 7)).astype(np.float32), "s": np.array(3.5, np.float32)}
    path = tmp_path / "t.safetensors"
    path.write_bytes(_body(arrays))
    mapped, _ = read_tensors(str(path))
    with TensorFile(path) as f:
        assert np.array_equal(f.read("w"), mapped["w"].reshape(-1))
        assert np.array_equal(f.read("w", 17, 1001), mapped["w"].reshape(-1)[17:1001])
        assert f.read("s").tolist() == [3.5]
        part = f.read("w", 0, 5)
        part[0] = 0  # a fresh, writable array, not a view of the file
        with pytest.raises(IndexError):
            f.read("w", 5, 3000)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(FormatError):
        TensorFile(path)


class _Big(torch.nn.Module):
    """Tensors of 2.5M and 3 x 0.7M values: several 1M-value slices each, odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(2_500_001, generator=gen) * 0.02)
        self.proj = torch.nn.Parameter(torch.randn(3, 700_001, generator=gen) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(5))


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_sliced_fold_and_merge_give_the_exact_mean(hub: Hub, codec: str) -> None:
    run, samples = f"big-{codec}", {"a": 3, "b": 5}
    deltas: dict[str, dict[str, np.ndarray]] = {}
    models: dict[str, torch.nn.Module] = {}

    def peer(name: str) -> None:
        model = models[name] = _Big()
        client = SyncClient(hub.url, run=run, peer=name, codec=codec, min_peers=2, retry_seconds=60)
        client.join(model)
        view = ModelView(model)
        base = {k: v.copy() for k, v in view.export().items()}
        gen = torch.Generator().manual_seed(ord(name))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        deltas[name] = {k: v - base[k] for k, v in view.export().items()}
        assert client.sync(model, samples=samples[name]).version == 1
        client.leave()

    run_peers(len(samples), lambda i: peer(list(samples)[i]), timeout=180)
    before, after = version_file(hub, run, 0), version_file(hub, run, 1)
    for name, model in models.items():
        for key, value in model.state_dict().items():
            assert np.array_equal(value.numpy(), after[key]), (name, key)  # peers == hub, bit for bit
    if codec == "fp32":  # the exact weighted mean, against float64
        total = sum(samples.values())
        for key in after:
            mean = sum(deltas[n][key].astype(np.float64) * w for n, w in samples.items()) / total
            got = after[key].astype(np.float64) - before[key].astype(np.float64)
            np.testing.assert_allclose(got, mean, rtol=0, atol=1e-6, err_msg=key)
    else:  # the published update, decoded whole, is exactly version 1 - version 0
        result, _ = read_tensors(str(hub.data_dir / "runs" / run / "rounds" / f"{0:08d}" / "result.safetensors"))
        for key, value in before.items():
            decoded = decode_tensor(get_codec(codec), result, key, value.shape)
            assert np.array_equal(value + decoded, after[key]), key


def _update_file(codec: Codec, arrays: Mapping[str, np.ndarray]) -> bytes:
    """An update as a peer sends it: each tensor encoded a slice at a time, in the codec's parts."""
    items = []
    for name, array in arrays.items():
        flat = array.reshape(-1)
        pieces = [codec.encode(flat[start:stop]) for start, stop, _ in slices(codec, array.shape)]
        for suffix in pieces[0]:
            part = np.concatenate([np.asarray(p[suffix]).reshape(-1) for p in pieces])
            items.append((wire_name(name, suffix), part, None))
    return b"".join(bytes(chunk) for chunk in iter_chunks(items, metadata={"codec": codec.spec}))


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("outer", ["avg", "diloco"])
@pytest.mark.parametrize("spec", ["fp32", "int8", "topk:chunk=64,k=4,block=64"])
def test_the_merge_folds_what_is_not_folded_yet_to_the_same_bits(
    tmp_path: Path, spec: str, outer: str, final: bool
) -> None:
    """A close folds the updates acknowledged just before it within its merge, slice by slice:
    the result, momentum and residual are the bits of folding them first, however many were
    folded before the close or by how many threads, and the accumulator is left as it was (a
    refused merge is retried).
    A final round's fp32 result is sliced unlike lossy updates: those are folded first."""
    codec, schema = get_codec(spec), {"w": (2_100_003,), "b": (37,)}  # "w": three slices
    rng = np.random.default_rng(7)
    model = {n: rng.standard_normal(s, dtype=np.float32) for n, s in schema.items()}
    updates = [
        _update_file(codec, {n: rng.standard_normal(s, dtype=np.float32) * 1e-2 for n, s in schema.items()})
        for _ in range(3)
    ]
    weights = [3.0, 5.0, 7.0]
    written: list[list[bytes]] = []
    for eager in range(len(updates) + 1):
        store = Store(tmp_path / str(eager))
        engine = MergeEngine(store, threads=1 + eager % 3)  # SYNC_FOLD_THREADS changes no bit either
        files = [VersionKey("r", 0), *(UpdateKey("r", 0, f"p{k}") for k in range(len(updates)))]
        for key, data in zip(files, [_update_file(get_codec("fp32"), model), *updates], strict=True):
            with store.write(key) as f:
                f.write(data)
        keys = list(zip(files[1:], weights, strict=True))
        acc = Accumulator(schema)
        for key, weight in keys[:eager]:
            engine.fold(acc, key, weight, codec)
        kept = {n: a.copy() for n, a in acc.mean.items()} if acc.mean is not None else None
        # 2 x the weights: an async round's divisor, the mean scaled by half
        outer_ = Outer(outer, 0.7, 0.9)
        engine.merge(
            RoundMerge("r", 0, acc, codec, outer_, total=30.0, fraction=1.0, final=final, unfolded=keys[eager:])
        )
        folded = len(keys) if final and not codec.lossless else eager
        assert acc.weight == sum(weights[:folded]) and acc.folded == [f"p{k}" for k in range(folded)]
        if folded == eager:
            assert (acc.mean is None) == (kept is None)
            if acc.mean is not None and kept is not None:
                assert all(np.array_equal(acc.mean[n], kept[n]) for n in schema)
        outputs = [ResultKey("r", 0), MomentumKey("r", 1), ResidualKey("r", 1)]
        written.append([_bytes(store, key) for key in outputs if store.exists(key)])
        engine.close()
        store.close()
    assert len(written[0]) == 1 + (outer == "diloco") + (codec.hub_feedback and not final)
    assert all(w == written[0] for w in written[1:])


def test_the_fold_threads_setting_sizes_the_engines_pool(tmp_path: Path) -> None:
    """SYNC_FOLD_THREADS (--fold-threads) is the number of threads that fold and merge."""
    for threads in (3, None):
        settings = HubSettings(data_dir=tmp_path, **({"fold_threads": threads} if threads else {}))
        store = Store(tmp_path)
        _, workers = asyncio.run(choose_modes(settings, store))
        try:
            expected = threads or default_fold_threads()
            assert workers.engine.threads == expected == workers.engine._pool._max_workers
        finally:
            workers.engine.close()
            store.close()
    assert default_fold_threads() == min(4, os.cpu_count() or 1)


def test_a_first_fold_stops_when_told_and_leaves_the_accumulator_empty(tmp_path: Path) -> None:
    """A round that closes while its first update is folded stops that fold (its merge folds
    every update): the accumulator is left empty, not part folded; a later fold is not stoppable."""
    codec, schema = get_codec("int8"), {"w": (2_100_003,), "b": (37,)}  # four slices
    rng = np.random.default_rng(8)
    store = Store(tmp_path)
    engine = MergeEngine(store, threads=2)
    keys = [UpdateKey("r", 0, "p0"), UpdateKey("r", 0, "p1")]
    for key in keys:
        with store.write(key) as f:
            f.write(_update_file(codec, {n: rng.standard_normal(s, dtype=np.float32) for n, s in schema.items()}))
    acc = Accumulator(schema)
    asked = itertools.count()
    assert engine.fold(acc, keys[0], 3.0, codec, stop=lambda: next(asked) >= 2) is False  # after two slices
    assert acc.mean is None and acc.folded == [] and acc.weight == 0.0
    assert engine.fold(acc, keys[0], 3.0, codec, stop=lambda: False) is True
    mean = {n: a.copy() for n, a in acc.mean.items()} if acc.mean is not None else {}
    with pytest.raises(ValueError, match="only a first fold"):
        engine.fold(acc, keys[1], 5.0, codec, stop=lambda: True)
    assert acc.folded == ["p0"] and acc.weight == 3.0 and acc.mean is not None
    assert all(np.array_equal(acc.mean[n], mean[n]) for n in schema)
    engine.close()
    store.close()


def _bytes(store: Store, key: ResultKey | MomentumKey | ResidualKey) -> bytes:
    blob = store.serve(key)
    try:
        return blob.read(0, blob.size)
    finally:
        blob.close()


def test_downloads_in_big_chunks_serve_the_exact_bytes(hub: Hub) -> None:
    """Model and result bodies go out 4 MiB per read: whole, and from odd Range offsets."""
    model = _Big()
    client = SyncClient(hub.url, run="chunks", peer="a", min_peers=1, retry_seconds=30)
    client.join(model)
    client.leave()
    path = hub.data_dir / "runs" / "chunks" / "versions" / f"{0:08d}.safetensors"
    data = path.read_bytes()
    url = f"{hub.url}/v1/runs/chunks/model"
    with httpx.Client(timeout=30) as http:
        assert http.get(url).content == data
        for start in (1, (4 << 20) - 3, (8 << 20) + 5):
            r = http.get(url, headers={"Range": f"bytes={start}-"})
            assert r.status_code == 206 and r.content == data[start:], start


_ARENAS = r"""
import ctypes, ctypes.util, re, sys, tempfile, threading
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "hub":
    import syncserver.app
    _ = syncserver.app.app  # what `uvicorn syncserver.app:app` builds first (`syncserver serve` does the same)
if sys.argv[2] == "embedded":
    from syncserver import create_app
    create_app()  # a process that embeds a hub keeps glibc's arenas
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier(8)
def work():
    barrier.wait()  # all at once: each thread finds the arenas busy
    for _ in range(50):
        ctypes.create_string_buffer(1 << 16)
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
with tempfile.NamedTemporaryFile("r") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(len(re.findall(r"<heap nr=", f.read())))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc arenas")
def test_the_hub_keeps_to_two_malloc_arenas(tmp_path: Path) -> None:
    """Threads that allocate at once each get an arena of their own, which held the hub's freed
    temporaries apart (its RSS varied from run to run); a hub's process caps them at two."""

    def arenas(mode: str) -> int:
        env = {**os.environ, "SYNC_DATA_DIR": str(tmp_path)}
        env.pop("MALLOC_ARENA_MAX", None)
        proc = subprocess.run([sys.executable, "-c", _ARENAS, str(REPO), mode], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])

    assert arenas("plain") > 2, "without the cap, threads take arenas of their own (or the test shows nothing)"
    assert arenas("hub") <= 2
    assert arenas("embedded") > 2, "create_app leaves the embedding process's allocator alone"
