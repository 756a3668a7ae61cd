"""Results and versions through the object store (SYNC_STORE): a real hub process, a real
SeaweedFS (tests/s3server.py, started once per session), real SDK peers on tiny models.

A FaultProxy stands between everyone and SeaweedFS (the hub's AWS_ENDPOINT_URL is the proxy,
so its presigned URLs point there too): it records what the store was asked (and by whom: no
bearer token may reach it), and cuts, stalls or stops the store's link on demand.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch

from syncclient import SyncClient
from syncclient.transport import Transport
from syncserver.storage.bucket import object_name
from syncserver.storage.store import ResultKey, VersionKey
from tests.conftest import Hub
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, Peers, wait_for
from tests.models import tiny_gpt2
from tests.s3server import SeaweedFS
from tests.test_metrics import scrape

REPO = Path(__file__).resolve().parents[1]
TOKEN = "hub-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def store_hub(
    hub_factory: Callable[..., Hub],
    seaweedfs: SeaweedFS,
    proxy: FaultProxy,
    prefix: str,
    *args: str,
    data_dir: Path | None = None,
) -> Hub:
    env = {**seaweedfs.env(), "AWS_ENDPOINT_URL": proxy.url, "SYNC_TOKEN": TOKEN}
    return hub_factory("--store", f"s3://{seaweedfs.bucket}/{prefix}", *args, env=env, data_dir=data_dir)


def model_of(hub: Hub, run: str) -> dict[str, np.ndarray]:
    """The run's latest version as a plain client gets it (following a 307 without the token:
    httpx drops Authorization when a redirect leaves the hub's origin)."""
    r = HTTP.get(f"{hub.url}/v1/runs/{run}/model", headers=AUTH, follow_redirects=True, timeout=60)
    r.raise_for_status()
    return safetensors.numpy.load(r.content)


def digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def peer_digest(peers: Peers, name: str) -> str:
    return digest({k: v.detach().numpy() for k, v in peers.models[name].state_dict().items() if k in _synced(peers)})


def _synced(peers: Peers) -> set[str]:
    client = next(iter(peers.clients.values()))
    return set(client._state.base) if client._state else set()  # the tensors the run syncs


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def train(url: str, run: str, rounds: int) -> Peers:
    """Two peers, ``rounds`` syncs of seeded perturbations (no dropout: the same bits every time)."""
    peers = Peers(url, run, ["a", "b"], token=TOKEN, min_peers=2)
    peers.join()
    for r in range(rounds):
        peers.parallel(["a", "b"], lambda n, r=r: peers.sync(n, samples=4 + (n == "b"), seed=10 * r + (n == "b")))
    return peers


def test_two_peers_three_rounds_through_the_store(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """Every update goes to the bucket and every result and version reaches the peers from
    there, bit-identical to a hub without a store; the hub's own bytes out per round are one
    result (its upload), not one per peer; the bucket never sees the hub's token; a late joiner
    gets the model from there."""
    plain = hub_factory(env={"SYNC_TOKEN": TOKEN})
    stored = store_hub(hub_factory, seaweedfs, s3, "two-peers")
    reference = model_of_after(plain, "r")
    peers = train(stored.url, "r", 3)
    samples = scrape(stored, TOKEN)
    final = model_of(stored, "r")
    assert digest(final) == reference  # the same bits as the local-disk hub's
    for name in ("a", "b"):
        assert peers.clients[name].version == 3
        assert digest({k: final[k] for k in _synced(peers)}) == peer_digest(peers, name)
    peers.close()

    result = Path(stored.data_dir / "runs/r/rounds/00000002/result.safetensors").stat().st_size
    uploaded = metric(samples, "weightsync_store_upload_bytes_total", run="r")
    fetched = metric(samples, "weightsync_download_bytes_total", run="r", via="store")
    assert metric(samples, "weightsync_download_bytes_total", run="r", via="hub") == 0
    # each peer fetched version 0 and three results from the bucket; the hub uploaded each once:
    # its link carried one result per round (and version 0 once), not one per peer
    assert fetched == 2 * uploaded
    version0 = uploaded - 3 * result
    assert abs(version0 - result) < 1024  # a model's worth (fp32 results are full-size)
    gets = s3.matching("GET /")
    assert gets and all("authorization: bearer" not in g.head for g in gets)
    assert {g.status for g in gets} <= {200, 206}  # 206: the hub's merge reads slices of the updates
    # the updates went to the bucket too, in parts, without the hub's token; none through the hub
    parts = s3.matching(f"PUT /{seaweedfs.bucket}/two-peers/runs/r/updates/")
    assert len(parts) == 6 and all("authorization" not in p.head and p.status == 200 for p in parts)
    assert metric(samples, "weightsync_upload_bytes_total", run="r", via="hub") == 0
    assert metric(samples, "weightsync_upload_bytes_total", run="r", via="store") == sum(p.body_bytes for p in parts)

    # a late joiner: the latest version, fetched (and copied once) from the bucket
    late = SyncClient(stored.url, run="r", peer="late", token=TOKEN)
    model = tiny_gpt2(5)
    late.join(model)
    assert late.version == 3
    late.close()
    assert len(s3.matching(f"GET /{seaweedfs.bucket}/two-peers/{object_name(VersionKey('r', 3))}")) == 2
    # the dashboard's download phases are there: each peer reported its downloads
    state = HTTP.get(f"{stored.url}/v1/runs/r", headers=AUTH).json()
    assert state["store"] == f"s3://{seaweedfs.bucket}/two-peers/"
    page = HTTP.get(f"{stored.url}/v1/dashboard", params={"run": "r"}, headers=AUTH).json()["run"]
    assert page["store"] == state["store"]
    lanes = {(rnd["round"], lane["peer"]): lane["spans"] for rnd in page["trace"] for lane in rnd["lanes"]}
    assert all(any(span[0] == "download" for span in lanes[r, p]) for r in range(3) for p in ("a", "b"))
    # bad download reports: a JSON reason each, nothing recorded
    report = f"{stored.url}/v1/runs/r/peers/a/downloaded"
    for body, status in [
        ({"round": 3, "seconds": 0.1}, 409),  # no result yet
        ({"round": 0, "seconds": -1}, 422),
        ({"round": 0, "seconds": 1e9}, 422),
        ({"round": 0}, 422),
    ]:
        r = HTTP.post(report, json=body, headers=AUTH)
        assert r.status_code == status and r.json()["error"], (body, r.text)
    r = HTTP.post(f"{stored.url}/v1/runs/r/peers/nobody/downloaded", json={"round": 0, "seconds": 1}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert HTTP.post(report, json={"round": 0, "seconds": 1}).status_code == 401
    r = HTTP.get(f"{stored.url}/v1/runs/r/model", params={"direct": "maybe"}, headers=AUTH)
    assert r.status_code == 422 and "direct" in r.json()["detail"]
    shown = subprocess.run(
        [sys.executable, "-m", "syncserver", "status", stored.url, "--run", "r", "--token", TOKEN],
        env={**os.environ, "COLUMNS": "240"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = " ".join(shown.stdout.split())  # the title wraps at the tables' width
    assert f"downloads from s3://{seaweedfs.bucket}/two-peers/" in said, shown.stdout + shown.stderr
    assert seaweedfs.secret_key not in shown.stdout and seaweedfs.access_key not in shown.stdout


def model_of_after(hub: Hub, run: str, rounds: int = 3) -> str:
    peers = train(hub.url, run, rounds)
    peers.close()
    return digest(model_of(hub, run))


def one_peer_run(hub: Hub, run: str, model: torch.nn.Module) -> SyncClient:
    """A run of one peer that has initialised it (version 0 is in, the run started)."""
    client = SyncClient(hub.url, run=run, peer="p", token=TOKEN, min_peers=1)
    client.join(model)
    return client


def test_cut_download_resumes_against_the_bucket_and_an_expired_url_asks_the_hub_again(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """A model download cut at 1.2 MB resumes from the bucket with Range; by then its URL has
    expired: the SDK asks the hub for a fresh one and goes on from the byte it had, without the
    hub's token ever reaching the store. The URL lives 2 s (SigV4 dates are whole seconds: it
    expires 1-2 s after it is signed, so its first request has a second at least on a loaded
    machine), and the store's link is slowed to 500 kB/s, so the cut comes after 2.4 s."""
    hub = store_hub(hub_factory, seaweedfs, s3, "resume", "--store-url-seconds", "2")
    model = tiny_gpt2(1, n_embd=128, vocab_size=4096)  # ~2.3 MB: the SDK reads 1 MiB at a time
    one_peer_run(hub, "r", model).close()
    expected = model_of(hub, "r")
    where = f"GET /{seaweedfs.bucket}/resume/runs/r/versions/"
    before = len(s3.matching(where))
    s3.throttle(500_000, match=where)
    s3.cut_response(after=1_200_000, match=where)
    with contextlib.closing(Transport(hub.url, run="r", token=TOKEN, verify=True, timeout=30, retry_seconds=60)) as t:
        got = t.download("/v1/runs/r/model", {"peer": "p"})
    assert got is not None and got.version == 0 and got.store_seconds is not None
    for name, array in expected.items():
        np.testing.assert_array_equal(got.reader.tensors[name], array)
    gets = s3.matching(where)[before:]
    assert [g.status for g in gets] == [200, 403, 206], [(g.status, g.fault) for g in gets]
    assert gets[0].fault and "range: bytes=" in gets[2].head and "range: bytes=0-" not in gets[2].head
    assert gets[1].target != gets[2].target  # a fresh URL from the hub
    assert all("authorization" not in g.head for g in gets)


def test_serve_with_a_store_that_cannot_work_is_one_line_and_exit_2(seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    """A missing bucket, a store that is down: one line on stderr, exit 2, before anything listens."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    down = f"http://127.0.0.1:{held.getsockname()[1]}"
    cases = {
        "s3://no-such-bucket/x": ({}, "error: --store: s3://no-such-bucket/x/: bucket 'no-such-bucket' does not exist"),
        f"s3://{seaweedfs.bucket}/x": ({"AWS_ENDPOINT_URL": down}, "unreachable: ConnectError"),
    }
    with held:
        for url, (env, said) in cases.items():
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "syncserver",
                    "serve",
                    "--port",
                    "0",
                    "--data-dir",
                    str(tmp_path),
                    "--store",
                    url,
                ],
                env={**os.environ, **seaweedfs.env(), **env},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 2, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: --store: ") and said in lines[0], done.stderr
            assert seaweedfs.secret_key not in done.stderr
    # plain uvicorn: the hub does not start, and says why
    done = subprocess.run(
        [sys.executable, "-m", "uvicorn", "syncserver.app:app", "--port", "0"],
        env={**os.environ, **seaweedfs.env(), "SYNC_STORE": "s3://no-such-bucket", "SYNC_DATA_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "Application startup failed" in done.stderr
    # the hub's log line, and uvicorn's report of the startup failure, end with the reason
    said = [line for line in done.stderr.splitlines() if "ERROR" in line or line.startswith("RuntimeError")]
    assert any("SYNC_STORE: s3://no-such-bucket/: bucket 'no-such-bucket' does not exist" in line for line in said)
    assert seaweedfs.secret_key not in done.stderr


def test_store_down_mid_run_peers_finish_from_the_hubs_disk(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """The store's link dies after round 0: a peer sent to it for round 0's result falls back
    to the hub (direct=1), the next rounds' uploads fail and their results are served from the
    hub's disk, a late joiner gets the model from the hub; one warning, no 500, same bits."""
    plain = hub_factory(env={"SYNC_TOKEN": TOKEN})
    reference = model_of_after(plain, "r")
    hub = store_hub(hub_factory, seaweedfs, s3, "down")
    peers = train(hub.url, "r", 1)
    s3.reset_on_connect(times=1_000_000)  # every new connection to the store is reset
    s3.drop_connections()
    tried = s3.connections
    with contextlib.closing(Transport(hub.url, run="r", token=TOKEN, verify=True, timeout=30, retry_seconds=30)) as t:
        again = t.download("/v1/runs/r/rounds/0/result", {"peer": "a"})
    assert again is not None and again.version == 1
    assert s3.connections > tried and again.store_seconds is None  # sent to the store first, served by the hub
    for r in (1, 2):
        peers.parallel(["a", "b"], lambda n, r=r: peers.sync(n, samples=4 + (n == "b"), seed=10 * r + (n == "b")))
    peers.close()
    assert digest(model_of(hub, "r")) == reference
    late = SyncClient(hub.url, run="r", peer="late", token=TOKEN)
    late.join(tiny_gpt2(5))
    assert late.version == 3
    late.close()
    samples = scrape(hub, TOKEN)
    assert metric(samples, "weightsync_download_bytes_total", run="r", via="hub") > 0
    log = hub.log()
    assert log.count("object_store_down run=r") == 1, log
    assert " 500 " not in log and "Traceback" not in log


def test_restart_deletes_objects_no_committed_record_names(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """What a crash leaves in the bucket (an upload whose record never committed: a result of
    a round that did not close, a version past the last) is deleted at start; committed
    copies stay and are still served."""
    hub = store_hub(hub_factory, seaweedfs, s3, "gc")
    peers = train(hub.url, "r", 1)
    peers.close()
    bucket = seaweedfs.store("gc")
    kept = object_name(ResultKey("r", 0))
    assert bucket.head(kept) is not None
    orphans = [object_name(ResultKey("r", 1)), object_name(VersionKey("r", 2)), object_name(ResultKey("r", 7))]
    hub.kill()  # as a crash between an upload and its record
    for name in orphans:
        bucket.put(name, b"an upload whose record never committed")
    upload_id = bucket.create_multipart(object_name(ResultKey("r", 1)))
    hub.start()
    wait_for(lambda: all(bucket.head(name) is None for name in orphans), "the orphans deleted")
    assert bucket.head(kept) is not None and bucket.uploads("runs/r/") == []
    assert upload_id
    with contextlib.closing(Transport(hub.url, run="r", token=TOKEN, verify=True, timeout=30, retry_seconds=30)) as t:
        got = t.download("/v1/runs/r/rounds/0/result", {})
    assert got is not None and got.store_seconds is not None and got.version == 1
    bucket.close()


def test_store_bytes_benchmark_runs(seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    """bench/storebytes.py's smoke test, on this session's SeaweedFS: with a store the hub's link
    carries one result per round out (x model 1.00 in fp32), without it one per peer; the updates
    go to the bucket, and the hub reads them back (check and merge), unless reducers do both."""
    command = [sys.executable, "bench/storebytes.py", "--peers", "2", "--codecs", "fp32", "--rounds", "1"]
    command += ["--reducers", "1"]
    command += ["--params", "20000", "--bucket", seaweedfs.bucket, "--out", str(tmp_path)]
    done = subprocess.run(
        command, cwd=REPO, env={**os.environ, **seaweedfs.env()}, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("| fp32 | 2 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "1.00" and cells[6] == "2.00", done.stdout
    # bytes in: the two updates through the hub without a store; with one, the peers put them in
    # the bucket and the hub read each back twice (its check, then its merge)
    (saved,) = tmp_path.glob("storebytes-*.json")
    (got,) = json.loads(saved.read_text())["rows"]
    assert got["peers_to_store_mb"] == got["hub_in_mb_no_store"] > 0, got
    assert got["hub_in_mb_store"] >= 2 * got["peers_to_store_mb"], got
    assert got["hub_in_mb_store_reducers"] == 0 and got["hub_out_mb_store_reducers"] == 0 and got["same_bits"], got


def test_hub_killed_between_a_results_upload_and_its_commit(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, s3: FaultProxy
) -> None:
    """SIGKILL once round 0's result is in the bucket but its commit is not (the store's answer
    to the hub's upload is held): the restart deletes the orphan, closes the round again from
    the two acknowledged updates, and the peers, riding through on their retries, end on the
    same bits as a hub that never crashed."""
    plain = hub_factory(env={"SYNC_TOKEN": TOKEN})
    reference = model_of_after(plain, "r", rounds=2)
    hub = store_hub(hub_factory, seaweedfs, s3, "crash")
    bucket = seaweedfs.store("crash")
    result = object_name(ResultKey("r", 0))
    s3.stall(seconds=60, match=f"PUT /{seaweedfs.bucket}/crash/{result}")
    peers = Peers(hub.url, "r", ["a", "b"], token=TOKEN, min_peers=2)
    peers.join()
    for name in ("a", "b"):
        peers.start(name, lambda n=name: peers.sync(n, samples=4 + (n == "b"), seed=n == "b"))
    wait_for(lambda: bucket.head(result) is not None, "round 0's result in the bucket")
    assert HTTP.get(f"{hub.url}/v1/runs/r", headers=AUTH).json()["version"] == 0  # not committed
    hub.kill()
    s3.clear()
    hub.start()
    peers.wait()
    peers.parallel(["a", "b"], lambda n: peers.sync(n, samples=4 + (n == "b"), seed=10 + (n == "b")))
    peers.close()
    assert digest(model_of(hub, "r")) == reference
    assert "object_store_orphans_deleted run=r objects=1" in hub.log()
    assert bucket.head(result) is not None  # the round's own copy, uploaded again and committed
    bucket.close()
