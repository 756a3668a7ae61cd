"""The object store (syncserver.storage.s3) and the SDK's presigned transfers, against a real SeaweedFS.

SeaweedFS starts once per pytest process (tests/s3server.py, ~4 s); every test here takes well
under a few seconds. The signer is also checked against AWS's published example and against
botocore's presigner on the same inputs. Nothing of ours is mocked: refusals are the server's.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import httpx
import numpy as np
import pytest
from botocore.config import Config
from botocore.session import get_session

from syncclient.exceptions import HubError, HubUnreachable
from syncclient.objects import PartedUpload, upload_parts
from syncclient.transport import Transport
from syncserver.storage import objectfile
from syncserver.storage.objectfile import ObjectTensorFile
from syncserver.storage.s3 import KeyRefused, ObjectStore, StoreRefused, StoreUnavailable
from syncserver.storage.sigv4 import Credentials, presign
from syncwire import FormatError, iter_chunks
from syncwire.format import TensorFile
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, wait_for
from tests.s3server import SeaweedFS

REPO = Path(__file__).resolve().parents[1]

MiB = 1 << 20


@pytest.fixture
def store(seaweedfs: SeaweedFS, request: pytest.FixtureRequest) -> Iterator[ObjectStore]:
    """A store under a prefix of this test's own: tests share the bucket, never a key."""
    with seaweedfs.store(f"t/{request.node.name.replace('[', '-').replace(']', '')}") as store:
        yield store


def transport(retry_seconds: float = 5.0) -> contextlib.closing[Transport]:
    """The SDK's transport as a peer has it for presigned URLs: no hub, no token."""
    return contextlib.closing(
        Transport("", run="test", token=None, verify=True, timeout=10.0, retry_seconds=retry_seconds)
    )


def closed_port() -> socket.socket:
    """A port bound and not listening: connections to it are refused for as long as it is held."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    return held


def body(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def chunks_of(data: bytes, chunk: int = MiB) -> Iterator[memoryview]:
    view = memoryview(data)
    return (view[i : i + chunk] for i in range(0, len(view), chunk))


def refused_within(send: object, deadline: float = 30.0) -> httpx.Response:
    """The first answer of ``send()`` that is a 403, polled until ``deadline`` seconds pass."""
    assert callable(send)
    end = time.monotonic() + deadline
    while True:
        response = send()
        if response.status_code == 403 or time.monotonic() > end:
            return response
        time.sleep(0.1)


# ---- the signer ------------------------------------------------------------------------------
def test_presign_matches_aws_published_example() -> None:
    """AWS's S3 documentation example of a presigned GET ("Authenticating Requests: Using Query Parameters")."""
    url = presign(
        "GET",
        "https://examplebucket.s3.amazonaws.com/test.txt",
        credentials=Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
        region="us-east-1",
        expires=86400,
        now=datetime.datetime(2013, 5, 24, tzinfo=datetime.timezone.utc),
    )
    assert url.endswith("X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404")


@pytest.mark.parametrize(
    ("endpoint", "style", "operation", "params"),
    [
        ("http://127.0.0.1:9000", "path", "put_object", {"Key": "runs/a/rounds/3/peer-1.safetensors"}),
        ("http://127.0.0.1:9000", "path", "get_object", {"Key": "runs/a/v~1.safetensors"}),
        ("https://r2.example.com", "path", "upload_part", {"Key": "x/y", "UploadId": "a/b+c=", "PartNumber": 7}),
        (None, "virtual", "get_object", {"Key": "runs/b/versions/12.safetensors"}),
        # the hub's own requests: a query without a value, and a listing's parameters
        ("http://127.0.0.1:9000", "path", "create_multipart_upload", {"Key": "r/u"}),
        ("http://127.0.0.1:9000", "path", "list_objects_v2", {"Prefix": "runs/a/", "ContinuationToken": "x/y=="}),
    ],
)
def test_presign_matches_botocore(endpoint: str | None, style: str, operation: str, params: dict[str, object]) -> None:
    """The same request signed by botocore and by us gives the same URL, parameter for parameter."""
    secret = "s3cr3t/with+signs="
    session = get_session()
    client = session.create_client(
        "s3",
        region_name="eu-west-3",
        endpoint_url=endpoint,
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key=secret,
        aws_session_token="token/session+x=" if operation == "upload_part" else None,
        config=Config(signature_version="s3v4", s3={"addressing_style": style}),
    )
    theirs = client.generate_presigned_url(operation, Params={"Bucket": "bucket-one", **params}, ExpiresIn=300)
    parts = urlsplit(theirs)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    ours = presign(
        {"put_object": "PUT", "upload_part": "PUT", "create_multipart_upload": "POST"}.get(operation, "GET"),
        f"{parts.scheme}://{parts.netloc}{httpx.URL(theirs).path}",
        credentials=Credentials("AKIDEXAMPLE", secret, query.get("X-Amz-Security-Token")),
        region="eu-west-3",
        expires=300,
        query={k: v for k, v in query.items() if not k.startswith("X-Amz-")},
        now=datetime.datetime.strptime(query["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.timezone.utc),
    )
    mine = urlsplit(ours)
    assert (mine.netloc, mine.path) == (parts.netloc, parts.path)
    assert dict(parse_qsl(mine.query, keep_blank_values=True)) == query


def test_store_urls_and_config() -> None:
    """Addressing per endpoint, and setup mistakes said before any request (ValueError)."""
    creds = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"}
    aws = ObjectStore.from_url("s3://my-bucket/pre/fix", {**creds, "AWS_REGION": "eu-west-3"})
    assert aws.presign_get("a").startswith("https://my-bucket.s3.eu-west-3.amazonaws.com/pre/fix/a?")
    assert aws.url == "s3://my-bucket/pre/fix/"
    r2 = ObjectStore.from_url("s3://b12/", {**creds, "AWS_ENDPOINT_URL": "https://acct.r2.example.com/"})
    assert r2.presign_put("k", expires=30).startswith("https://acct.r2.example.com/b12/k?")
    assert "X-Amz-Expires=30&" in r2.presign_put("k", expires=30)
    assert "X-Amz-Expires=600&" in r2.presign_get("k")  # short by default, always explicit
    with pytest.raises(ValueError, match="needs credentials"):
        ObjectStore.from_url("s3://my-bucket", {})
    with pytest.raises(ValueError, match=r"s3://bucket\[/prefix\]"):
        ObjectStore.from_url("http://my-bucket/x", creds)
    with pytest.raises(ValueError, match="no bucket name"):
        ObjectStore.from_url("s3://B_ad/x", creds)
    with pytest.raises(KeyRefused):
        ObjectStore.from_url("s3://my-bucket/a/../b", creds)
    with pytest.raises(ValueError, match="AWS_ENDPOINT_URL"):
        ObjectStore.from_url("s3://my-bucket", {**creds, "AWS_ENDPOINT_URL": "ftp://x"})
    assert ObjectStore.part_size(10 * MiB) == 8 * MiB
    assert ObjectStore.part_size(100_000 * MiB + 1) == 10 * MiB + 1  # 10,000 parts at most (rounded up)


@pytest.mark.parametrize("name", ["../escape", "a/../../b", "/abs", "a//b", "a/./b", "", "a/", "sp ace", "a\\b", "é"])
def test_key_outside_prefix_refused_before_any_request(name: str) -> None:
    """A store whose endpoint refuses every connection: a request would say StoreUnavailable."""
    with closed_port() as held:
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{held.getsockname()[1]}"}
        env |= {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"}
        with ObjectStore.from_url("s3://bucket/runs", env) as store:
            for call in (store.presign_put, store.presign_get, store.head, store.read, store.delete, store.key):
                with pytest.raises(KeyRefused):
                    call(name)
            with pytest.raises(KeyRefused):
                store.presign_part(name, "upload", 1)
            with pytest.raises(KeyRefused):
                store.delete_prefix("/")  # never the whole store


# ---- against SeaweedFS ------------------------------------------------------------------------
def test_presigned_put_then_get(store: ObjectStore) -> None:
    data = body(3 * MiB + 5)
    put = HTTP.put(store.presign_put("one/update.safetensors"), content=data)
    assert put.status_code == 200, put.text
    info = store.head("one/update.safetensors")
    assert info is not None and info.size == len(data) and info.etag == put.headers["etag"].strip('"')
    got = HTTP.get(store.presign_get("one/update.safetensors"))
    assert got.status_code == 200 and got.content == data
    ranged = HTTP.get(store.presign_get("one/update.safetensors"), headers={"Range": "bytes=100-199"})
    assert ranged.status_code == 206 and ranged.content == data[100:200]
    assert store.head("one/other") is None
    assert [o.name for o in store.list("one/")] == ["one/update.safetensors"]


def test_multipart_through_the_sdk_completed_by_the_store_read_by_ranges(store: ObjectStore) -> None:
    """Peer: parts through presigned URLs. Hub: create, complete (ETags), ranged reads, cleanup."""
    data = body(11 * MiB + 3, seed=1)
    part = ObjectStore.part_size(len(data), wanted=5 * MiB)
    upload_id = store.create_multipart("round/update")
    count = -(-len(data) // part)
    upload = PartedUpload(
        len(data), part, {n: store.presign_part("round/update", upload_id, n) for n in range(1, count + 1)}
    )
    with transport() as t:
        etags = upload_parts(t, upload, lambda: chunks_of(data, 3 * MiB + 7))  # chunks that straddle parts
    assert sorted(etags) == [1, 2, 3]
    assert store.head("round/update") is None  # nothing is visible before the hub completes it
    assert store.uploads("round/") == [type(store.uploads("round/")[0])("round/update", upload_id)]
    info = store.complete_multipart("round/update", upload_id, etags)
    assert info.size == len(data)
    for start, end in [(0, 10), (5 * MiB - 3, 5 * MiB + 3), (len(data) - 5, len(data)), (7 * MiB, None)]:
        assert store.read("round/update", start, end) == data[start:end]
    assert store.read("round/update") == data
    with pytest.raises(StoreRefused, match="InvalidRange"):
        store.read("round/update", len(data) + 10)
    assert store.uploads("round/") == []


def test_a_safetensors_object_read_a_slice_at_a_time_as_a_file_is(store: ObjectStore, tmp_path: Path) -> None:
    """ObjectTensorFile: TensorFile's interface over ranged GETs, the same values (from what its
    first GET brought, or from a GET of their own past it); a truncated object or one whose
    header claims other bytes refused as a FormatError."""
    rng = np.random.default_rng(3)
    arrays = {
        "a": rng.standard_normal((300, 7)).astype(np.float32),
        "b": rng.integers(-9, 9, 1001).astype(np.int8),
        "c": rng.standard_normal(30_000).astype(np.float32),  # past the first GET's 64 KiB: ranged reads
    }
    data = b"".join(bytes(c) for c in iter_chunks(((k, v, None) for k, v in arrays.items()), {"round": "4"}))
    store.put("u", data)
    (tmp_path / "u").write_bytes(data)
    with ObjectTensorFile(store, "u") as remote, TensorFile(tmp_path / "u") as local:
        assert remote.infos == local.infos and remote.metadata == local.metadata == {"round": "4"}
        cases = [("a", 0, None), ("a", 17, 1201), ("b", 999, 1001), ("b", 5, 5), ("c", 0, None), ("c", 29_000, 29_999)]
        for name, start, stop in cases:
            got = remote.read(name, start, stop)
            assert got.flags.writeable and np.array_equal(got, local.read(name, start, stop))
        with pytest.raises(IndexError):
            remote.read("a", 0, 2101)
    store.put("short", data[:-3])
    with pytest.raises(FormatError, match="data bytes"):
        len(ObjectTensorFile(store, "short").infos)  # nothing is read before the first use
    store.put("tiny", b"1234")
    with pytest.raises(FormatError, match="8-byte"):
        ObjectTensorFile(store, "tiny").read("a")
    with pytest.raises(FileNotFoundError):
        len(ObjectTensorFile(store, "nothing-here").metadata)


class _CountedReads:
    """The store, its ranged reads listed (how many GETs does a reader make?)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store, self.url, self.reads = store, store.url, []  # type: ignore[var-annotated]

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytearray:
        self.reads.append((start, end))
        return self.store.read(name, start, end)

    def stream(self, name: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        self.reads.append((start, end))
        return self.store.stream(name, start, end)


class _CutStream(_CountedReads):
    """The same, and the first streamed GET fails after 100 kB (a link that breaks)."""

    cut = True

    def stream(self, name: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        self.reads.append((start, end))
        sent = 0
        for chunk in self.store.stream(name, start, end):
            if self.cut and sent + len(chunk) > 100_000:
                self.cut = False
                yield chunk[: 100_000 - sent]
                raise StoreUnavailable("the link broke")
            sent += len(chunk)
            yield chunk


def test_a_reader_with_a_window_reads_ahead_within_what_it_was_told_it_will_read(
    store: ObjectStore, tmp_path: Path
) -> None:
    """With a window, a slice that misses fetches a window's bytes from where it starts, and
    the next slices come from it (the next window is fetched meanwhile): 100 slices of 4 kB in
    3 GETs, not 100. The read-ahead stops
    at the end of the run of values the reader was told it will read (a lease's share, not the
    next lease's), or at the object's end; two places read in turn (values, scales) keep their
    windows. The values are the file's."""
    rng = np.random.default_rng(4)
    arrays = {"c": rng.standard_normal(300_000).astype(np.float32), "s": rng.standard_normal(3_000).astype(np.float32)}
    data = b"".join(bytes(c) for c in iter_chunks(((k, v, None) for k, v in arrays.items()), {}))
    store.put("w", data)
    (tmp_path / "w").write_bytes(data)
    counted = _CountedReads(store)
    remote = ObjectTensorFile(counted, "w", len(data), window=160_000)  # type: ignore[arg-type]
    remote.expect([("c", 0, 100_000), ("s", 0, 1_000)])
    with TensorFile(tmp_path / "w") as local:
        first = remote.infos["c"].start + len(data) - sum(a.nbytes for a in arrays.values())
        for k in range(100):  # c's values and s's scales in turn, as a quantized slice reads them
            assert np.array_equal(remote.read("c", 1000 * k, 1000 * (k + 1)), local.read("c", 1000 * k, 1000 * (k + 1)))
            assert np.array_equal(remote.read("s", 10 * k, 10 * (k + 1)), local.read("s", 10 * k, 10 * (k + 1)))
        ranged = counted.reads[1:]  # after the header's GET
        assert len(ranged) == 4, ranged  # c: 3 windows (400 kB of 160 kB), s: 1
        assert all(end is not None for _, end in ranged)
        assert max(end for start, end in ranged if start < first + 400_000) == first + 400_000  # c's run ends there
        assert max(end for start, end in ranged if start >= first + 1_200_000) == first + 1_204_000  # s's run
        assert np.array_equal(remote.read("c", 250_000, 250_001), local.read("c", 250_000, 250_001))  # unsaid
        assert (first + 1_000_000, first + 1_000_000 + 160_000) in counted.reads  # a window from there


def test_a_slice_that_straddles_two_windows_is_served_by_both(store: ObjectStore, tmp_path: Path) -> None:
    """Slices of 12 kB through 160 kB windows: one in 13 straddles a window's end. It is served
    by the held window and the next one (fetched ahead), not by a new window from its start that
    fetches again what is held: every byte of the run is read once, in ceil(run / window) GETs
    (the old reader read GPT-2's runs 1.5x over, bench/lease_reads.py)."""
    values = np.random.default_rng(5).standard_normal(300_000).astype(np.float32)
    data = b"".join(bytes(c) for c in iter_chunks([("c", values, None)], {}))
    store.put("x", data)
    counted = _CountedReads(store)
    remote = ObjectTensorFile(counted, "x", len(data), window=160_000)  # type: ignore[arg-type]
    remote.expect([("c", 0, 300_000)])
    for k in range(100):
        assert np.array_equal(remote.read("c", 3000 * k, 3000 * (k + 1)), values[3000 * k : 3000 * (k + 1)])
    ranged = sorted(counted.reads[1:])  # after the header's GET
    assert len(ranged) == 8, ranged  # 1.2 MB of 160 kB windows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranged)), ranged  # no byte twice
    assert ranged[-1][1] == len(data)


def test_a_streamed_reader_reads_each_run_with_one_get_and_resumes_a_cut_one(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stream=True`` (a lease over an update): c's values and s's scales read in turn, as a
    quantized slice reads them, from two threads: one GET for each contiguous run said (after
    the header's), each byte read once; a read of bytes read before, or of bytes not said, is its
    own GET. A stream cut after 100 kB is asked again from where it stopped, and the values are
    the file's. A stream holds at most 64 kB unread here (but goes on while a reader waits for
    s's scales past c's values), and ``close`` stops the stream of a run nobody finished."""
    monkeypatch.setattr(objectfile, "STREAM_AHEAD", 64_000)
    rng = np.random.default_rng(6)
    arrays = {"c": rng.standard_normal(300_000).astype(np.float32), "s": rng.standard_normal(3_000).astype(np.float32)}
    data = b"".join(bytes(c) for c in iter_chunks(((k, v, None) for k, v in arrays.items()), {}))
    store.put("w", data)
    first = len(data) - sum(a.nbytes for a in arrays.values())  # c's first byte
    for counted in (_CountedReads(store), _CutStream(store)):
        remote = ObjectTensorFile(counted, "w", len(data), stream=True)  # type: ignore[arg-type]
        remote.expect([("c", 0, 300_000), ("s", 0, 3_000)])  # one run: c then s, adjacent

        def one(k: int, remote: ObjectTensorFile = remote) -> None:
            assert np.array_equal(remote.read("c", 1000 * k, 1000 * (k + 1)), arrays["c"][1000 * k : 1000 * (k + 1)])
            assert np.array_equal(remote.read("s", 10 * k, 10 * (k + 1)), arrays["s"][10 * k : 10 * (k + 1)])

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, range(300)))
        ranged = counted.reads[1:]  # after the header's GET, whose bytes serve the run's start
        after = objectfile._FIRST_READ
        if isinstance(counted, _CutStream):
            assert ranged == [(after, len(data)), (after + 100_000, len(data))], ranged
        else:
            assert ranged == [(after, len(data))], ranged
        assert np.array_equal(remote.read("c", 100_000, 100_004), arrays["c"][100_000:100_004])  # its own GET
        assert counted.reads[-1] == (first + 400_000, first + 400_016)
        remote.close()
    remote = ObjectTensorFile(store, "w", len(data), stream=True)
    remote.expect([("c", 0, 300_000)])
    assert np.array_equal(remote.read("c", 20_000, 20_010), arrays["c"][20_000:20_010])
    (run,) = remote._streams.values()
    wait_for(lambda: run._held >= 64_000, "the stream to read ahead as far as it may")
    time.sleep(0.2)
    assert run._held < 64_000 + (1 << 20) and run._thread.is_alive()  # it waits for a reader
    remote.close()  # the rest of the run is not read: its GET stops
    run._thread.join(10)
    assert not run._thread.is_alive()


def test_the_hubs_own_upload_from_a_file_in_one_request_or_in_parts(store: ObjectStore) -> None:
    """put_from: a small body in one PUT; one over ``single_max`` in parts (5 MiB, 5 MiB, the rest),
    completed, read back whole; a source that ends short aborts the parts (none left behind)."""
    data = body(11 * MiB + 3, seed=2)
    reads: list[tuple[int, int]] = []

    def read(offset: int, n: int) -> bytes:
        reads.append((offset, n))
        return data[offset : offset + n]

    small = store.put_from("small", 3 * MiB, read)
    assert small.size == 3 * MiB and store.read("small") == data[: 3 * MiB]
    assert max(n for _, n in reads) == MiB  # 1 MiB at a time, never the whole body
    big = store.put_from("big", len(data), read, single_max=5 * MiB)
    info = store.head("big")
    assert big.size == len(data) and info is not None and info.etag.endswith("-3")  # three parts
    assert store.read("big") == data
    with pytest.raises(StoreUnavailable, match="the source ended"):
        store.put_from(
            "short",
            len(data),
            lambda offset, n: data[offset : offset + n] if offset < 6 * MiB else b"",
            single_max=5 * MiB,
        )
    assert store.head("short") is None and store.uploads() == []


def test_complete_with_a_part_never_uploaded_changes_nothing(store: ObjectStore) -> None:
    """A peer that lies about its parts: the store refuses to complete, no object appears."""
    upload_id = store.create_multipart("lie")
    put = HTTP.put(store.presign_part("lie", upload_id, 1), content=b"real part")
    assert put.status_code == 200
    with pytest.raises(StoreRefused):
        store.complete_multipart("lie", upload_id, {1: put.headers["etag"], 2: "0" * 32})
    with pytest.raises(StoreRefused):
        store.complete_multipart("lie", upload_id, {1: "f" * 32})
    assert store.head("lie") is None
    store.abort_multipart("lie", upload_id)
    store.abort_multipart("lie", upload_id)  # twice: nothing left, no error
    assert store.uploads() == []


def test_url_for_one_key_cannot_write_another(store: ObjectStore) -> None:
    url = store.presign_put("peers/a")
    elsewhere = url.replace("/peers/a?", "/peers/b?")
    assert HTTP.put(elsewhere, content=b"forged").status_code == 403
    assert HTTP.get(url.replace("/peers/a?", "/peers/b?")).status_code == 403  # nor read it
    upload_id = store.create_multipart("peers/c")
    part1 = store.presign_part("peers/c", upload_id, 1)
    assert HTTP.put(part1.replace("partNumber=1", "partNumber=2"), content=b"x").status_code == 403
    assert HTTP.get(store.presign_put("peers/b")).status_code == 403  # a PUT URL is no GET URL
    assert store.head("peers/b") is None
    store.abort_multipart("peers/c", upload_id)


def test_expired_url_refused(store: ObjectStore) -> None:
    store.put("soon-gone", b"abc")
    url = store.presign_get("soon-gone", expires=1)
    put = store.presign_put("soon-written", expires=1)
    refused = refused_within(lambda: HTTP.get(url))
    assert refused.status_code == 403 and b"expired" in refused.content.lower()
    assert refused_within(lambda: HTTP.put(put, content=b"late")).status_code == 403
    assert store.head("soon-written") is None


def test_wrong_secret_wrong_key_and_anonymous_refused(seaweedfs: SeaweedFS, store: ObjectStore) -> None:
    store.put("secret", b"data")
    anonymous = f"{seaweedfs.endpoint}/{seaweedfs.bucket}/{store.key('secret')}"
    assert HTTP.get(anonymous).status_code == 403
    assert HTTP.put(anonymous, content=b"overwrite").status_code == 403
    env = seaweedfs.env()
    with ObjectStore.from_url(store.url, {**env, "AWS_SECRET_ACCESS_KEY": "Not-The-Secret"}) as bad:
        assert HTTP.get(bad.presign_get("secret")).status_code == 403
        with pytest.raises(StoreUnavailable, match=r"refused the signature: check AWS_SECRET_ACCESS_KEY") as why:
            bad.check()
        assert "Not-The" not in str(why.value)  # no secret in the message
    nobody = ObjectStore.from_url(store.url, {**env, "AWS_ACCESS_KEY_ID": "AKNOBODY"})
    with nobody, pytest.raises(StoreUnavailable, match=r"does not know access key 'AKNOBODY': check AWS_ACCESS_KEY_ID"):
        nobody.check()
    assert store.read("secret") == b"data"


def test_check_names_the_trouble_in_one_line(seaweedfs: SeaweedFS) -> None:
    with seaweedfs.store("x") as good:
        good.check()
    missing = ObjectStore.from_url("s3://no-such-bucket/x", seaweedfs.env())
    with missing, pytest.raises(StoreUnavailable) as why:
        missing.check()
    assert str(why.value) == f"bucket 'no-such-bucket' does not exist at {seaweedfs.endpoint}"
    with closed_port() as held:
        down = f"http://127.0.0.1:{held.getsockname()[1]}"
        with ObjectStore.from_url("s3://bucket/x", {**seaweedfs.env(), "AWS_ENDPOINT_URL": down}, timeout=2.0) as gone:
            began = time.monotonic()
            with pytest.raises(StoreUnavailable) as why:
                gone.check()
            assert time.monotonic() - began < 10  # bounded: three tries, 1.25 s of backoff
    assert str(why.value).startswith(f"object store {down} unreachable: ConnectError")
    assert "\n" not in str(why.value) and "\n" not in why.value.reason
    reader = ObjectStore.from_url(f"s3://{seaweedfs.bucket}/x", seaweedfs.env(reader=True))
    with reader, pytest.raises(StoreUnavailable, match=r"denied access \(AccessDenied\): no such bucket, or the key"):
        reader.check()  # it may list: the write that check() tries is refused


def test_the_hubs_own_requests_retry_idempotent_ones_in_bounded_time(seaweedfs: SeaweedFS) -> None:
    """A store that holds its answers past the timeout: a GET is tried again (the third try
    gets through), a POST is not (a second CreateMultipartUpload would be another upload), and
    each fails in time bounded by the timeout, never hanging."""
    with FaultProxy(int(urlsplit(seaweedfs.endpoint).port or 0)) as proxy:
        env = {**seaweedfs.env(), "AWS_ENDPOINT_URL": proxy.url}
        with ObjectStore.from_url(f"s3://{seaweedfs.bucket}/t/retries", env, timeout=0.5) as store:
            store.put("x", b"abc")
            proxy.stall(seconds=5, match="GET /weightsync-test/t/retries/x", times=2)
            began = time.monotonic()
            assert store.read("x") == b"abc"
            assert 1.0 < time.monotonic() - began < 10  # two timeouts, and the backoff after each
            assert len(proxy.matching("GET /weightsync-test/t/retries/x")) == 3
            proxy.stall(seconds=5, match="POST /weightsync-test/t/retries/y?")
            with pytest.raises(StoreUnavailable, match="unreachable: ReadTimeout"):
                store.create_multipart("y")
            assert len(proxy.matching("POST /")) == 1
            assert store.uploads() != []  # the store made the upload; its answer was lost
            store.abort_multipart("y", store.uploads()[0].upload_id)
            store.delete("x")


def test_delete_prefix_removes_a_round_and_its_open_uploads(store: ObjectStore) -> None:
    for name in ("rounds/3/a", "rounds/3/b", "rounds/30/a", "rounds/4/a"):
        store.put(name, b"x")
    store.create_multipart("rounds/3/result")
    kept = store.create_multipart("rounds/4/result")
    assert store.delete_prefix("rounds/3") == 2  # a folder: "rounds/3" is no "rounds/30"
    assert [o.name for o in store.list()] == ["rounds/30/a", "rounds/4/a"]
    assert [u.upload_id for u in store.uploads()] == [kept]
    store.abort_multipart("rounds/4/result", kept)


# ---- the SDK: resume ----------------------------------------------------------------------------
@pytest.mark.parametrize(("concurrency", "acknowledged", "resent"), [(1, [1], ["2", "3"]), (4, [1, 3], ["2"])])
def test_sdk_upload_resumes_only_the_parts_not_acknowledged(
    store: ObjectStore, concurrency: int, acknowledged: list[int], resent: list[str]
) -> None:
    """Part 2's URL points at a closed port: it fails after the retry budget. One at a time,
    part 1 went up and 3 was never tried; four at a time, 1 and 3 went up beside it. With a
    good URL for part 2, the next call sends only what the store lacks."""
    data = body(10 * MiB + 1, seed=2)
    upload_id = store.create_multipart("resumed")
    urls = {n: store.presign_part("resumed", upload_id, n) for n in (1, 2, 3)}
    upload = PartedUpload(len(data), 5 * MiB, dict(urls))
    sent: list[str] = []
    with closed_port() as held, transport(retry_seconds=1.0) as t:
        t.http.event_hooks["request"].append(lambda r: sent.append(r.url.params["partNumber"]))
        upload.urls[2] = urls[2].replace(urlsplit(urls[2]).netloc, f"127.0.0.1:{held.getsockname()[1]}")
        with pytest.raises(HubUnreachable, match=r"/resumed \(part 2\)"):
            upload_parts(t, upload, lambda: chunks_of(data), concurrency)
        assert sorted(upload.etags) == acknowledged
        assert "X-Amz-Signature" not in str(sent)
        sent.clear()
        upload.urls[2] = urls[2]  # the hub's renewed URL
        etags = upload_parts(t, upload, lambda: chunks_of(data), concurrency)
    assert sent == resent
    store.complete_multipart("resumed", upload_id, etags)
    assert store.read("resumed") == data


@pytest.fixture
def proxied(seaweedfs: SeaweedFS, request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, ObjectStore]]:
    """A FaultProxy in front of SeaweedFS, and a store whose URLs are signed for the proxy's
    address (as a hub signs for the address its peers see)."""
    with FaultProxy(int(urlsplit(seaweedfs.endpoint).port or 0)) as proxy:
        env = {**seaweedfs.env(), "AWS_ENDPOINT_URL": proxy.url}
        with ObjectStore.from_url(f"s3://{seaweedfs.bucket}/t/{request.node.name}", env) as store:
            yield proxy, store


def parted(store: ObjectStore, name: str, size: int) -> tuple[str, PartedUpload]:
    upload_id = store.create_multipart(name)
    count = -(-size // (5 * MiB))
    return upload_id, PartedUpload(
        size, 5 * MiB, {n: store.presign_part(name, upload_id, n) for n in range(1, count + 1)}
    )


def test_sdk_parts_go_up_at_once_and_complete_out_of_order_to_the_same_bytes(
    proxied: tuple[FaultProxy, ObjectStore],
) -> None:
    """Part 1 on a slow link (5 MB/s through the proxy), the others at loopback speed: with
    four streams, parts 2-4 are acknowledged while part 1 still goes up (one at a time, part 1
    would be first). The ETags go by part number, and the object is the body."""
    proxy, store = proxied
    data = body(20 * MiB - 5, seed=4)
    upload_id, upload = parted(store, "ooo", len(data))
    proxy.throttle(5_000_000, match="partNumber=1&")
    with transport() as t:
        etags = upload_parts(t, upload, lambda: chunks_of(data, 3 * MiB + 7), concurrency=4)
    assert list(upload.etags)[-1] == 1  # the order the store acknowledged them in
    assert list(etags) == [1, 2, 3, 4]
    assert sorted(r.target.split("partNumber=")[1][:2] for r in proxy.matching("PUT /")) == ["1&", "2&", "3&", "4&"]
    store.complete_multipart("ooo", upload_id, etags)
    assert store.read("ooo") == data


def test_sdk_a_part_cut_midway_is_retried_alone(proxied: tuple[FaultProxy, ObjectStore]) -> None:
    """Part 2's link drops after 2 MB: that part is sent again, on its own, while the others
    go up once each; the object is the body."""
    proxy, store = proxied
    data = body(20 * MiB - 5, seed=5)
    upload_id, upload = parted(store, "cut", len(data))
    proxy.cut(after=2_000_000, match="partNumber=2&")
    with transport() as t:
        etags = upload_parts(t, upload, lambda: chunks_of(data), concurrency=4)
    puts = {n: proxy.matching(f"partNumber={n}&") for n in (1, 2, 3, 4)}
    assert {n: len(p) for n, p in puts.items()} == {1: 1, 2: 2, 3: 1, 4: 1}
    assert puts[2][0].fault and not puts[2][0].done and puts[2][1].done
    assert proxy.body_bytes("PUT /") == len(data) + puts[2][0].body_bytes
    store.complete_multipart("cut", upload_id, etags)
    assert store.read("cut") == data


def test_sdk_upload_holds_at_most_one_part_more_than_it_sends(store: ObjectStore) -> None:
    """The body's chunks are read in order as parts free up: while a chunk of part k is read,
    parts k-1 and k-2 may be in flight (two streams) and none before them unacknowledged: at
    most three parts pinned, and three are (the reader runs ahead by one part, no further)."""
    data = body(30 * MiB, seed=6)
    upload_id, upload = parted(store, "bounded", len(data))
    held: list[int] = []

    def instrumented() -> Iterator[memoryview]:
        for i, chunk in enumerate(chunks_of(data)):
            held.append(i * MiB // (5 * MiB) + 1 - len(upload.etags))  # parts read, less acknowledged
            yield chunk

    with transport() as t:
        with pytest.raises(ValueError, match="at least 1"):
            upload_parts(t, upload, instrumented, concurrency=0)
        etags = upload_parts(t, upload, instrumented, concurrency=2)
    assert len(held) == 30 and max(held) == 3
    store.complete_multipart("bounded", upload_id, etags)
    assert store.read("bounded") == data


def test_sdk_upload_of_an_empty_body_and_of_a_body_shorter_than_declared(store: ObjectStore) -> None:
    """One part whose URL is a plain presigned PUT: the same code as parts. A body that ends
    before the size the upload declared is a ValueError (a bug of the caller), not a retry."""
    empty = PartedUpload(0, 5 * MiB, {1: store.presign_put("empty")})
    with transport() as t:
        assert list(upload_parts(t, empty, lambda: iter([]))) == [1]
        short = PartedUpload(10, 5 * MiB, {1: store.presign_put("short")})
        with pytest.raises(ValueError, match="ended at byte 4"):
            upload_parts(t, short, lambda: iter([b"abcd"]))
    info = store.head("empty")
    assert info is not None and info.size == 0
    assert store.head("short") is None


def test_sdk_upload_refused_by_an_expired_part_url(store: ObjectStore) -> None:
    """403 is no transport trouble: no retries, the store's reason, and the ETags kept so far."""
    upload_id = store.create_multipart("late")
    upload = PartedUpload(6, 5 * MiB, {1: store.presign_part("late", upload_id, 1, expires=1)})
    refused_within(lambda: HTTP.put(upload.urls[1], content=b"probe!"))
    with transport(retry_seconds=30.0) as t:
        began = time.monotonic()
        with pytest.raises(HubError) as why:
            upload_parts(t, upload, lambda: iter([b"abcdef"]))
        assert time.monotonic() - began < 5
    assert why.value.status == 403 and why.value.code == "AccessDenied" and upload.etags == {}
    store.abort_multipart("late", upload_id)


def test_sdk_download_resumes_a_range_after_a_cut(seaweedfs: SeaweedFS) -> None:
    """A safetensors object read through a presigned GET by the SDK's own download, cut after
    2 MB: the retry asks for the rest (206), and the arrays come out whole. The store is signed
    for the proxy's address, as a hub behind any address signs for the one peers see."""
    rng = np.random.default_rng(3)
    arrays = {"w": rng.standard_normal((1024, 1024), dtype=np.float32), "b": rng.standard_normal(77, dtype=np.float32)}
    with FaultProxy(int(urlsplit(seaweedfs.endpoint).port or 0)) as proxy:
        env = {**seaweedfs.env(), "AWS_ENDPOINT_URL": proxy.url}
        with ObjectStore.from_url(f"s3://{seaweedfs.bucket}/t/download", env) as store:
            data = b"".join(bytes(c) for c in iter_chunks((k, v, None) for k, v in arrays.items()))
            store.put("result.safetensors", data)
            url = store.presign_get("result.safetensors")
        proxy.cut_response(after=2_000_000, match="GET /")
        got: dict[str, np.ndarray] = {}
        with transport() as t:
            # on_tensor: a 200 after the cut (a restart, not a resume) would be an error
            got_all = t.download(url, None, on_tensor=lambda name, array, meta: got.__setitem__(name, array))
        gets = proxy.matching("GET /")
    assert got_all is not None and got_all.reader.received == len(data)
    assert [g.status for g in gets] == [200, 206] and gets[0].fault
    assert "range: bytes=" in gets[1].head and "range: bytes=0-" not in gets[1].head
    # the rest, not all again: the transport reads 1 MiB at a time, a cut loses the one in flight
    assert sum(g.response_bytes for g in gets) < len(data) + MiB + 4096
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)


def test_seaweedfs_starts_once_and_cheaply(seaweedfs: SeaweedFS) -> None:
    """The harness's own cost: one start per session (measured 3.4-3.9 s on the 2-core VM)."""
    assert 0 < seaweedfs.started_in < 60
    assert seaweedfs.log is not None and seaweedfs.log.exists()


@pytest.mark.process  # a program of its own (make check leaves it out; the rest share one SeaweedFS)
def test_store_benchmark_runs(seaweedfs: SeaweedFS) -> None:
    """bench/store.py --quick on this session's SeaweedFS: every figure of the candidates installed
    here (ours; boto3 and obstore are not in the dev extra and say so)."""
    env = {**os.environ, **seaweedfs.env()}
    command = [sys.executable, str(REPO / "bench" / "store.py"), "--quick", "--bucket", seaweedfs.bucket]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    table = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in done.stdout.splitlines()
        if line.count("|") >= 3
    }
    for label in ("presigned URLs / s", "PUT 8 MB parts (MB/s)", "GET whole (MB/s)", "ranged GET 1 MiB (ms)"):
        assert float(table[label].replace(",", "")) > 0, (label, done.stdout)


@pytest.mark.process  # a program of its own
def test_parts_benchmark_runs(seaweedfs: SeaweedFS) -> None:
    """bench/parts.py on this session's SeaweedFS, 16 MB once: a figure for each stream count."""
    env = {**os.environ, **seaweedfs.env()}
    command = [
        sys.executable,
        str(REPO / "bench" / "parts.py"),
        "--size",
        "16",
        "--repeat",
        "1",
        "--bucket",
        seaweedfs.bucket,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    row = done.stdout.splitlines()[-1].split("|")
    assert row[1].strip() == "loopback, unshaped, 16 MB, 8 MiB parts" and all(float(x) > 0 for x in row[2:4]), (
        done.stdout
    )
