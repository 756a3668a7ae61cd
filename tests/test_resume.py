"""Interrupted transfers resume instead of starting over.

Uploads: the hub keeps the bytes of an update cut mid-body (a partial file named after run,
round, peer and digest); the SDK asks ``HEAD`` how many it holds and sends the rest with
``Upload-Offset``. Downloads: ``Range`` + ``If-Range``. The fault proxy cuts the links and
counts the body bytes that really reached the hub, which is how "re-sent" is measured here.
"""

from __future__ import annotations

import base64
import hashlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx
import numpy as np
import pytest
import torch

from syncclient import HubUnreachable, SyncClient, SyncError
from syncclient.weights import ModelView
from syncwire import iter_chunks
from tests.conftest import Hub
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, hub_model, round_record, run_peers, wait_for
from tests.models import tiny_gpt2

MiB = 1 << 20


@pytest.fixture(scope="module")
def hub(module_hub: Hub) -> Hub:
    """One hub for the tests here that neither kill it nor set its lease, each on runs of its own
    names (tests/conftest.py); the proxy in front of it is each test's own."""
    return module_hub


@pytest.fixture
def proxied_hub(hub: Hub) -> Iterator[tuple[Hub, FaultProxy]]:
    with FaultProxy(hub.port) as proxy:
        yield hub, proxy


def big_model(seed: int = 0) -> torch.nn.Module:
    """~52 MB of float32: big enough that re-sending it all would show."""
    torch.manual_seed(seed)
    return torch.nn.Linear(3600, 3600, bias=False)


def test_upload_cut_at_90_percent_resends_only_the_rest(proxied_hub: tuple[Hub, FaultProxy]) -> None:
    hub, proxy = proxied_hub
    model = big_model()
    client = SyncClient(proxy.url, run="big", peer="p1", min_peers=1, timeout=30, retry_seconds=60)
    client.join(model)
    base = {k: v.copy() for k, v in ModelView(model).export().items()}
    with torch.no_grad():
        model.weight.add_(torch.randn(model.weight.shape, generator=torch.Generator().manual_seed(1)) * 1e-3)
    delta = ModelView(model).export()["weight"] - base["weight"]
    size = sum(len(c) for c in iter_chunks([("weight", delta, "F32")]))
    cut_at = int(0.9 * size)
    puts = "PUT /v1/runs/big/rounds/0/updates/p1"
    proxy.cut(after=cut_at, match=puts)

    result = client.sync(model, samples=7)

    attempts = proxy.matching(puts)
    assert [a.fault for a in attempts] == ["cut", "", ""]
    assert attempts[0].body_bytes == cut_at
    resent = attempts[1].body_bytes
    # the hub kept what arrived (uvicorn may drop its last buffered read on a disconnect)
    assert size - cut_at <= resent <= size - cut_at + MiB, (resent, size)
    assert f"upload-offset: {size - resent}" in attempts[1].head
    # the request that completes the upload: its digest, from the end, no body
    assert attempts[2].body_bytes == 0 and f"upload-offset: {size}" in attempts[2].head
    assert "content-digest:" in attempts[2].head and "content-digest:" not in attempts[1].head
    assert len(proxy.matching("HEAD /v1/runs/big/rounds/0/updates/p1")) == 1
    print(f"\n{size / 1e6:.1f} MB update cut at 90%: re-sent {resent / 1e6:.2f} MB ({resent / size:.1%})")
    # applied once, whole: the version is v0 + delta and the round counted it once
    assert result.version == 1
    status = client.status()
    (round0,) = status["rounds"]
    assert round0["participants"] == ["p1"] and round0["samples"] == 7 and round0["bytes_in"] == size
    merged = hub_model(hub, "big")["weight"]
    np.testing.assert_allclose(merged, base["weight"] + delta, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(merged, ModelView(model).export()["weight"])
    client.leave()


def test_an_update_with_nan_stops_its_upload_and_counts_nothing(hub: Hub) -> None:
    """The SDK uploads while it encodes, so a NaN is found after the body started: the upload
    stops there, the sync fails with what happened, the hub counts nothing, and once the model
    is mended the next sync is an ordinary one."""
    model = big_model()
    client = SyncClient(hub.url, run="nan", peer="p1", min_peers=1, timeout=30, retry_seconds=5)
    client.join(model)
    with torch.no_grad():
        model.weight[-1, -1] = float("nan")  # the last slice: its encode ends last
    with pytest.raises(SyncError, match=r"'weight' holds NaN or Inf"):
        client.sync(model, samples=1)
    status = client.status()
    assert status["version"] == 0 and status["open_round"]["submitted"] == []
    with torch.no_grad():
        model.weight[-1, -1] = 0.0
    assert client.sync(model, samples=2).version == 1
    (round0,) = client.status()["rounds"]
    assert round0["participants"] == ["p1"] and round0["samples"] == 2
    client.leave()


def test_download_cut_resumes_with_range(proxied_hub: tuple[Hub, FaultProxy]) -> None:
    hub, proxy = proxied_hub
    first = big_model(0)
    initialiser = SyncClient(hub.url, run="dl", peer="a", min_peers=1, timeout=30)
    initialiser.join(first)
    initialiser.leave()
    size = len(HTTP.get(f"{hub.url}/v1/runs/dl/model", timeout=30).content)

    # a model download cut at 60%: the rest comes with Range, not the whole file again
    proxy.cut_response(after=int(0.6 * size), match="GET /v1/runs/dl/model")
    second = big_model(1)
    client = SyncClient(proxy.url, run="dl", peer="b", timeout=30, retry_seconds=60)
    client.join(second)
    gets = proxy.matching("GET /v1/runs/dl/model")
    assert [g.fault for g in gets] == ["cut_response", ""]
    assert "range: bytes=" in gets[1].head and "if-range:" in gets[1].head
    assert gets[1].response_bytes < 0.45 * size, (gets[1].response_bytes, size)
    assert torch.equal(second.weight, first.weight)

    # a round result cut at 30%: same
    with torch.no_grad():
        second.weight.mul_(0.5)
    proxy.cut_response(after=int(0.3 * size), match="GET /v1/runs/dl/rounds/0/result")
    client.sync(second, samples=1)
    results = proxy.matching("GET /v1/runs/dl/rounds/0/result")
    assert [r.fault for r in results] == ["cut_response", ""]
    assert results[1].response_bytes < 0.75 * size
    np.testing.assert_array_equal(hub_model(hub, "dl")["weight"], ModelView(second).export()["weight"])


def test_downloads_ask_the_socket_for_a_mebibyte_at_a_time(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    """httpcore reads 64 KiB at a time; the SDK's plain-HTTP connections ask for 1 MiB
    (syncclient.transport._LargeReads), which a 500 MB result costs far less CPU to receive."""
    asked: list[int] = []
    read = httpcore._backends.sync.SyncStream.read

    def spy(self: httpcore._backends.sync.SyncStream, max_bytes: int, timeout: float | None = None) -> bytes:
        asked.append(max_bytes)
        return read(self, max_bytes, timeout)

    monkeypatch.setattr(httpcore._backends.sync.SyncStream, "read", spy)
    first, second = big_model(0), big_model(1)
    initialiser = SyncClient(hub.url, run="reads", peer="a", min_peers=1, timeout=30)
    initialiser.join(first)
    initialiser.leave()
    client = SyncClient(hub.url, run="reads", peer="b", timeout=30)
    client.join(second)  # downloads version 0 (52 MB)
    client.leave()
    assert torch.equal(second.weight, first.weight)
    assert asked and set(asked) == {MiB}, sorted(set(asked))


# ---- the protocol itself, with raw HTTP -------------------------------------------------------


def update_body(model: torch.nn.Module, scale: float) -> bytes:
    arrays = ModelView(model).export()
    return b"".join(bytes(c) for c in iter_chunks([(n, np.full_like(a, scale), "F32") for n, a in arrays.items()]))


def digest_header(body: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"


def joined(hub: Hub, run: str, peers: list[str]) -> torch.nn.Module:
    """A started run (version 0 from the first peer; all peers members, min_peers 1)."""
    model = tiny_gpt2(0)
    clients = [SyncClient(hub.url, run=run, peer=p, min_peers=1) for p in peers]
    run_peers(len(clients), lambda i: clients[i].join(tiny_gpt2(0)), timeout=60)
    for c in clients:
        c.close()  # no heartbeats: these tests drive the peers by hand
    return model


def start_upload(hub: Hub, path: str, headers: dict[str, str], first: bytes) -> socket.socket:
    """A PUT whose body stops after ``first`` (the socket stays open: a stalled link)."""
    sock = socket.create_connection(("127.0.0.1", hub.port))
    head = f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode() + f"{len(first):x}\r\n".encode() + first + b"\r\n")
    return sock


def test_resume_protocol(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--lease-seconds", "30")
    model = joined(hub, "proto", ["a", "b"])
    http = httpx.Client(base_url=hub.url, timeout=30)
    path = "/v1/runs/proto/rounds/0/updates/a"
    body = update_body(model, 0.01)
    headers = {"Content-Digest": digest_header(body), "X-Sync-Samples": "3"}
    half = len(body) // 2

    # nothing held yet
    r = http.head(path, headers=headers)
    assert r.status_code == 204 and r.headers["upload-offset"] == "0" and r.headers["upload-complete"] == "?0"

    # a first attempt stalls half way; asking for the offset takes over from it
    sock = start_upload(hub, path, headers, body[:half])
    wait_for(lambda: "a" in http.get("/v1/runs/proto").json()["open_round"]["uploading"], "upload start", 10)
    held = int(http.head(path, headers=headers).headers["upload-offset"])
    assert held == half
    sock.settimeout(10)
    answer = b""
    while b'"detail"' not in answer and (more := sock.recv(4096)):
        answer += more
    assert answer.startswith(b"HTTP/1.1 409"), answer  # the stalled attempt was told it is over
    assert b'"error":"superseded"' in answer and b"newer attempt" in answer, answer
    sock.close()

    # resuming past what is held: 409 upload_offset, with what is held
    r = http.put(path, headers={**headers, "Upload-Offset": str(held + 10)}, content=body[held + 10 :])
    assert r.status_code == 409 and r.json()["error"] == "upload_offset" and r.json()["upload_offset"] == held

    # a resumed body whose rest does not match the digest: refused, and the partial is dropped
    bad = body[held:-4] + b"\0\0\0\0"
    r = http.put(path, headers={**headers, "Upload-Offset": str(held)}, content=bad)
    assert r.status_code == 400 and "digest" in r.json()["detail"]
    assert http.head(path, headers=headers).headers["upload-offset"] == "0"

    # cut again, then resume with the right rest: acknowledged once, whole
    sock = start_upload(hub, path, headers, body[:half])
    wait_for(lambda: "a" in http.get("/v1/runs/proto").json()["open_round"]["uploading"], "upload start", 10)
    sock.close()  # the peer vanishes
    wait_for(lambda: not http.get("/v1/runs/proto").json()["open_round"]["uploading"], "hub to notice", 10)
    held = int(http.head(path, headers=headers).headers["upload-offset"])
    assert 0 < held <= half
    r = http.put(path, headers={**headers, "Upload-Offset": str(held)}, content=body[held:])
    assert r.status_code == 200 and r.json()["repeat"] is False and r.json()["bytes"] == len(body)

    # acknowledged: HEAD says complete; a PUT from the end gets the same ack again
    r = http.head(path, headers=headers)
    assert r.headers["upload-offset"] == str(len(body)) and r.headers["upload-complete"] == "?1"
    r = http.put(path, headers={**headers, "Upload-Offset": str(len(body))}, content=b"")
    assert r.status_code == 200 and r.json()["repeat"] is True

    # b leaves half an upload behind; its partial goes when the round closes
    b_path = "/v1/runs/proto/rounds/0/updates/b"
    b_body = update_body(model, 0.02)
    b_headers = {"Content-Digest": digest_header(b_body), "X-Sync-Samples": "1"}
    start_upload(hub, b_path, b_headers, b_body[:half]).close()
    partials = Path(hub.data_dir) / "tmp" / "partials" / "proto" / f"{0:08d}"
    wait_for(lambda: any(partials.rglob("*.part")), "b's partial", 10)
    http.post("/v1/runs/proto/peers/b/leave")  # only a is waited for now: the round closes
    wait_for(lambda: http.get("/v1/runs/proto").json()["version"] == 1, "round 0 to close", 60)
    # the partials of a closed round go with the housekeeping after the commit, in the background
    wait_for(lambda: not partials.exists(), "round 0's partials to be dropped", 60)
    # b comes back: a late resume of its upload is told the round is over, and where to go
    assert http.post("/v1/runs/proto/peers", json={"peer": "b"}).status_code == 200
    r = http.put(b_path, headers={**b_headers, "Upload-Offset": str(half)}, content=b_body[half:])
    assert r.status_code == 409 and r.json()["error"] == "round_closed" and r.json()["current_version"] == 1


def race(hub: Hub, path: str, headers: dict[str, str], body: bytes, attempts: int) -> list[tuple[int, Any]]:
    """``attempts`` tries at one upload, each superseding the one before while it streams: the
    first two at once, then each once the one before has sent half its body; every second
    one a HEAD and a resume from what the hub holds (the SDK's retry), the others whole
    PUTs. Returns each one's status and JSON answer."""
    go = [threading.Event() for _ in range(attempts + 1)]
    go[0].set()
    go[1].set()

    def attempt(i: int) -> tuple[int, Any]:
        go[i].wait(60)
        try:
            with httpx.Client(base_url=hub.url, timeout=60) as http:
                offset = 0
                if i % 2 == 0 and i:
                    r = http.head(path, headers=headers)
                    assert r.status_code == 204, r.text
                    offset = int(r.headers["upload-offset"])

                def rest() -> Iterator[bytes]:
                    left = memoryview(body)[offset:]
                    for at in range(0, len(left), MiB):
                        if at >= len(left) // 2:
                            go[i + 1].set()  # the next attempt, while this one streams
                        yield bytes(left[at : at + MiB])

                resume = {"Upload-Offset": str(offset)} if offset else {}
                r = http.put(path, headers={**headers, **resume}, content=rest())
                return r.status_code, r.json()
        finally:
            go[i + 1].set()

    return run_peers(attempts, attempt, timeout=120)


def test_a_peer_racing_its_own_retries_is_acknowledged_once(hub_factory: Callable[..., Hub]) -> None:
    """A client whose upload times out on its side retries while the hub still receives the
    first body (a slow link does that), and may do so again and again. Per round, eight attempts
    at one 17 MiB update: two whole PUTs at once, then each next attempt once the one before has
    sent half its body, alternately a HEAD + resume from what the hub holds (the SDK's retry)
    and a whole PUT. Each one supersedes the one before while that one's bytes still arrive.
    Every attempt gets the update's acknowledgement or ``409 superseded`` with a reason; the
    update is counted once; the hub logs no traceback. Three rounds, each closed by its update
    (min_peers 1), so the closed round's partials are pruned while the last attempts finish.

    Was: a superseded attempt awaiting its worker thread's write of an 8 MiB batch walked away
    from it (anyio's shield does not cover the task that awaits the thread), and its resuming
    successor found a partial with bytes out of order: a 400 (digest), 413 or 422 for a valid
    update in 5 of 6 runs of this test (the superseded attempts' old ``400 incomplete`` let
    through); a cancel during the finish of a body whose partial the round's close pruned was a
    500 (``AssertionError`` in ``Upload.append``)."""
    hub = hub_factory("--lease-seconds", "60")
    http = httpx.Client(base_url=hub.url, timeout=60)
    rng = np.random.default_rng(0)
    shape = (1088, 4096)  # 17 MiB of float32: just over two of the hub's 8 MiB write batches
    initial = b"".join(bytes(c) for c in iter_chunks([("w", rng.standard_normal(shape, np.float32), "F32")]))
    assert http.post("/v1/runs/race/peers", json={"peer": "a", "min_peers": 1}).json()["state"] == "initialise"
    assert http.put("/v1/runs/race/versions/0", params={"peer": "a"}, content=initial).status_code == 200
    for round_ in range(3):
        delta = (rng.standard_normal(shape, np.float32) * 0.01).astype(np.float32)
        body = b"".join(bytes(c) for c in iter_chunks([("w", delta, "F32")]))
        path = f"/v1/runs/race/rounds/{round_}/updates/a"
        headers = {"Content-Digest": digest_header(body), "X-Sync-Samples": "3"}
        answers = race(hub, path, headers, body, attempts=8)
        for status_code, answer in answers:
            assert status_code in (200, 409), answer
            if status_code == 409:
                assert answer["error"] == "superseded" and "newer attempt" in str(answer["detail"]), answer
        acks = [a for s, a in answers if s == 200]
        assert [a["repeat"] for a in acks].count(False) == 1, answers
        assert {(a["round"], a["bytes"], a["samples"]) for a in acks} == {(round_, len(body), 3)}, acks
        r = http.get(f"/v1/runs/race/rounds/{round_}/result", params={"wait": 60})
        assert r.status_code == 200, r.text
        record = round_record(hub, "race", round_)
        assert record["participants"] == ["a"] and record["samples"] == 3, record
    assert "Traceback" not in hub.log(), hub.log()[-3000:]


def test_a_body_held_for_its_digest(hub_factory: Callable[..., Hub]) -> None:
    """The SDK uploads while it encodes, so the digest follows the body: ``Upload-Key`` and
    ``Upload-Complete: ?0`` have the hub hold the whole body unacknowledged (202); a PUT from
    its end with the digest completes it. Nothing is counted before then, a wrong digest
    loses nothing but that body, and every step can be asked again."""
    hub = hub_factory("--lease-seconds", "30")
    model = joined(hub, "held", ["a", "b"])
    http = httpx.Client(base_url=hub.url, timeout=30)
    path = "/v1/runs/held/rounds/0/updates/a"
    body = update_body(model, 0.01)
    held = {"Upload-Key": "k" * 32, "Upload-Complete": "?0", "X-Sync-Samples": "3"}
    done = {"Upload-Key": "k" * 32, "Content-Digest": digest_header(body), "X-Sync-Samples": "3"}

    def acked() -> list[str]:
        return http.get("/v1/runs/held").json()["open_round"]["submitted"]

    # completing a body the hub never got: it holds none of it
    r = http.put(path, headers={**done, "Upload-Offset": str(len(body))}, content=b"")
    assert r.status_code == 409 and r.json()["error"] == "upload_offset" and r.json()["upload_offset"] == 0

    # the whole body, held: 202, not acknowledged, and asking again from its end holds it again
    r = http.put(path, headers=held, content=body)
    assert r.status_code == 202 and r.json() == {"held": len(body)} and acked() == []
    r = http.put(path, headers={**held, "Upload-Offset": str(len(body))}, content=b"")
    assert r.status_code == 202 and r.json() == {"held": len(body)} and acked() == []
    r = http.head(path, headers=held)
    assert r.headers["upload-offset"] == str(len(body)) and r.headers["upload-complete"] == "?0"

    # completed with the wrong digest: refused, the body is gone, nothing counted
    wrong = {**done, "Content-Digest": digest_header(body + b"x"), "Upload-Offset": str(len(body))}
    r = http.put(path, headers=wrong, content=b"")
    assert r.status_code == 400 and "digest" in r.json()["detail"]
    assert http.head(path, headers=held).headers["upload-offset"] == "0" and acked() == []

    # cut half way, resumed from what is held, then completed with the right digest
    sock = start_upload(hub, path, held, body[: len(body) // 2])
    wait_for(lambda: "a" in http.get("/v1/runs/held").json()["open_round"]["uploading"], "upload start", 10)
    sock.close()
    wait_for(lambda: not http.get("/v1/runs/held").json()["open_round"]["uploading"], "hub to notice", 10)
    offset = int(http.head(path, headers=held).headers["upload-offset"])
    assert 0 < offset <= len(body) // 2
    r = http.put(path, headers={**held, "Upload-Offset": str(offset)}, content=body[offset:])
    assert r.status_code == 202 and r.json() == {"held": len(body)}
    r = http.put(path, headers={**done, "Upload-Offset": str(len(body))}, content=b"")
    assert r.status_code == 200 and r.json()["bytes"] == len(body) and r.json()["repeat"] is False
    assert r.json()["samples"] == 3 and acked() == ["a"]

    # acknowledged: asked again with the digest, the same acknowledgement
    r = http.head(path, headers=done)
    assert r.headers["upload-offset"] == str(len(body)) and r.headers["upload-complete"] == "?1"
    r = http.put(path, headers={**done, "Upload-Offset": str(len(body))}, content=b"")
    assert r.status_code == 200 and r.json()["repeat"] is True

    http.post("/v1/runs/held/peers/b/leave")  # only a is waited for now: the round closes
    wait_for(lambda: http.get("/v1/runs/held").json()["version"] == 1, "round 0 to close", 60)


def test_stalled_upload_is_dropped_after_the_lease_and_kept_for_resume(hub_factory: Callable[..., Hub]) -> None:
    """A peer whose link died silently (no FIN) does not hold an upload open forever."""
    hub = hub_factory("--lease-seconds", "1")
    model = joined(hub, "idle", ["a", "b"])
    http = httpx.Client(base_url=hub.url, timeout=30)
    path = "/v1/runs/idle/rounds/0/updates/a"
    body = update_body(model, 0.01)
    headers = {"Content-Digest": digest_header(body), "X-Sync-Samples": "1"}
    sock = start_upload(hub, path, headers, body[:1000])
    started = time.monotonic()
    sock.settimeout(10)
    status_line = sock.recv(4096).split(b"\r\n")[0]
    assert b"400" in status_line and time.monotonic() - started < 5
    sock.close()
    r = http.head(path, headers=headers)
    assert r.status_code == 204 and r.headers["upload-offset"] == "1000"


def test_a_result_that_never_arrives_whole_is_caught_up_from(proxied_hub: tuple[Hub, FaultProxy]) -> None:
    """The SDK folds a result while it downloads. If the download fails for good midway, the
    base is part old, part new version: the sync fails, and the next one sends nothing from that
    base but adopts the latest version whole; the one after is an ordinary sync again."""
    hub, proxy = proxied_hub
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(500, 500) for _ in range(20)])  # 20 MB in 40 tensors
    client = SyncClient(proxy.url, run="torn", peer="a", min_peers=1, timeout=30, retry_seconds=1)
    client.join(model)
    proxy.cut_response(after=MiB + MiB // 2, match="GET /v1/runs/torn/rounds/0/result", times=1000)
    with torch.no_grad():
        model[0].weight.add_(0.5)
    with pytest.raises(HubUnreachable):
        client.sync(model, samples=1)  # at most a few 1.5 MB pieces of 20 MB arrive in 1 s of retries
    proxy.clear()
    caught = client.sync(model, samples=1)
    assert caught.caught_up and caught.version == 1 and caught.bytes_up == 0
    expected = hub_model(hub, "torn")
    for name, value in ModelView(model).export().items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    with torch.no_grad():
        model[1].bias.add_(0.25)
    assert client.sync(model, samples=1).version == 2
    expected = hub_model(hub, "torn")
    for name, value in ModelView(model).export().items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    client.leave()
