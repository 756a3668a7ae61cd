from __future__ import annotations

from tests.harness import HTTP


def test_healthz_without_auth(hub_factory) -> None:
    hub = hub_factory(env={"SYNC_TOKEN": "s3cret"})
    assert HTTP.get(f"{hub.url}/healthz").json()["status"] == "ok"
    r = HTTP.get(f"{hub.url}/v1/runs")
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert HTTP.get(f"{hub.url}/v1/runs", headers={"Authorization": "Bearer s3cret"}).json() == []
