"""The data plane keeps exactly what it acknowledged (SYNC_STORE): a presign racing an
acknowledgement, a reducer's check report the hub cannot confirm, a hub restarted without its
store, a store that hangs. A real hub process and the session's SeaweedFS; where a check lease
matters the test itself is the reducer, and holds the lease to widen the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from syncserver.core.presigned import PresignedUploads, _Open
from syncserver.records import UpdateRecord
from syncserver.settings import HubSettings
from syncserver.storage.s3 import ObjectStore, StoreUnavailable
from syncserver.storage.sigv4 import Credentials
from syncserver.storage.store import Store
from tests.conftest import Hub
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, Peers, wait_for
from tests.s3server import SeaweedFS
from tests.test_check_leases import _store_hub
from tests.test_metrics import scrape
from tests.test_reducers import ADMIN
from tests.test_status_cli import status
from tests.test_store_uploads import body, linear, one_peer, presign, put_parts, uploaded
from tests.test_store_wire import AUTH, TOKEN, metric, model_of, store_hub

REDUCER = "test-reducer"
HELD = ("--reducers", "1", "--local-reducers", "0", "--reduce-lease-seconds", "30")  # the test is the reducer


def lease(hub: Hub, wait: float = 20.0) -> dict[str, Any] | None:
    """Take the next check lease as the reducer REDUCER (None: none within ``wait``). A fold
    lease (an acknowledged update folded ahead) is reported failed: this reducer only checks,
    and the round's merge folds what no step did."""
    until = time.monotonic() + wait
    while True:
        r = HTTP.post(
            f"{hub.url}/v1/reduce/lease",
            json={"reducer": REDUCER, "wait": max(0.0, until - time.monotonic())},
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=wait + 30,
        )
        assert r.status_code in (200, 204), r.text
        if r.status_code == 204 or r.json().get("kind") != "fold":
            return r.json() if r.status_code == 200 else None
        failed = {"reducer": REDUCER, "seconds": 0.0, "bytes": 0, "error": "failed", "detail": "checks only"}
        done = HTTP.post(
            f"{hub.url}/v1/reduce/leases/{r.json()['lease']}/done",
            json=failed,
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=30,
        )
        assert done.status_code == 204, done.text


def report(hub: Hub, job: dict[str, Any], **outcome: Any) -> None:
    """Report a check lease as REDUCER says: passed (digest, nbytes), refused, or failed."""
    r = HTTP.post(
        f"{hub.url}/v1/reduce/leases/{job['lease']}/checked",
        json={"reducer": REDUCER, "seconds": 0.01, **outcome},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert r.status_code == 204, r.text


def in_background(request: Callable[[], httpx.Response]) -> Callable[[], httpx.Response]:
    """Send ``request`` on a thread; the returned call waits for its answer."""
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(request()), daemon=True)
    thread.start()

    def answer() -> httpx.Response:
        thread.join(60)
        assert answers, "no answer within 60 s"
        return answers[0]

    return answer


def checked_by_the_test(hub: Hub, peer: str, key: str, data: bytes) -> tuple[dict[str, Any], Callable[[], Any]]:
    """``peer`` presigns, uploads and reports ``data``; the test takes the check lease and holds
    it. The plan, the lease, and the call that waits for ``/uploaded``'s answer."""
    plan = presign(hub, key, len(data), peer=peer).json()
    etags = put_parts(plan, data)
    answer = in_background(lambda: uploaded(hub, key, data, etags, peer=peer))
    job = lease(hub)
    assert job is not None and job["kind"] == "check" and job["object"] == plan["object"], job
    return plan | {"job": job}, answer


def passed(data: bytes, job: dict[str, Any], digest: str | None = None) -> dict[str, Any]:
    """A pass report of ``data`` (with ``digest`` instead of its own, if given)."""
    norm = 0.01 if job["rules"]["norm"] else None
    return {"digest": digest or hashlib.sha256(data).hexdigest(), "nbytes": len(data), "norm": norm}


@contextlib.contextmanager
def held_checks(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, prefix: str
) -> Iterator[tuple[Hub, ObjectStore]]:
    """A hub with a store and one reducer, the test: peers p, q, s and t have joined run r
    (t never uploads, so round 0 stays open and no merge lease waits on the test at the end)."""
    hub = _store_hub(hub_factory, seaweedfs, prefix, *HELD)
    peers = Peers(hub.url, "r", ["p", "q", "s", "t"], model=linear, token=TOKEN, min_peers=4)
    peers.join()
    with contextlib.closing(peers), seaweedfs.store(prefix) as bucket:
        assert lease(hub, wait=0) is None  # a reducer is alive: the hub hands out the checks
        yield hub, bucket
    assert " 500 " not in hub.log() and "Traceback" not in hub.log()


def test_a_presign_racing_the_acknowledgement_never_reopens_the_object(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS
) -> None:
    """While p's update is being checked (the test holds the check lease), p presigns the same
    key again: once the update is acknowledged that presign is refused (409), no upload of any
    name is opened, and the acknowledged object, the one the record names, holds the checked
    bytes. (Before: 200 and a new multipart upload of the acknowledged object's own name.)"""
    with held_checks(hub_factory, seaweedfs, "trust-race") as (hub, bucket), FaultProxy(hub.port) as proxy:
        good = body()
        plan, acknowledged = checked_by_the_test(hub, "p", "the-true-update1", good)
        url = f"{proxy.url}/v1/runs/r/rounds/0/updates/p/presign"
        again = in_background(
            lambda: HTTP.post(url, json={"key": "the-true-update1", "size": len(good)}, headers=AUTH, timeout=60)
        )
        wait_for(lambda: any(r.done for r in proxy.matching("/presign")), "the second presign to reach the hub")
        time.sleep(0.5)  # widens the window: the presign reaches the peer's lock before the report
        report(hub, plan["job"], **passed(good, plan["job"]))
        ack = acknowledged()
        assert ack.status_code == 200 and not ack.json()["repeat"], ack.text
        refused = again()
        assert refused.status_code == 409, refused.text
        assert "already has an update acknowledged" in refused.json()["detail"]
        assert [info.name for info in bucket.list("runs/r/updates/")] == [plan["object"]]
        assert bucket.uploads("runs/r/") == []
        assert bytes(bucket.read(plan["object"])) == good


def test_a_reducer_report_the_hub_cannot_confirm_never_refuses_a_valid_update(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS
) -> None:
    """The test, as the reducer, reports another digest than the body's for q's valid update,
    and refuses s's valid update: the hub checks each body itself and acknowledges both (before:
    400 and 422); /metrics, the reducers' list and `syncserver status` count two failures of
    that reducer, and the hub's log says what each report got wrong."""
    with held_checks(hub_factory, seaweedfs, "trust-reports") as (hub, _):
        q_data = body(0.02)
        plan, acknowledged = checked_by_the_test(hub, "q", "q-update-xxxxxxx", q_data)
        report(hub, plan["job"], **passed(q_data, plan["job"], digest="f" * 64))
        ack = acknowledged()
        assert ack.status_code == 200, ack.text
        s_data = body(0.03)
        plan, acknowledged = checked_by_the_test(hub, "s", "s-update-xxxxxxx", s_data)
        lie = {"status": 422, "error": "invalid_update", "detail": "NaN in weight (it is not)"}
        report(hub, plan["job"], refused=lie)
        ack = acknowledged()
        assert ack.status_code == 200, ack.text
        state = HTTP.get(f"{hub.url}/v1/runs/r", headers=AUTH, timeout=30).json()
        assert sorted(u["peer"] for u in state["updates"]) == ["q", "s"], state

        reducers = HTTP.get(f"{hub.url}/v1/reduce/reducers", headers=AUTH, timeout=30).json()
        (listed,) = [r for r in reducers if r["name"] == REDUCER]
        assert (listed["checks"], listed["check_failures"]) == (2, 2), listed
        samples = scrape(hub, TOKEN)
        assert metric(samples, "weightsync_reducer_check_failures_total", reducer=REDUCER) == 2
        table = status(hub.url, token=ADMIN, columns=200).stdout
        assert "check failures" in table, table
        (row,) = [line for line in table.splitlines() if REDUCER in line]
        assert re.search(r"\b2\D+2\D*$", row), table  # checks 2, check failures 2
        log = hub.log()
        assert log.count(f"reducer={REDUCER}: it reported sha-256 {'f' * 64}") == 1
        assert log.count(f"reducer={REDUCER}: it refused a body that passes") == 1


def test_a_hub_restarted_without_its_store_answers_no_store_and_the_peer_puts(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """A peer's round 0 goes through the store; the hub restarts on the same data without
    SYNC_STORE: /presign answers 409 no_store, and the SDK's next sync PUTs its update to the hub
    and goes on, on the hub's bits."""
    hub = store_hub(hub_factory, seaweedfs, s3, "no-store")
    with one_peer(hub) as client:
        model = linear()
        client.pull(model)
        with torch.no_grad():
            model.weight.add_(0.25)
        assert client.sync(model, samples=4).version == 1
        assert metric(scrape(hub, TOKEN), "weightsync_upload_bytes_total", run="r", via="store") > 0
        hub.stop()
        at = hub.server.command.index("--store")
        del hub.server.command[at : at + 2]
        hub.start()
        answer = presign(hub, "k" * 16, len(body()), round_=1)
        assert answer.status_code == 409 and answer.json()["error"] == "no_store", answer.text
        with torch.no_grad():
            model.weight.add_(0.25)
        assert client.sync(model, samples=4).version == 2
        assert client.sync(model, samples=4).version == 3  # and on: the SDK PUTs from now on
        samples = scrape(hub, TOKEN)
        assert metric(samples, "weightsync_upload_bytes_total", run="r", via="hub") > 0
        np.testing.assert_array_equal(model.weight.detach().numpy(), model_of(hub, "r")["weight"])


def test_a_hung_store_costs_a_round_seconds_not_the_read_timeout(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """The store takes the hub's CreateMultipartUpload and never answers: with
    SYNC_STORE_CONTROL_SECONDS=1 the peer's /presign is a 503 store_unavailable within seconds
    (not the 30 s read timeout), and the SDK sends that round's update to the hub by PUT."""
    env = {**seaweedfs.env(), "AWS_ENDPOINT_URL": s3.url, "SYNC_TOKEN": TOKEN, "SYNC_STORE_CONTROL_SECONDS": "1"}
    hub = hub_factory("--store", f"s3://{seaweedfs.bucket}/hung", env=env)
    with one_peer(hub) as client:
        model = linear()
        client.pull(model)
        s3.stall(seconds=60, match=f"POST /{seaweedfs.bucket}/hung/runs/r/updates/")
        with torch.no_grad():
            model.weight.add_(0.25)
        started = time.monotonic()
        assert client.sync(model, samples=4).version == 1
        took = time.monotonic() - started
        assert took < 12, f"the sync took {took:.1f} s"  # the read timeout alone is 30 s
        (stalled,) = [r for r in s3.matching("/hung/runs/r/updates/") if r.fault]
        assert stalled.method == "POST" and "uploads" in stalled.target
        samples = scrape(hub, TOKEN)
        assert metric(samples, "weightsync_upload_bytes_total", run="r", via="hub") > 0
        assert "object_store_down run=r" in hub.log()


def test_the_control_deadline_is_a_validated_setting() -> None:
    """SYNC_STORE_CONTROL_SECONDS (`--store-control-seconds`): a few seconds by default, over 0
    and at most 30 (the data timeout), a number."""
    assert HubSettings().store_control_seconds == 5.0
    for bad in (0, -1, 31, math.nan, math.inf):
        with pytest.raises(ValidationError, match="store_control_seconds"):
            HubSettings(store_control_seconds=bad)
    with pytest.raises(ValueError, match="control_seconds"):
        ObjectStore("abc", credentials=Credentials("a", "b"), endpoint="http://127.0.0.1:9", control_seconds=0)


def _answer_slowly(head_after: float, body_pieces: int, gap: float) -> tuple[socket.socket, threading.Thread]:
    """A one-request stand-in for a store: it takes a listing request, waits ``head_after`` s
    before its status line, then sends the (empty) listing's body in ``body_pieces`` pieces
    ``gap`` s apart."""
    listening = socket.create_server(("127.0.0.1", 0))
    xml = b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>false</IsTruncated>'
    xml += b" " * 40 + b"</ListBucketResult>"

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listening.accept()
            with conn:
                conn.recv(65536)
                time.sleep(head_after)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(xml))
                step = -(-len(xml) // body_pieces)
                for i in range(0, len(xml), step):
                    time.sleep(gap)
                    conn.sendall(xml[i : i + step])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listening, thread


def test_a_control_call_is_bounded_to_its_first_byte_not_its_whole_answer() -> None:
    """Control deadline 0.5 s: a store that sends nothing for 1.2 s fails the call in about the
    deadline, once (three tries would take 2.75 s); one whose first byte comes at once and whose
    body comes in two pieces 0.7 s apart (S3's whitespace during a long complete; a long listing)
    is read whole."""
    for head_after, pieces, gap in ((1.2, 1, 0.0), (0.0, 2, 0.7)):
        listening, thread = _answer_slowly(head_after, pieces, gap)
        endpoint = f"http://127.0.0.1:{listening.getsockname()[1]}"
        with ObjectStore("abc", credentials=Credentials("a", "b"), endpoint=endpoint, control_seconds=0.5) as store:
            started = time.monotonic()
            if head_after:
                with pytest.raises(StoreUnavailable, match="ReadTimeout"):
                    list(store.list("runs/"))
                assert time.monotonic() - started < 1.2
            else:
                assert list(store.list("runs/")) == []
                assert time.monotonic() - started >= 1.4
        listening.close()
        thread.join(5)


def test_no_clean_up_deletes_an_object_a_record_names(tmp_path: Path) -> None:
    """A request cancelled after its acknowledgement was recorded (the peer went away while the
    round took it in) still drops its upload on the way out: the multipart upload is aborted,
    and the object the record names stays. Another attempt's object, named by no record, goes."""
    store = Store(tmp_path / "hub")
    named = "runs/r/updates/00000000/a/the-key-xxxxxxxxxx.0123456789abcdef.safetensors"
    other = named.replace("0123456789abcdef", "fedcba9876543210")
    store.record_update("r", UpdateRecord("a", 0, 1, "d" * 64, 5, {}, 10, 0.0, 0.1, base=0, object=named))
    calls: list[tuple[str, str]] = []
    objects = SimpleNamespace(
        abort_multipart=lambda name, upload_id: calls.append(("abort", name)),
        delete=lambda name: calls.append(("delete", name)),
    )
    plane = SimpleNamespace(uploads_to=lambda run: SimpleNamespace(objects=objects))
    uploads = PresignedUploads(SimpleNamespace(store=store), plane, tmp_path, None)  # type: ignore[arg-type]
    for name in (named, other):
        asyncio.run(uploads._drop(SimpleNamespace(name="r"), _Open(0, "the-key-xxxxxxxxxx", name, "u", 10, 8 << 20)))  # type: ignore[arg-type]
    assert calls == [("abort", named), ("abort", other), ("delete", other)]
