"""Results and versions through the object store (SYNC_STORE): a real hub process, a real
SeaweedFS (tests/s3server.py, started once per session), real SDK peers on tiny models.

A FaultProxy stands between everyone and SeaweedFS (the hub's AWS_ENDPOINT_URL is the proxy,
so its presigned URLs point there too): it records what the store was asked (and by whom: no
bearer token may reach it), and cuts, stalls or stops the store's link on demand.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import safetensors.numpy
from prometheus_client.parser import text_string_to_metric_families

from syncclient import SyncClient
from syncserver.storage.bucket import object_name
from syncserver.storage.store import VersionKey
from tests.conftest import Hub, tiny_gpt2
from tests.faultproxy import FaultProxy
from tests.harness import Peers
from tests.s3server import SeaweedFS

TOKEN = "hub-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def s3(seaweedfs: SeaweedFS) -> Iterator[FaultProxy]:
    """SeaweedFS behind a proxy of this test's own."""
    with FaultProxy(int(urlsplit(seaweedfs.endpoint).port or 0)) as proxy:
        yield proxy


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
    r = httpx.get(f"{hub.url}/v1/runs/{run}/model", headers=AUTH, follow_redirects=True, timeout=60)
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


def scrape(hub: Hub) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{hub.url}/metrics", headers=AUTH)
    r.raise_for_status()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


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
    """Every result and version reaches the peers from the bucket, bit-identical to a hub
    without a store; the hub's own bytes out per round are one result (its upload), not one
    per peer; the bucket never sees the hub's token; a late joiner gets the model from there."""
    plain = hub_factory(env={"SYNC_TOKEN": TOKEN})
    stored = store_hub(hub_factory, seaweedfs, s3, "two-peers")
    reference = model_of_after(plain, "r")
    peers = train(stored.url, "r", 3)
    samples = scrape(stored)
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
    assert {g.status for g in gets} == {200}

    # a late joiner: the latest version, fetched (and copied once) from the bucket
    late = SyncClient(stored.url, run="r", peer="late", token=TOKEN)
    model = tiny_gpt2(5)
    late.join(model)
    assert late.version == 3
    late.close()
    assert len(s3.matching(f"GET /{seaweedfs.bucket}/two-peers/{object_name(VersionKey('r', 3))}")) == 2
    # the dashboard's download phases are there: each peer reported its downloads
    state = httpx.get(f"{stored.url}/v1/runs/r", headers=AUTH).json()
    assert state["store"] == f"s3://{seaweedfs.bucket}/two-peers/"
    page = httpx.get(f"{stored.url}/v1/dashboard", params={"run": "r"}, headers=AUTH).json()["run"]
    assert page["store"] == state["store"]
    lanes = {(rnd["round"], lane["peer"]): lane["spans"] for rnd in page["trace"] for lane in rnd["lanes"]}
    assert all(any(span[0] == "download" for span in lanes[r, p]) for r in range(3) for p in ("a", "b"))


def model_of_after(hub: Hub, run: str) -> str:
    peers = train(hub.url, run, 3)
    peers.close()
    return digest(model_of(hub, run))
