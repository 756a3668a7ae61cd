from __future__ import annotations

import httpx


def test_healthz_without_auth(hub_factory) -> None:
    hub = hub_factory(env={"SYNC_TOKEN": "s3cret"})
    assert httpx.get(f"{hub.url}/healthz").json()["status"] == "ok"
    r = httpx.get(f"{hub.url}/v1/runs")
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert httpx.get(f"{hub.url}/v1/runs", headers={"Authorization": "Bearer s3cret"}).json() == []
