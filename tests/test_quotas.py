"""How much of a hub one token may take: runs per token, peers per run, and bounded listings
(``/v1/runs`` a page at a time, ``/metrics`` with a bounded ``run`` label). Real hubs, raw HTTP.

Each limit answers ``403 limit_reached`` with the setting's name, and creates nothing (*was*:
one token created 2,000 runs, 1,000 peers joined one run, and ``/v1/runs`` and ``/metrics``
grew with every run, 143 KB and 881 KB).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from syncwire import iter_chunks
from tests.conftest import Hub

TOKEN, ADMIN = "quota-token", "quota-admin"
ENV = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}


def client(hub: Hub, token: str = TOKEN) -> httpx.Client:
    return httpx.Client(base_url=hub.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def join(http: httpx.Client, run: str, peer: str, **config: object) -> httpx.Response:
    return http.post(f"/v1/runs/{run}/peers", json={"peer": peer, **config})


def refused(r: httpx.Response, setting: str) -> None:
    assert r.status_code == 403, r.text
    body = r.json()
    assert body["error"] == "limit_reached" and setting.upper() in body["detail"], body
    assert body["limit"] == setting


def test_a_token_may_create_so_many_runs_and_the_admin_more(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--max-runs-per-token", "3", env=ENV)
    with client(hub) as http, client(hub, ADMIN) as admin:
        for i in range(3):
            assert join(http, f"r{i}", "a").status_code == 200
        refused(join(http, "r3", "a"), "max_runs_per_token")
        assert admin.get("/v1/runs/r3").status_code == 404  # nothing was created
        assert join(http, "r0", "b").status_code == 200  # its runs still take peers
        assert join(admin, "r3", "a").status_code == 200  # the operator's token has no limit
        assert join(http, "r3", "b").status_code == 200  # and the run it made is open to the token
    hub.stop()
    hub.start()  # who created what is kept
    with client(hub) as http:
        refused(join(http, "r4", "a"), "max_runs_per_token")


def test_a_run_may_have_so_many_peers(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--max-peers-per-run", "3", env=ENV)
    with client(hub) as http:
        for peer in "abc":
            assert join(http, "r", peer, min_peers=3).status_code == 200
        refused(join(http, "r", "d"), "max_peers_per_run")
        assert [p["peer"] for p in http.get("/v1/runs/r").json()["peers"]] == ["a", "b", "c"]  # d is not a member
        assert http.post("/v1/runs/r/peers/c/leave").status_code == 200
        assert join(http, "r", "c").status_code == 200  # a member always comes back
        r = join(http, "big", "a", min_peers=4)  # a run that could never start
        assert r.status_code == 422 and "SYNC_MAX_PEERS_PER_RUN" in r.json()["detail"], r.text
        assert http.get("/v1/runs/big").status_code == 404


def test_runs_are_listed_a_page_at_a_time(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory(env=ENV)
    names = [f"run-{i:02d}" for i in range(7)]
    with client(hub) as http:
        for name in reversed(names):
            assert join(http, name, "a").status_code == 200
        whole = http.get("/v1/runs")
        assert [r["run"] for r in whole.json()] == names and "link" not in whole.headers  # by name
        seen, url = [], "/v1/runs?limit=3"
        while url:
            page = http.get(url)
            assert page.status_code == 200 and len(page.json()) <= 3
            seen += [r["run"] for r in page.json()]
            link = page.headers.get("link", "")
            url = link[1 : link.index(">")] if 'rel="next"' in link else ""
        assert seen == names
        assert http.get("/v1/runs", params={"limit": 0}).status_code == 422
        assert http.get("/v1/runs", params={"limit": 1001}).status_code == 422


def test_metrics_label_so_many_runs_and_sum_the_others(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--metrics-runs", "2", env=ENV)
    with client(hub) as http:
        for i in range(5):
            assert join(http, f"m{i}", "a").status_code == 200
        version0 = b"".join(iter_chunks([("w", np.ones(4, np.float32), "F32")]))
        for i in range(5):
            assert http.put(f"/v1/runs/m{i}/versions/0", params={"peer": "a"}, content=version0).status_code == 200
        text = http.get("/metrics").text
    labels = {
        s.labels["run"] for family in text_string_to_metric_families(text) for s in family.samples if "run" in s.labels
    }
    assert labels == {"m0", "m1", "_other"}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["weightsync_runs", ()] == 5
    assert samples["weightsync_live_peers", (("run", "_other"),)] == 3  # m2, m3, m4: one peer each
    assert ("weightsync_version", (("run", "_other"),)) not in samples
