"""syncserver/reduce/check.py: an update body's checks from a stream of its bytes, as a PUT's.

Pure and in-process: tiny bodies in any chunking, against what the PUT path computes (the
engine's norm over the body's file, hashlib's sha-256) and the errors it raises.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from syncserver.errors import BadRequest, InvalidUpdate, PayloadTooLarge
from syncserver.reduce.check import UpdateRules, check_update
from syncserver.reduce.engine import MergeEngine
from syncwire import encode_model, get_codec, iter_chunks, layout_bytes, wire_layout
from syncwire.format import TensorFile

SCHEMA = {"w": (64, 33), "b": (7,)}


def rules(codec: str = "int8", *, norm: bool = True, max_bytes: int | None = None) -> UpdateRules:
    c = get_codec(codec)
    layout = wire_layout(c, SCHEMA)
    return UpdateRules(layout, SCHEMA, c, max_bytes or layout_bytes(layout) + 4096, norm)


def body(codec: str = "int8", seed: int = 0, **tensors: np.ndarray) -> bytes:
    gen = np.random.default_rng(seed)
    arrays = {n: gen.normal(size=s).astype(np.float32) for n, s in SCHEMA.items()} | tensors
    parts = [(wire, a, dtype) for _, wire, a, dtype in encode_model(get_codec(codec), arrays)]
    return b"".join(bytes(c) for c in iter_chunks(parts))


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("codec", ["fp32", "int8", "topk"])
def test_a_good_body_gives_the_put_paths_digest_size_and_norm_in_any_chunking(codec: str, tmp_path: Path) -> None:
    data = body(codec)
    path = tmp_path / "update.safetensors"
    path.write_bytes(data)
    with TensorFile(path) as wire:
        expected = MergeEngine.norm(wire, get_codec(codec), SCHEMA)  # what the PUT path's guard takes
    for size in (1, 7, 4096, len(data)):
        got = check_update(chunked(data, size), rules(codec), spool=tmp_path)
        assert (got.digest, got.nbytes, got.norm) == (hashlib.sha256(data).hexdigest(), len(data), expected)
    assert check_update([data], rules(codec, norm=False)).norm is None
    assert list(tmp_path.glob("*.check")) == []  # the spool is gone


def test_every_fault_is_the_put_paths_error(tmp_path: Path) -> None:
    good = body()
    faults: list[tuple[list[bytes], UpdateRules, type[Exception], str]] = [
        ([good + b"\0"], rules(), BadRequest, "longer than"),
        ([good[:-1]], rules(), BadRequest, "truncated"),
        ([good[:5]], rules(), BadRequest, "inside the safetensors header"),
        ([good], rules(max_bytes=len(good) - 1), PayloadTooLarge, "limit"),
        (chunked(body("fp32"), 1024), rules(), InvalidUpdate, "missing"),  # the wrong codec: at its header
        ([body(extra=np.zeros(3, np.float32))], rules(), InvalidUpdate, "schema"),
        ([body("fp32", b=np.array([0, 1, np.inf, 0, 0, 0, 0], np.float32))], rules("fp32"), InvalidUpdate, "NaN"),
    ]
    for chunks, rule, error, said in faults:
        with pytest.raises(error, match=said):
            check_update(chunks, rule, spool=tmp_path)
    assert list(tmp_path.glob("*.check")) == []


def test_a_codec_that_checks_on_receipt_refuses_parts_its_decoder_refuses(tmp_path: Path) -> None:
    """topk's scale pairs must hold 0 <= lo <= hi: well-formed, finite, and still refused (422)."""
    assert get_codec("topk").check_on_receipt
    data = bytearray(body("topk"))
    path = tmp_path / "b.safetensors"
    path.write_bytes(bytes(data))
    with TensorFile(path) as wire:
        info = wire.infos["w:scale"]
    start = 8 + int.from_bytes(data[:8], "little") + info.start
    data[start : info.end - info.start + start] = np.tile(np.float32([2, 1]), (info.end - info.start) // 8).tobytes()
    with pytest.raises(InvalidUpdate, match="scales"):
        check_update([bytes(data)], rules("topk"), spool=tmp_path)
