"""``/metrics`` of a real hub after real rounds, rejected updates by reason, structured logs."""

from __future__ import annotations

import base64
import hashlib
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from syncserver import HubSettings, create_app
from tests.conftest import Hub
from tests.harness import HTTP, Peers

TOKEN, VIEW = "hub-secret", "view-only"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def scrape(hub: Hub, token: str = VIEW) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` as {(name, sorted labels): value}."""
    r = HTTP.get(f"{hub.url}/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[name, tuple(sorted(labels.items()))]


def put_update(hub: Hub, run: str, round_: int, peer: str, body: bytes, **headers: str) -> httpx.Response:
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
    return HTTP.put(
        f"{hub.url}/v1/runs/{run}/rounds/{round_}/updates/{peer}",
        content=body,
        headers={"Content-Digest": digest, "X-Sync-Samples": "4", **headers},
    )


def test_metrics_after_two_rounds(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--min-peers", "2", env={"SYNC_TOKEN": TOKEN, "SYNC_VIEW_TOKEN": VIEW})
    assert HTTP.get(f"{hub.url}/metrics").status_code == 401
    before = scrape(hub)
    assert not any(name.startswith("weightsync_version") for name, _ in before)  # no run yet

    Peers(hub.url, "m", ["peer-a", "peer-b"], token=TOKEN, min_peers=2, retry_seconds=30).train_all(2).wait()

    # a result download ends hub-side just after the peer has its bytes: give it a moment
    deadline = time.monotonic() + 10
    while value(s := scrape(hub), "weightsync_round_phase_seconds_count", run="m", phase="download") < 4:
        assert time.monotonic() < deadline, "download phases not observed"
        time.sleep(0.1)
    assert value(s, "weightsync_rounds_completed_total", run="m") == 2
    assert value(s, "weightsync_version", run="m") == 2
    assert value(s, "weightsync_updates_accepted_total", run="m") == 4
    assert value(s, "weightsync_samples_total", run="m") == 4 * 8
    assert value(s, "weightsync_stragglers_dropped_total", run="m") == 0
    assert value(s, "weightsync_bytes_received_total", run="m") > 0
    assert value(s, "weightsync_bytes_sent_total", run="m") > 0
    assert value(s, "weightsync_peers", run="m", state="left") == 2  # both said goodbye
    assert value(s, "weightsync_live_peers", run="m") == 0
    for phase, count in [("upload", 4), ("wait", 4), ("fold", 2), ("merge", 2), ("round", 2), ("download", 4)]:
        assert value(s, "weightsync_round_phase_seconds_count", run="m", phase=phase) == count, phase
        assert value(s, "weightsync_round_phase_seconds_sum", run="m", phase=phase) >= 0
    assert value(s, "weightsync_round_phase_seconds_bucket", run="m", phase="round", le="+Inf") == 2

    # refused uploads count by reason (the error code of the answer), with the run as label
    # only when the run exists
    assert HTTP.get(f"{hub.url}/v1/runs/m", headers=AUTH).json()["version"] == 2
    HTTP.post(f"{hub.url}/v1/runs/m/peers", json={"peer": "peer-c"}, headers=AUTH).raise_for_status()
    refused = [
        put_update(hub, "m", 2, "peer-c", b"not safetensors", **AUTH),  # a body that is no update
        put_update(hub, "m", 0, "peer-c", b"late", **AUTH),  # round 0 is long closed
        put_update(hub, "m", 2, "peer-c", b"x"),  # no token
        HTTP.put(f"{hub.url}/v1/runs/m/rounds/2/updates/peer-c", content=b"x", headers=AUTH),  # no headers
    ]
    reasons = [r.json()["error"] for r in refused]
    assert [r.status_code for r in refused] == [422, 409, 401, 422], reasons
    assert reasons[1:] == ["round_closed", "unauthorized", "invalid_request"]
    unknown = put_update(hub, "nope", 0, "peer-a", b"x", **AUTH)
    assert unknown.status_code == 404
    s = scrape(hub)
    for reason in reasons:
        assert value(s, "weightsync_updates_rejected_total", run="m", reason=reason) == reasons.count(reason)
    assert value(s, "weightsync_updates_rejected_total", run="", reason="not_found") == 1
    assert value(s, "weightsync_updates_accepted_total", run="m") == 4  # none of those got in
    # other failures are not updates: a status call for an unknown run counts nothing
    assert HTTP.get(f"{hub.url}/v1/runs/nope", headers=AUTH).status_code == 404
    assert sum(v for (name, _), v in scrape(hub).items() if name == "weightsync_updates_rejected_total") == 5

    # one structured line per round transition, with its timings
    log = hub.log()
    for round_ in (0, 1):
        assert re.search(
            rf"round_closed run=m round={round_} version={round_ + 1} peers=2 dropped=0 samples=16 "
            r"mb_in=[\d.]+ mb_out=[\d.]+ fold_s=[\d.]+ merge_s=[\d.]+ wall_s=[\d.]+",
            log,
        ), log
    assert "run_started run=m peers=2 members=peer-a,peer-b" in log
    assert re.search(r"update_acked run=m round=1 base=1 peer=peer-b samples=8 mb=[\d.]+ upload_s=[\d.]+", log)
    assert "peer_left run=m peer=peer-a" in log


def test_each_app_has_its_own_registry(tmp_path: Path) -> None:
    """Tests and embedders build many hubs in one process: no clash in a global registry."""
    a = create_app(HubSettings(data_dir=tmp_path / "a"))
    b = create_app(HubSettings(data_dir=tmp_path / "b"))
    assert a.state.metrics.registry is not b.state.metrics.registry
    assert b"weightsync_rounds_completed" in a.state.metrics.exposition()
