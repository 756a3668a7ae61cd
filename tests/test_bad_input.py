"""Bad input against a real hub: every refusal is a 4xx with a JSON reason and changes nothing.

Each test sets up its own run (two peers, raw HTTP: no SDK in the way), brings it to version 1
with a valid round, sends one kind of bad request, and then checks three things:

1. the status, the ``error`` code and a ``detail`` that says why;
2. the run's state is what it was: version, submitted updates, nothing left on disk;
3. a valid round afterwards still produces the exact sample-weighted mean (bit for bit).

Requests that httpx refuses to send (a lying Content-Length) go through ``http.client``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import itertools
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy

from syncserver.reduce.aggregate import weighted_mean
from syncwire import Codec, encode_model, get_codec, iter_chunks
from syncwire.format import MAX_HEADER_BYTES
from tests.conftest import Hub

TOKEN = "bad-input-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SCHEMA = {"h.weight": (8, 4), "h.bias": (4,)}
_names = itertools.count()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One hub for the module (each test has its own run): a token hub, so auth runs on every call.
    Its tests create a few hundred runs with the hub token: more than the default quota."""
    root = tmp_path_factory.mktemp("bad-input")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    env["SYNC_TOKEN"] = TOKEN
    args = ["--round-timeout", "600", "--max-runs-per-token", "100000"]
    hub = Hub(root / "data", args, env, root / "hub.log").start()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def api(hub: Hub) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hub.url, headers=AUTH, timeout=30) as client:
        yield client


def encode(arrays: dict[str, np.ndarray], codec: Codec | None = None) -> bytes:
    """A safetensors body: float32 arrays as they are, or encoded with ``codec``."""
    if codec is None:
        return b"".join(iter_chunks([(n, a, "F32") for n, a in arrays.items()]))
    return b"".join(iter_chunks([(wire, part, dtype) for _, wire, part, dtype in encode_model(codec, arrays)]))


def digest(data: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"


def frame(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def update_headers(data: bytes, samples: int = 1, **extra: str) -> dict[str, str]:
    return {"Content-Digest": digest(data), "X-Sync-Samples": str(samples), **extra}


@dataclass
class Run:
    """A run with peers ``a`` and ``b`` at a known version; it mirrors the hub's maths in numpy."""

    http: httpx.Client
    hub: Hub
    name: str
    codec: Codec
    model: dict[str, np.ndarray]  # the version the hub holds, float32
    version: int = 0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    @property
    def path(self) -> str:
        return f"/v1/runs/{self.name}"

    def delta(self, scale: float = 0.01) -> dict[str, np.ndarray]:
        return {n: (self.rng.standard_normal(s) * scale).astype(np.float32) for n, s in SCHEMA.items()}

    def put(
        self, peer: str, data: bytes, *, round_: int | None = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        r = self.version if round_ is None else round_
        return self.http.put(
            f"{self.path}/rounds/{r}/updates/{peer}",
            content=data,
            headers=update_headers(data) if headers is None else headers,
        )

    def state(self) -> dict[str, Any]:
        """What a refused request must not change."""
        s = self.http.get(self.path).json()
        round_dir = self.hub.data_dir / "runs" / self.name / "rounds" / f"{s['version']:08d}"
        return {
            "version": s["version"],
            "submitted": s["open_round"]["submitted"],
            "uploading": s["open_round"]["uploading"],
            "bytes_up": {p["peer"]: p["bytes_up"] for p in s["peers"]},
            "samples": {p["peer"]: p["samples"] for p in s["peers"]},
            "files": sorted(str(f.relative_to(round_dir)) for f in round_dir.rglob("*") if f.is_file()),
            # uploads in flight; a resumable partial (tmp/partials/...) is the resume's business
            "tmp": sorted(f.name for f in (self.hub.data_dir / "tmp").glob("*") if f.is_file()),
        }

    def valid_round(self, samples: tuple[int, int] = (3, 5), deltas: Any = None) -> None:
        """Both peers submit; the new version must be the exact weighted mean the hub computes."""
        d_a, d_b = deltas or (self.delta(), self.delta())
        for peer, d, n in (("a", d_a, samples[0]), ("b", d_b, samples[1])):
            if peer in self.state()["submitted"]:
                continue
            data = encode(d, self.codec)
            r = self.put(peer, data, headers=update_headers(data, n))
            assert r.status_code == 200, r.text
            assert r.json()["repeat"] is False
        result = self.http.get(f"{self.path}/rounds/{self.version}/result", params={"wait": 30})
        assert result.status_code == 200, result.text
        expected = {}
        for name, shape in SCHEMA.items():
            # the hub's fold, in acknowledgement order, then the codec round trip of the mean
            decoded = [self.codec.decode(self.codec.encode(d[name]), shape) for d in (d_a, d_b)]
            mean = weighted_mean(decoded, list(samples))
            expected[name] = self.model[name] + self.codec.decode(self.codec.encode(mean), shape)
        model = self.http.get(f"{self.path}/model")
        assert model.status_code == 200 and int(model.headers["x-sync-version"]) == self.version + 1
        got = safetensors.numpy.load(model.content)
        for name in SCHEMA:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
        self.model, self.version = expected, self.version + 1


def new_run(api: httpx.Client, hub: Hub, codec: str = "fp32") -> Run:
    """Peers ``a`` and ``b`` join, ``a`` uploads version 0, one valid round: the run is at version 1."""
    name = f"bad-{next(_names)}"
    rng = np.random.default_rng(int(name.rsplit("-", 1)[1]))
    model = {n: rng.standard_normal(s).astype(np.float32) for n, s in SCHEMA.items()}
    r = api.post(f"/v1/runs/{name}/peers", json={"peer": "a", "min_peers": 2, "codec": codec})
    assert r.json()["state"] == "initialise", r.text
    data = encode(model)
    assert api.put(f"/v1/runs/{name}/versions/0", params={"peer": "a"}, content=data).status_code == 200
    assert api.post(f"/v1/runs/{name}/peers", json={"peer": "b"}).json()["state"] == "ready"
    assert api.get(f"/v1/runs/{name}/peers/a/start", params={"wait": 5}).json()["state"] == "ready"
    run = Run(api, hub, name, get_codec(codec), model, rng=rng)
    run.valid_round()
    return run


@pytest.fixture
def run(api: httpx.Client, hub: Hub) -> Run:
    return new_run(api, hub)


def assert_refused(
    r: httpx.Response | tuple[int, dict[str, Any]], status: int, code: str, reason: str
) -> dict[str, Any]:
    """A 4xx, the JSON error code, and a detail that says why (``reason`` is a substring of it)."""
    got_status, body = (r.status_code, r.json()) if isinstance(r, httpx.Response) else r
    assert got_status == status, body
    assert body["error"] == code, body
    assert reason.lower() in str(body["detail"]).lower(), body
    return body


def refused_and_unchanged(run: Run, send: Any, status: int, code: str, reason: str) -> dict[str, Any]:
    """Send a bad request; it is refused and the run is as it was; a valid round still averages exactly."""
    before = run.state()
    body = assert_refused(send(), status, code, reason)
    assert run.state() == before
    run.valid_round()
    return body


# ---- where the update goes -------------------------------------------------------------------
def test_unknown_run(run: Run) -> None:
    data = encode(run.delta())
    refused_and_unchanged(
        run,
        lambda: run.http.put("/v1/runs/no-such-run/rounds/1/updates/a", content=data, headers=update_headers(data)),
        404,
        "not_found",
        "unknown run",
    )


def test_unknown_peer(run: Run) -> None:
    data = encode(run.delta())
    refused_and_unchanged(run, lambda: run.put("mallory", data), 404, "not_found", "not a member")


def test_past_round_is_round_closed_with_the_current_version(run: Run) -> None:
    """Peer c joined after round 0 closed: its round-0 update is late (a and b's would be repeats)."""
    assert run.http.post(f"{run.path}/peers", json={"peer": "c"}).json()["state"] == "ready"
    data = encode(run.delta())
    before = run.state()
    body = assert_refused(run.put("c", data, round_=0), 409, "round_closed", "closed without this update")
    assert body["current_version"] == 1
    assert run.state() == before
    assert run.http.post(f"{run.path}/peers/c/leave").status_code == 200  # not waited for
    run.valid_round()


def test_past_round_different_update_is_a_conflict(run: Run) -> None:
    """Peer a's round-0 update was acknowledged: another one for round 0 is a conflict."""
    data = encode(run.delta())
    body = refused_and_unchanged(run, lambda: run.put("a", data, round_=0), 409, "conflict", "different update")
    assert body["current_version"] == 1


def test_future_round_is_a_conflict(run: Run) -> None:
    data = encode(run.delta())
    body = refused_and_unchanged(run, lambda: run.put("a", data, round_=7), 409, "conflict", "not open")
    assert body["current_version"] == 1


def test_negative_round_is_invalid(run: Run) -> None:
    data = encode(run.delta())
    refused_and_unchanged(run, lambda: run.put("a", data, round_=-1), 422, "invalid_request", "round")


@pytest.mark.parametrize(
    "round_", [2**53 + 1, 2**63, 2**64, 10**30, int("9" * 400)], ids=["2^53+1", "2^63", "2^64", "1e30", "400-digits"]
)
def test_round_past_the_bound_is_invalid(run: Run, round_: int) -> None:
    """Round numbers from the path are bounded before use (a round >= 2^63 *was* a 500: sqlite)."""
    data = encode(run.delta())
    refused_and_unchanged(run, lambda: run.put("a", data, round_=round_), 422, "invalid_request", "round")
    path = f"{run.path}/rounds/{round_}"
    before = run.state()
    assert run.http.head(f"{path}/updates/a", headers=update_headers(data)).status_code == 422  # no body: HEAD
    assert_refused(run.http.get(f"{path}/result", params={"wait": 0}), 422, "invalid_request", "round")
    assert run.state() == before


@pytest.mark.parametrize(
    ("value", "reason"),
    [(str(2**70), "Upload-Offset"), ("9" * 5000, "Upload-Offset"), ("-1", "Upload-Offset")],
    ids=["2^70", "5000-digits", "negative"],
)
def test_upload_offset_past_the_bound_is_invalid(run: Run, value: str, reason: str) -> None:
    data = encode(run.delta())
    headers = update_headers(data, **{"Upload-Offset": value})
    refused_and_unchanged(run, lambda: run.put("a", data, headers=headers), 422, "invalid_request", reason)


@pytest.mark.parametrize(
    ("spec", "status", "served"),
    [
        ("bytes=" + "9" * 5000 + "-", 416, None),  # starts past the end: not satisfiable
        ("bytes=0-" + "9" * 5000, 206, "all"),  # ends past the end: the whole body
        ("bytes=-" + "9" * 5000, 206, "all"),  # the last 10^5000 bytes: the whole body
        ("bytes=1-" + "9" * 30, 206, "from 1"),
        ("bytes=²-", 200, "all"),  # not an ASCII digit: no range at all
    ],
    ids=["start", "end", "suffix", "end-30-digits", "superscript"],
)
def test_range_with_thousands_of_digits(run: Run, spec: str, status: int, served: str | None) -> None:
    """A Range header is read without parsing thousands of digits, with the meaning RFC 9110 gives."""
    whole = run.http.get(f"{run.path}/model").content
    before = run.state()
    for path in (f"{run.path}/model", f"{run.path}/rounds/0/result"):
        full = run.http.get(path).content
        r = run.http.get(path, headers={"Range": spec.encode("latin-1")})  # bytes: "²" is not ASCII
        assert r.status_code == status, (path, r.status_code)
        if served == "all":
            assert r.content == full
        elif served == "from 1":
            assert r.content == full[1:]
    assert run.http.get(f"{run.path}/model").content == whole
    assert run.state() == before


# ---- the body ------------------------------------------------------------------------------------
BAD_BODIES = {
    "not safetensors": (b"hello, hub" * 10, 422, "invalid_update", "over the"),
    "empty": (b"", 400, "bad_request", "ends after 0 bytes"),
    "ends inside the length": (b"\x10\x00\x00", 400, "bad_request", "inside the safetensors header"),
    "ends inside the header": (struct.pack("<Q", 64) + b'{"h.bias"', 400, "bad_request", "inside"),
    "header not JSON": (frame(b'{"h.bias": [1,'), 422, "invalid_update", "not valid json"),
    "header not an object": (frame(b"[1, 2, 3]     "), 422, "invalid_update", "not a json object"),
    "header length over the cap": (
        struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}",
        422,
        "invalid_update",
        "over the",
    ),
    "deeply nested header": (frame(b"[" * 20_000 + b"]" * 20_000), 422, "invalid_update", "json"),
    "duplicate key in header": (
        frame(
            b'{"h.bias": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},'
            b' "h.bias": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
            bytes(16),
        ),
        422,
        "invalid_update",
        "duplicate key",
    ),
    "offsets overlap": (
        frame(
            json.dumps(
                {
                    "h.weight": {"dtype": "F32", "shape": [8, 4], "data_offsets": [0, 128]},
                    "h.bias": {"dtype": "F32", "shape": [4], "data_offsets": [112, 128]},
                }
            ).encode(),
            bytes(128),
        ),
        422,
        "invalid_update",
        "does not start where",
    ),
    "unknown dtype": (
        frame(json.dumps({"h.bias": {"dtype": "F64", "shape": [4], "data_offsets": [0, 32]}}).encode()),
        422,
        "invalid_update",
        "unsupported dtype",
    ),
    "metadata not strings": (
        frame(json.dumps({"__metadata__": {"a": 1}}).encode()),
        422,
        "invalid_update",
        "__metadata__",
    ),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_malformed_body(run: Run, case: str) -> None:
    data, status, code, reason = BAD_BODIES[case]
    refused_and_unchanged(run, lambda: run.put("a", data), status, code, reason)


def test_truncated_body(run: Run) -> None:
    data = encode(run.delta())[:-10]  # Content-Length says what was sent; the header says more
    refused_and_unchanged(run, lambda: run.put("a", data), 400, "bad_request", "header describes")


def test_truncated_chunked_body(run: Run) -> None:
    """No Content-Length (chunked): the body simply ends early."""
    data = encode(run.delta())[:-10]

    def send() -> httpx.Response:
        return run.http.put(
            f"{run.path}/rounds/1/updates/a", content=iter([data[:50], data[50:]]), headers=update_headers(data)
        )

    refused_and_unchanged(run, send, 400, "bad_request", "truncated")


def test_body_longer_than_its_header(run: Run) -> None:
    data = encode(run.delta()) + b"\x00" * 8
    refused_and_unchanged(run, lambda: run.put("a", data), 400, "bad_request", "header describes")


def test_body_longer_than_its_header_chunked(run: Run) -> None:
    data = encode(run.delta()) + b"\x00" * 8

    def send() -> httpx.Response:
        return run.http.put(
            f"{run.path}/rounds/1/updates/a", content=iter([data[:100], data[100:]]), headers=update_headers(data)
        )

    refused_and_unchanged(run, send, 400, "bad_request", "longer than")


# ---- the tensors -----------------------------------------------------------------------------
def test_wrong_names(run: Run) -> None:
    d = run.delta()
    data = encode({"h.weight": d["h.weight"], "h.other": d["h.bias"]})
    refused_and_unchanged(run, lambda: run.put("a", data), 422, "invalid_update", "do not match the run's schema")


def test_missing_tensor(run: Run) -> None:
    data = encode({"h.weight": run.delta()["h.weight"]})
    refused_and_unchanged(run, lambda: run.put("a", data), 422, "invalid_update", "missing")


def test_extra_tensor(run: Run) -> None:
    data = encode({**run.delta(), "h.extra": np.zeros(3, np.float32)})
    refused_and_unchanged(run, lambda: run.put("a", data), 422, "invalid_update", "unexpected")


def test_wrong_shape(run: Run) -> None:
    d = run.delta()
    data = encode({"h.weight": d["h.weight"].reshape(4, 8), "h.bias": d["h.bias"]})
    refused_and_unchanged(run, lambda: run.put("a", data), 422, "invalid_update", "the run expects F32[8, 4]")


def test_wrong_dtype(run: Run) -> None:
    d = run.delta()
    data = b"".join(
        iter_chunks([("h.weight", d["h.weight"].astype(np.float16), "F16"), ("h.bias", d["h.bias"], "F32")])
    )
    refused_and_unchanged(run, lambda: run.put("a", data), 422, "invalid_update", "is F16[8, 4]")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_fp32(run: Run, bad: float) -> None:
    d = run.delta()
    d["h.weight"][3, 2] = bad
    data = encode(d)
    refused_and_unchanged(run, lambda: run.put("b", data), 422, "invalid_update", "NaN or Inf")


@pytest.mark.parametrize("bits", [0x7FC0, 0x7F80, 0xFF80, 0x7F81], ids=["nan", "inf", "-inf", "snan"])
def test_non_finite_bf16(api: httpx.Client, hub: Hub, bits: int) -> None:
    run = new_run(api, hub, codec="bf16")
    wire = {n: get_codec("bf16").encode(x)[""] for n, x in run.delta().items()}
    wire["h.bias"][1] = bits
    data = b"".join(iter_chunks([(n, a, "BF16") for n, a in wire.items()]))
    refused_and_unchanged(run, lambda: run.put("a", data), 422, "invalid_update", "NaN or Inf")


def test_fp32_body_to_a_bf16_run(api: httpx.Client, hub: Hub) -> None:
    run = new_run(api, hub, codec="bf16")
    data = encode(run.delta())
    refused_and_unchanged(run, lambda: run.put("a", data), 422, "invalid_update", "the run expects BF16")


# ---- sizes and lies ---------------------------------------------------------------------------
def raw_put(hub: Hub, path: str, headers: dict[str, str], data: bytes) -> tuple[int, dict[str, Any]]:
    """PUT with exactly these headers (httpx would fix a lying Content-Length); the JSON answer."""
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=20)
    try:
        conn.putrequest("PUT", path, skip_accept_encoding=True)
        for key, value in {**AUTH, **headers}.items():
            conn.putheader(key, value)
        conn.endheaders()
        # the hub may answer before reading it all: its answer is what we check
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.send(data)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_content_length_over_the_schema_limit_is_413(run: Run) -> None:
    """Refused from the headers alone: the hub reads none of the (never sent) 1 GB."""
    data = encode(run.delta())
    headers = {**update_headers(data), "Content-Length": str(1 << 30)}
    refused_and_unchanged(
        run,
        lambda: raw_put(run.hub, f"{run.path}/rounds/1/updates/a", headers, data[:100]),
        413,
        "payload_too_large",
        "limit",
    )


def test_oversized_header_in_a_small_run_is_413(run: Run) -> None:
    """The header may not be much bigger than the run's own: a 1 MiB header is refused early."""
    padding = b" " * (1 << 20)
    data = frame(b"{}" + padding)
    refused_and_unchanged(run, lambda: run.put("a", data), 413, "payload_too_large", "limit")


def test_chunked_body_over_the_limit_is_413(run: Run) -> None:
    """No Content-Length, a header announcing megabytes: cut off at the schema's limit."""
    head = struct.pack("<Q", 4 << 20)

    def chunks() -> Iterator[bytes]:
        yield head
        for _ in range(8):
            yield b" " * (1 << 19)

    refused_and_unchanged(
        run,
        lambda: run.http.put(f"{run.path}/rounds/1/updates/a", content=chunks(), headers=update_headers(b"")),
        413,
        "payload_too_large",
        "limit",
    )


def test_content_length_larger_than_the_body(run: Run) -> None:
    """A Content-Length that promises more than is sent: refused at once, no wait for the rest."""
    data = encode(run.delta())
    headers = {**update_headers(data), "Content-Length": str(len(data) + 64)}
    refused_and_unchanged(
        run,
        lambda: raw_put(run.hub, f"{run.path}/rounds/1/updates/a", headers, data),
        400,
        "bad_request",
        "Content-Length",
    )


def test_content_length_smaller_than_the_body(run: Run) -> None:
    """The safetensors header says the body is longer than Content-Length: refused from the header.
    (Only Content-Length bytes are sent: what follows would be parsed as the next request.)"""
    data = encode(run.delta())
    headers = {**update_headers(data), "Content-Length": str(len(data) - 64)}
    refused_and_unchanged(
        run,
        lambda: raw_put(run.hub, f"{run.path}/rounds/1/updates/a", headers, data[:-64]),
        400,
        "bad_request",
        "Content-Length",
    )


def test_lying_digest(run: Run) -> None:
    data = encode(run.delta())
    other = encode(run.delta())
    refused_and_unchanged(
        run,
        lambda: run.put("a", data, headers=update_headers(other)),
        400,
        "bad_request",
        "does not match Content-Digest",
    )


@pytest.mark.parametrize(
    "value",
    [
        "",
        "md5=:AAAA:",
        "sha-256=AAAA",
        "sha-256=:not base64!:",
        "sha-256=:" + base64.b64encode(b"short").decode() + ":",
    ],
)
def test_malformed_digest(run: Run, value: str) -> None:
    data = encode(run.delta())
    headers = {**update_headers(data), "Content-Digest": value}
    refused_and_unchanged(run, lambda: run.put("a", data, headers=headers), 400, "bad_request", "Content-Digest")


def test_missing_digest(run: Run) -> None:
    data = encode(run.delta())
    refused_and_unchanged(
        run, lambda: run.put("a", data, headers={"X-Sync-Samples": "1"}), 400, "bad_request", "Content-Digest"
    )


# ---- headers: samples and metrics -----------------------------------------------------------
@pytest.mark.parametrize(
    ("samples", "status", "code"),
    [
        ("0", 422, "invalid_update"),
        ("-5", 422, "invalid_update"),
        ("three", 422, "invalid_request"),
        ("1.5", 422, "invalid_request"),
        (str(2**70), 422, "invalid_update"),
        (str(2**53), 422, "invalid_update"),  # *was* accepted: 1e25 x 2^53 overflowed float32
        ("", 422, "invalid_request"),
    ],
)
def test_bad_samples(run: Run, samples: str, status: int, code: str) -> None:
    data = encode(run.delta())
    headers = update_headers(data, **{"X-Sync-Samples": samples})
    refused_and_unchanged(run, lambda: run.put("a", data, headers=headers), status, code, "samples")


def test_missing_samples(run: Run) -> None:
    data = encode(run.delta())
    headers = {"Content-Digest": digest(data)}
    refused_and_unchanged(run, lambda: run.put("a", data, headers=headers), 422, "invalid_request", "samples")


@pytest.mark.parametrize(
    "metrics",
    [
        "not json",
        "[1, 2]",
        '{"loss": "low"}',
        '{"loss": true}',
        '{"loss": NaN}',
        '{"loss": Infinity}',
        '{"loss": 1e400}',
        '{"loss": ' + "9" * 400 + "}",
        '{"loss": {"nested": 1}}',
        "[" * 2000 + "]" * 2000,
        '{"x": ' + "1" * 5000 + "}",
    ],
    ids=["not-json", "list", "string", "bool", "nan", "inf", "overflow", "huge-int", "nested", "deep", "too-long"],
)
def test_bad_metrics(run: Run, metrics: str) -> None:
    data = encode(run.delta())
    headers = update_headers(data, **{"X-Sync-Metrics": metrics})
    refused_and_unchanged(run, lambda: run.put("a", data, headers=headers), 400, "bad_request", "X-Sync-Metrics")


@pytest.mark.parametrize("final", ["1", "true", "?2", "?10", "yes"])
def test_bad_final_flag(run: Run, final: str) -> None:
    data = encode(run.delta())
    headers = update_headers(data, **{"X-Sync-Final": final})
    refused_and_unchanged(run, lambda: run.put("a", data, headers=headers), 400, "bad_request", "X-Sync-Final")


@pytest.mark.parametrize("warmup", [-1, 1.5, "ten", 10_000_000])
def test_bad_outer_warmup(api: httpx.Client, warmup: object) -> None:
    """A join that asks for an impossible DiLoCo warm-up is refused before any run exists."""
    name = f"bad-warmup-{next(_names)}"
    r = api.post(f"/v1/runs/{name}/peers", json={"peer": "a", "outer": "diloco", "outer_warmup": warmup})
    assert r.status_code == 422 and "outer_warmup" in r.text, r.text
    assert api.get(f"/v1/runs/{name}").status_code == 404


# ---- numbers that overflow -------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["fp32", "int8", "bf16"])
def test_updates_near_the_float32_limit_average_to_finite_weights(api: httpx.Client, hub: Hub, codec: str) -> None:
    """Two finite updates of 2e38: their float32 sum *was* Inf, served to every peer as version 2
    (fp32), or a round that never closed while the hub logged a traceback per retry (int8)."""
    run = new_run(api, hub, codec=codec)
    big = {n: np.full(s, 2e38, np.float32) for n, s in SCHEMA.items()}
    run.valid_round(deltas=(big, big))  # the exact (running) mean, the codec's round trip: 2e38
    assert all(np.isfinite(v).all() for v in run.model.values())
    run.valid_round()


def overflowing_round(run: Run, d_a: dict[str, np.ndarray], d_b: dict[str, np.ndarray]) -> dict[str, Any]:
    """a and b submit; the round closes (never loops); its record."""
    for peer, d in (("a", d_a), ("b", d_b)):
        data = encode(d, run.codec)
        assert run.put(peer, data).status_code == 200
    result = run.http.get(f"{run.path}/rounds/{run.version}/result", params={"wait": 30})
    assert result.status_code == 200, result.text
    (record,) = [r for r in run.http.get(run.path).json()["rounds"] if r["round"] == run.version]
    return dict(record)


@pytest.mark.parametrize("codec", ["fp32", "int8", "bf16"])
def test_a_round_that_would_overflow_goes_without_the_offending_update(api: httpx.Client, hub: Hub, codec: str) -> None:
    """Weights near 3e38 plus a mean of 1.5e38 overflow: the round closes without a's update
    (the largest), with b's alone; nothing non-finite is ever published, and the run goes on."""
    run = new_run(api, hub, codec=codec)
    huge = {n: np.full(s, 3e38, np.float32) for n, s in SCHEMA.items()}
    run.valid_round(deltas=(huge, huge))  # the weights are now near 3e38, finite
    d_b = run.delta()
    record = overflowing_round(run, huge, d_b)
    assert record["participants"] == ["b"] and record["dropped"] == ["a"]
    model = safetensors.numpy.load(run.http.get(f"{run.path}/model").content)
    for name, shape in SCHEMA.items():
        expected = run.model[name] + run.codec.decode(run.codec.encode(d_b[name]), shape)
        np.testing.assert_array_equal(model[name], expected, err_msg=name)
        assert np.isfinite(model[name]).all()
    run.model, run.version = model, run.version + 1
    assert "update_left_out run=" + run.name in hub.log()
    run.valid_round()


def test_a_diloco_step_that_would_overflow_changes_nothing(api: httpx.Client, hub: Hub) -> None:
    """outer_lr 10 on a mean of 1e38 overflows whoever sends it: every update is left out, the
    round closes and changes nothing (version 1 is version 0, bit for bit)."""
    name = f"bad-diloco-{next(_names)}"
    config = {"min_peers": 2, "outer": "diloco", "outer_lr": 10, "outer_warmup": 0}  # no warm-up: lr 10 at once
    assert api.post(f"/v1/runs/{name}/peers", json={"peer": "a", **config}).json()["state"] == "initialise"
    model = {n: np.ones(s, np.float32) for n, s in SCHEMA.items()}
    assert api.put(f"/v1/runs/{name}/versions/0", params={"peer": "a"}, content=encode(model)).status_code == 200
    assert api.post(f"/v1/runs/{name}/peers", json={"peer": "b"}).json()["state"] == "ready"
    run = Run(api, hub, name, get_codec("fp32"), model)
    big = {n: np.full(s, 1e38, np.float32) for n, s in SCHEMA.items()}
    record = overflowing_round(run, big, big)
    assert record["participants"] == [] and sorted(record["dropped"]) == ["a", "b"]
    after = safetensors.numpy.load(api.get(f"/v1/runs/{name}/model").content)
    for n in SCHEMA:
        np.testing.assert_array_equal(after[n], model[n])


# ---- idempotency -----------------------------------------------------------------------------
def test_same_update_again_is_harmless(run: Run) -> None:
    d_a, d_b = run.delta(), run.delta()
    data = encode(d_a)
    first = run.put("a", data, headers=update_headers(data, 3))
    assert first.status_code == 200 and first.json()["repeat"] is False
    before = run.state()
    again = run.put("a", data, headers=update_headers(data, 3))
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "repeat": True}
    assert run.state() == before
    run.valid_round(deltas=(d_a, d_b))  # counted once: the mean is still exact


def test_different_update_for_an_acknowledged_round_is_409(run: Run) -> None:
    d_a, d_b = run.delta(), run.delta()
    data = encode(d_a)
    assert run.put("a", data, headers=update_headers(data, 3)).status_code == 200
    before = run.state()
    other = encode(run.delta())
    assert_refused(run.put("a", other, headers=update_headers(other, 3)), 409, "conflict", "different update")
    assert run.state() == before
    run.valid_round(deltas=(d_a, d_b))


def test_same_update_after_its_round_closed_is_still_a_repeat(run: Run) -> None:
    d_a, d_b = run.delta(), run.delta()
    data = encode(d_a)
    run.valid_round(deltas=(d_a, d_b))
    again = run.put("a", data, round_=run.version - 1, headers=update_headers(data, 3))
    assert again.status_code == 200 and again.json()["repeat"] is True
    other = encode(run.delta())
    assert_refused(
        run.put("a", other, round_=run.version - 1, headers=update_headers(other, 3)), 409, "conflict", "different"
    )


def test_bad_update_after_a_good_one_leaves_the_good_one(run: Run) -> None:
    """Peer a is in; peer b's broken update is refused; a's update still counts, once."""
    d_a, d_b = run.delta(), run.delta()
    data = encode(d_a)
    assert run.put("a", data, headers=update_headers(data, 3)).status_code == 200
    before = run.state()
    bad = dict(d_b)
    bad["h.bias"] = bad["h.bias"].copy()
    bad["h.bias"][0] = np.nan
    assert_refused(run.put("b", encode(bad)), 422, "invalid_update", "NaN")
    assert run.state() == before
    run.valid_round(deltas=(d_a, d_b))


# ---- names, tokens, version 0 ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/v1/runs/..%2F..%2Fetc/rounds/1/updates/a", 404, "not_found"),
        ("/v1/runs/%2E%2E/rounds/1/updates/a", 422, "invalid_request"),
        ("/v1/runs/.hidden/rounds/1/updates/a", 422, "invalid_request"),
        ("/v1/runs/a%00b/rounds/1/updates/a", 422, "invalid_request"),
        ("/v1/runs/" + "r" * 65 + "/rounds/1/updates/a", 422, "invalid_request"),
        ("/v1/runs/{run}/rounds/1/updates/..%2F..%2Fx", 404, "not_found"),
        ("/v1/runs/{run}/rounds/1/updates/-x", 422, "invalid_request"),
    ],
)
def test_bad_names(run: Run, path: str, status: int, code: str) -> None:
    data = encode(run.delta())
    url = path.format(run=run.name)
    body = refused_and_unchanged(
        run, lambda: run.http.put(url, content=data, headers=update_headers(data)), status, code, ""
    )
    assert body["detail"]
    assert not list((run.hub.data_dir / "runs").glob("*etc*")) and not (run.hub.data_dir / "x").exists()


@pytest.mark.parametrize("peer", ["..", "../x", "a/b", "", " a", "a" * 65])
def test_bad_peer_names_on_join(run: Run, peer: str) -> None:
    refused_and_unchanged(
        run, lambda: run.http.post(f"{run.path}/peers", json={"peer": peer}), 422, "invalid_request", "peer"
    )


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"bearer{TOKEN}", "Bearer"]
)
def test_bad_token(run: Run, authorization: str | None) -> None:
    data = encode(run.delta())
    headers = {**update_headers(data), **({"Authorization": authorization} if authorization is not None else {})}

    def send() -> httpx.Response:
        with httpx.Client(base_url=run.hub.url, timeout=30) as anonymous:
            return anonymous.put(f"{run.path}/rounds/1/updates/a", content=data, headers=headers)

    body = refused_and_unchanged(run, send, 401, "unauthorized", "token")
    assert TOKEN not in json.dumps(body)


def test_join_with_a_different_config_is_409(run: Run) -> None:
    body = refused_and_unchanged(
        run, lambda: run.http.post(f"{run.path}/peers", json={"peer": "c", "codec": "bf16"}), 409, "conflict", "codec"
    )
    assert body["config"]["codec"] == "fp32"


def test_join_with_the_same_codec_spelled_otherwise(api: httpx.Client, hub: Hub) -> None:
    """``int8:block=64`` is ``int8`` (its default block): the same codec, not a 409 (*was* a 409)."""
    run = new_run(api, hub, codec="int8:block=64")
    r = run.http.post(f"{run.path}/peers", json={"peer": "c", "codec": "int8"})
    assert r.status_code == 200 and r.json()["config"]["codec"] == "int8", r.text
    assert run.http.post(f"{run.path}/peers/c/leave").status_code == 200
    run.valid_round()
    body = refused_and_unchanged(
        run,
        lambda: run.http.post(f"{run.path}/peers", json={"peer": "d", "codec": "int8:block=128"}),
        409,
        "conflict",
        "codec",
    )
    assert body["config"]["codec"] == "int8"


#: Run settings a join may not set: not finite, or out of the sane range (syncserver.limits).
#: Raw JSON, since ``1e999`` is how JSON spells a number that parses as Inf.
BAD_SETTINGS = {
    "outer_lr inf": '"outer_lr": 1e999',
    "outer_lr -inf": '"outer_lr": -1e999',
    "outer_lr 1e38": '"outer_lr": 1e38',
    "outer_lr nan": '"outer_lr": NaN',
    "outer_momentum 1": '"outer_momentum": 1',
    "outer_momentum inf": '"outer_momentum": Infinity',
    "round_timeout inf": '"round_timeout": 1e999',
    "round_timeout a year": '"round_timeout": 31536000',
    "norm_guard inf": '"norm_guard": 1e999',
    "norm_guard 1e300": '"norm_guard": 1e300',
    "min_peers 2^64": '"min_peers": 18446744073709551616',
    "min_merge_peers 0": '"min_merge_peers": 0',
    "codec long": '"codec": "int8:block=' + "1" * 100 + '"',
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_join_with_an_absurd_setting_is_422_and_creates_nothing(run: Run, case: str) -> None:
    field = case.split()[0]

    def join(run_name: str, peer: str) -> httpx.Response:
        body = '{"peer": "' + peer + '", ' + BAD_SETTINGS[case] + "}"
        headers = {"Content-Type": "application/json"}
        return run.http.post(f"/v1/runs/{run_name}/peers", content=body.encode(), headers=headers)

    fresh = f"absurd-{next(_names)}"
    assert_refused(join(fresh, "a"), 422, "invalid_request", field)
    assert run.http.get(f"/v1/runs/{fresh}").status_code == 404  # no run was created
    refused_and_unchanged(run, lambda: join(run.name, "c"), 422, "invalid_request", field)


def test_join_with_an_unknown_codec_is_422(run: Run) -> None:
    refused_and_unchanged(
        run,
        lambda: run.http.post(f"{run.path}/peers", json={"peer": "c", "codec": "zip"}),
        422,
        "invalid_request",
        "codec",
    )


def test_a_merge_floor_over_min_peers_is_422_and_creates_nothing(run: Run) -> None:
    """min_merge_peers 3 with min_peers 2: the run could start with fewer peers than any round needs."""
    fresh = f"floor-{next(_names)}"
    answer = run.http.post(f"/v1/runs/{fresh}/peers", json={"peer": "a", "min_peers": 2, "min_merge_peers": 3})
    assert_refused(answer, 422, "invalid_update", "min_merge_peers 3 is over min_peers 2")
    assert run.http.get(f"/v1/runs/{fresh}").status_code == 404


def test_second_version_zero_is_409(run: Run) -> None:
    data = encode(run.model)
    refused_and_unchanged(
        run,
        lambda: run.http.put(f"{run.path}/versions/0", params={"peer": "a"}, content=data),
        409,
        "conflict",
        "already has version 0",
    )


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("nan", "NaN or Inf"),
        ("f16", "must be float32"),
        ("colon", "not allowed"),
        ("empty", "no tensors"),
        ("huge-dims", "too large"),  # 0 bytes, but numpy cannot make the array: was a 500
    ],
)
def test_bad_version_zero(api: httpx.Client, hub: Hub, case: str, reason: str) -> None:
    """The initialiser's upload is checked too; a refused one leaves the run without a version."""
    name = f"bad-v0-{next(_names)}"
    assert api.post(f"/v1/runs/{name}/peers", json={"peer": "a"}).json()["state"] == "initialise"
    x = np.ones((2, 2), np.float32)
    items: list[tuple[str, np.ndarray, str]] = {
        "nan": [("w", np.full((2, 2), np.nan, np.float32), "F32")],
        "f16": [("w", x.astype(np.float16), "F16")],
        "colon": [("w:scale", x, "F32")],
        "empty": [],
        "huge-dims": [],
    }[case]
    data = b"".join(iter_chunks(items))
    if case == "huge-dims":
        data = frame(json.dumps({"w": {"dtype": "F32", "shape": [0, 2**39, 2**39], "data_offsets": [0, 0]}}).encode())
    r = api.put(f"/v1/runs/{name}/versions/0", params={"peer": "a"}, content=data)
    assert_refused(r, 422, "invalid_update", reason)
    assert api.get(f"/v1/runs/{name}").json()["version"] == -1
    assert not (hub.data_dir / "runs" / name / "versions").exists() or not list(
        (hub.data_dir / "runs" / name / "versions").iterdir()
    )
    good = encode({"w": x})
    assert api.put(f"/v1/runs/{name}/versions/0", params={"peer": "a"}, content=good).status_code == 200


def test_the_hub_log_holds_no_traceback(hub: Hub, api: httpx.Client) -> None:
    """After every bad input above, the hub logged no unhandled exception (a 500 would)."""
    log = hub.log()
    assert "Traceback" not in log, log[-3000:]
    assert " 500 " not in log
