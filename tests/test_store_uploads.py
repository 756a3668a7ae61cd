"""Updates straight to the object store (SYNC_STORE): presigned part URLs, the hub's checks of
what arrived, the lies it refuses, a hub killed between an upload and its record, a store that
fails mid-upload. A real hub process, the session's SeaweedFS behind a FaultProxy of each test's
own (tests/test_store_wire.py), SDK peers on tiny models.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from syncclient import SyncClient
from syncserver.storage.s3 import ObjectStore
from syncwire import iter_chunks
from tests.conftest import Hub
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, Peers, wait_for
from tests.s3server import SeaweedFS
from tests.test_metrics import scrape
from tests.test_store_wire import AUTH, TOKEN, digest, metric, model_of, store_hub

SCHEMA = {"weight": (3, 4), "bias": (3,)}  # torch.nn.Linear(4, 3), as the hub knows it


def linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


@contextlib.contextmanager
def one_peer(hub: Hub, run: str = "r", **options: Any) -> Iterator[SyncClient]:
    """Peer ``p`` has started run ``run`` alone (min_peers 1): round 0 is open to it."""
    client = SyncClient(hub.url, run=run, peer="p", token=TOKEN, min_peers=1, **options)
    try:
        client.join(linear())
        yield client
    finally:
        client.close()


def body(scale: float = 0.01, **change: np.ndarray) -> bytes:
    """An fp32 update of SCHEMA (``change``: tensors to replace or add)."""
    arrays = {name: np.full(shape, scale, np.float32) for name, shape in SCHEMA.items()} | change
    return b"".join(bytes(c) for c in iter_chunks([(n, a, "F32") for n, a in arrays.items()]))


def presign(hub: Hub, key: str, size: int, round_: int = 0, peer: str = "p") -> httpx.Response:
    url = f"{hub.url}/v1/runs/r/rounds/{round_}/updates/{peer}/presign"
    return HTTP.post(url, json={"key": key, "size": size}, headers=AUTH, timeout=30)


def put_parts(plan: dict[str, Any], data: bytes) -> dict[int, str]:
    """PUT ``data`` in the plan's parts, as a peer does (no token); the store's ETags."""
    etags = {}
    for number, url in plan["urls"].items():
        start = (int(number) - 1) * plan["part_size"]
        r = HTTP.put(url, content=data[start : start + plan["part_size"]], timeout=30)
        assert r.status_code == 200, r.text
        etags[int(number)] = r.headers["etag"].strip('"')
    return etags


def uploaded(hub: Hub, key: str, data: bytes, parts: dict[int, str], *, peer: str = "p", **lie: Any) -> httpx.Response:
    report = {
        "key": key,
        "size": len(data),
        "digest": hashlib.sha256(data).hexdigest(),
        "etags": parts,
        "samples": 4,
        "metrics": {"loss": 1.5},
    } | lie
    return HTTP.post(f"{hub.url}/v1/runs/r/rounds/0/updates/{peer}/uploaded", json=report, headers=AUTH, timeout=60)


def nothing_recorded(hub: Hub, bucket: ObjectStore) -> None:
    """No update counted, no object or open upload left in the bucket."""
    state = HTTP.get(f"{hub.url}/v1/runs/r", headers=AUTH, timeout=30).json()
    assert state["updates"] == [] and state["version"] == 0, state
    assert list(bucket.list("runs/r/updates/")) == []
    assert bucket.uploads("runs/r/updates/") == []


def test_each_lie_is_refused_with_its_reason_and_nothing_recorded(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """Size caps before any URL; then for each lie (size, digest, ETags, a part missing, NaN, the
    wrong tensors) a 4xx with a JSON reason, the object deleted, nothing recorded. Then the true
    update is acknowledged once, its record names the object, and a retry gets the same ack."""
    hub = store_hub(hub_factory, seaweedfs, s3, "lies")
    bucket = seaweedfs.store("lies")
    good = body()
    peers = Peers(hub.url, "r", ["p", "q"], model=linear, token=TOKEN, min_peers=2)  # q keeps round 0 open
    peers.join()
    with contextlib.closing(peers):
        refusals = [
            (presign(hub, "k" * 16, 10**9), 413, "payload_too_large"),
            (presign(hub, "k" * 16, len(good), round_=3), 409, "conflict"),  # not the open round
            (presign(hub, "k" * 16, len(good), peer="stranger"), 404, "not_found"),
            (presign(hub, "bad/key", len(good)), 422, "invalid_request"),
        ]
        for answer, status, code in refusals:
            assert answer.status_code == status and answer.json()["error"] == code, answer.text
            assert "urls" not in answer.json()
        assert bucket.uploads("runs/r/") == []  # no URL, no upload

        longer = len(good) + 4
        lies: list[tuple[str, bytes, int, dict[str, Any], int, str]] = [
            # (what, the bytes uploaded, the size presigned, what the report says, status, reason)
            ("size-report", good, len(good), {"size": longer}, 400, "presigned for"),
            ("size-object", good, longer, {"size": longer}, 400, "the object holds"),
            ("trailing", good + b"\0" * 4, longer, {}, 400, "describes"),
            ("digest", good, len(good), {"digest": "0" * 64}, 400, "does not match"),
            ("etag", good, len(good), {"etags": {1: "0" * 32}}, 400, "another ETag"),
            ("no-part", good, len(good), {"etags": {}}, 400, "parts 1 to 1"),
            ("nan", body(bias=np.array([0, np.nan, 0], np.float32)), len(good), {}, 422, "NaN"),
            ("layout", body(extra=np.zeros(2, np.float32)), len(good) + 64, {}, 422, "schema"),
        ]
        for name, data, size, lie, status, said in lies:
            key = f"lie-{name}".ljust(16, "x")
            if name == "layout":
                size = len(data)
            plan = presign(hub, key, size).json()
            etags = put_parts(plan, data)
            answer = uploaded(hub, key, data, etags, **lie)
            assert answer.status_code == status, (name, answer.text)
            assert answer.json()["error"] and said in answer.json()["detail"], (name, answer.text)
            nothing_recorded(hub, bucket)

        plan = presign(hub, "the-true-update1", len(good)).json()
        # a name of this upload attempt's own: no other upload ever writes the object it names
        assert re.fullmatch(r"runs/r/updates/00000000/p/the-true-update1\.[0-9a-f]{16}\.safetensors", plan["object"])
        assert set(plan["urls"]) == {"1"} and plan["done"] == {}
        etags = put_parts(plan, good)
        again = presign(hub, "the-true-update1", len(good)).json()  # resumed: the part is held
        assert again["upload_id"] == plan["upload_id"] and again["urls"] == {} and again["done"] == {"1": etags[1]}
        ack = uploaded(hub, "the-true-update1", good, etags)
        assert ack.status_code == 200 and ack.json()["bytes"] == len(good) and not ack.json()["repeat"], ack.text
        repeat = uploaded(hub, "the-true-update1", good, etags)  # a retry whose answer was lost
        assert repeat.status_code == 200 and repeat.json()["repeat"] and repeat.json()["seq"] == ack.json()["seq"]
        # once acknowledged, its object is never handed out again (checked bytes stay checked)
        again = presign(hub, "the-true-update1", len(good))
        assert again.status_code == 409 and "already has an update acknowledged" in again.json()["detail"], again.text
        assert presign(hub, "another-key-xxxx", len(good)).status_code == 409
        assert bucket.head(plan["object"]) is not None
        samples = scrape(hub, TOKEN)
        assert metric(samples, "weightsync_upload_bytes_total", run="r", via="store") == len(good)
        assert metric(samples, "weightsync_upload_bytes_total", run="r", via="hub") == 0
        rejected = {k[1]: v for k, v in samples.items() if k[0] == "weightsync_updates_rejected_total"}
        assert sum(rejected.values()) >= len(lies) + len(refusals) + 2
        peers.clients["q"].leave()  # round 0 closes with p's update alone
        wait_for(lambda: HTTP.get(f"{hub.url}/v1/runs/r", headers=AUTH).json()["version"] == 1, "round 0 closed")
    # the round merged the object (the hub's own file of it does not exist): v1 = v0 + the update
    start = {k: v.detach().numpy() for k, v in linear().state_dict().items()}
    merged = model_of(hub, "r")
    for name in SCHEMA:
        np.testing.assert_array_equal(merged[name], start[name] + np.float32(0.01))
    assert not list((hub.data_dir / "runs/r/rounds/00000000/updates").glob("*.safetensors"))
    assert " 500 " not in hub.log() and "Traceback" not in hub.log()
    bucket.close()


def test_a_url_for_another_key_or_expired_is_refused(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """A presigned part URL moved to another object, or to another part, is refused by the
    store (403); so is one past its life. Asking the hub again for the same key gives fresh
    URLs for the same upload, and the update goes in."""
    hub = store_hub(hub_factory, seaweedfs, s3, "urls", "--store-url-seconds", "2")
    data = body()
    with one_peer(hub):
        plan = presign(hub, "k" * 16, len(data)).json()
        url = plan["urls"]["1"]
        for forged in (
            url.replace("/kkkkkkkkkkkkkkkk.", "/other-key-xxxxxx."),
            url.replace("partNumber=1", "partNumber=2"),
        ):
            assert forged != url
            r = HTTP.put(forged, content=data, timeout=30)
            assert r.status_code == 403, r.text
        # SigV4 dates are whole seconds: a 2 s URL has expired 3 s after it was handed out
        while time.time() < plan["expires"] + 1.5:
            time.sleep(0.1)
        r = HTTP.put(url, content=data, timeout=30)
        assert r.status_code == 403, r.text
        fresh = presign(hub, "k" * 16, len(data)).json()
        assert fresh["upload_id"] == plan["upload_id"] and fresh["urls"]["1"] != url
        ack = uploaded(hub, "k" * 16, data, put_parts(fresh, data))
        assert ack.status_code == 200, ack.text


def test_hub_killed_between_upload_and_record_deletes_the_orphan(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """SIGKILL while the hub completes a peer's upload (the object is whole in the bucket, its
    record never written): the restart deletes the orphan; the SDK peer, riding through on its
    retries, is told the upload is unknown, uploads afresh under a name of that attempt's own
    and is acknowledged: the record names the new object, the orphan's name is gone. Then a raw
    upload left open (parts, no report) is aborted by the next restart."""
    hub = store_hub(hub_factory, seaweedfs, s3, "crash-up")
    bucket = seaweedfs.store("crash-up")
    with one_peer(hub, retry_seconds=60) as client:
        # the store's answer to the hub's CompleteMultipartUpload is held: the object exists
        s3.stall(seconds=60, match=f"POST /{seaweedfs.bucket}/crash-up/runs/r/updates/", header="uploadid=")
        model = linear()
        client.pull(model)
        with torch.no_grad():
            model.weight.add_(0.5)
        pending = client.sync_async(model, samples=4)
        wait_for(lambda: any(True for _ in bucket.list("runs/r/updates/")), "the update whole in the bucket")
        (orphan,) = [info.name for info in bucket.list("runs/r/updates/")]
        hub.kill()
        s3.clear()
        hub.start()
        result = pending.apply(model)
        assert result.version == 1 and client.version == 1
        # the orphan went at the restart; the peer's retry uploaded the same key afresh, to a new name
        assert "object_store_orphans_deleted run=r objects=1 uploads=0" in hub.log()
        assert hub.log().index("object_store_orphans_deleted") < hub.log().index("update_acked")
        (kept,) = [info.name for info in bucket.list("runs/r/updates/")]
        assert kept != orphan and kept.rsplit(".", 2)[0] == orphan.rsplit(".", 2)[0]  # the same key
        np.testing.assert_array_equal(model.weight.detach().numpy(), model_of(hub, "r")["weight"])

        plan = presign(hub, "left-open-xxxxxx", len(body()), round_=1).json()
        put_parts(plan, body())
        hub.kill()
        hub.start()
        assert bucket.uploads("runs/r/") == []
        assert "object_store_orphans_deleted run=r objects=0 uploads=1" in hub.log()
        assert bucket.head(kept) is not None  # the acknowledged update stays
    bucket.close()


def test_store_failing_mid_upload_falls_back_to_the_hub(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The peer has its plan, and then every part PUT to the store is cut: after its (short)
    retries the SDK sends that round's update to the hub by PUT, with one warning; the round
    closes on the same bits, and the next round goes to the store again."""
    hub = store_hub(hub_factory, seaweedfs, s3, "fallback")
    with one_peer(hub, retry_seconds=2) as client:
        model = linear()
        client.pull(model)
        s3.cut(after=0, match=f"PUT /{seaweedfs.bucket}/fallback/runs/r/updates/", times=1000)
        with torch.no_grad():
            model.weight.add_(0.25)
        with caplog.at_level(logging.WARNING, logger="syncclient"):
            assert client.sync(model, samples=4).version == 1
        said = [r.getMessage() for r in caplog.records if "the object store failed for round 0" in r.getMessage()]
        assert len(said) == 1, caplog.text
        samples = scrape(hub, TOKEN)
        assert metric(samples, "weightsync_upload_bytes_total", run="r", via="hub") > 0
        assert metric(samples, "weightsync_upload_bytes_total", run="r", via="store") == 0
        s3.clear()
        with torch.no_grad():
            model.weight.add_(0.25)
        assert client.sync(model, samples=4).version == 2
        samples = scrape(hub, TOKEN)
        assert metric(samples, "weightsync_upload_bytes_total", run="r", via="store") > 0
        np.testing.assert_array_equal(model.weight.detach().numpy(), model_of(hub, "r")["weight"])
    assert " 500 " not in hub.log()


def test_int8_with_the_norm_guard_through_the_store_is_bit_identical(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """A two-part codec (values + scales, merged through ranged GETs of each object) and the
    norm guard (the check decodes each update): two peers end on the bits of a hub without a
    store."""

    def run(hub: Hub) -> str:
        peers = Peers(hub.url, "q", ["a", "b"], token=TOKEN, min_peers=2, codec="int8", norm_guard=10.0)
        peers.join()
        for r in range(2):
            peers.parallel(["a", "b"], lambda n, r=r: peers.sync(n, samples=4 + (n == "b"), seed=10 * r + (n == "b")))
        peers.close()
        return digest(model_of(hub, "q"))

    plain = hub_factory(env={"SYNC_TOKEN": TOKEN})
    stored = store_hub(hub_factory, seaweedfs, s3, "int8")
    assert run(stored) == run(plain)
    samples = scrape(stored, TOKEN)
    assert metric(samples, "weightsync_upload_bytes_total", run="q", via="hub") == 0
    uploaded_bytes = metric(samples, "weightsync_upload_bytes_total", run="q", via="store")
    assert uploaded_bytes > 0
    # the hub read each update once to check it, and again to merge it (ranged GETs)
    assert metric(samples, "weightsync_store_read_bytes_total") >= 2 * uploaded_bytes
    # the run view (dashboard, status) says where the bytes went, as /metrics does
    run_view = HTTP.get(f"{stored.url}/v1/dashboard", params={"run": "q"}, headers=AUTH, timeout=30).json()["run"]
    assert run_view["traffic"] == {
        direction: {
            via: metric(samples, f"weightsync_{direction}load_bytes_total", run="q", via=via)
            for via in ("hub", "store")
        }
        for direction in ("up", "down")
    }
    assert run_view["traffic"]["down"]["store"] > 0  # results through the hub's 307s
