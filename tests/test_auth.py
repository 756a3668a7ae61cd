"""Who may do what on a hub with tokens, and that no token ever reaches the hub's log.

The hub under test gives its peers per-run tokens (``SYNC_RUN_TOKENS``), its operator an admin
token and its viewers a view token; it has no hub-wide ``SYNC_TOKEN``. A run token opens its
own run only; the view token reads; the admin token does everything; nothing else gets in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from syncclient import SyncClient
from syncclient.exceptions import AuthError
from syncserver.api.factory import redact
from tests.conftest import Hub
from tests.harness import HTTP, run_peers
from tests.models import tiny_gpt2

# distinctive values, so that a grep of the log finds any of them
TOKEN_A = "run-a-token-7f3e9c1d2b"
TOKEN_B = "run-b-token-0a8d4e6f5c"
ADMIN = "admin-token-c4b2a19e7d"
VIEW = "view-token-5e1f0d3a8b"
SECRETS = (TOKEN_A, TOKEN_B, ADMIN, VIEW)
ENV = {
    "SYNC_RUN_TOKENS": json.dumps({"run-a": TOKEN_A, "run-b": TOKEN_B}),
    "SYNC_ADMIN_TOKEN": ADMIN,
    "SYNC_VIEW_TOKEN": VIEW,
}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def hub(hub_factory: Callable[..., Hub]) -> Hub:
    # info: uvicorn's access log is on, so the log test sees every request line
    return hub_factory("--log-level", "info", env=ENV)


def sync_two_peers(hub: Hub, run: str, token: str, rounds: int = 2) -> list[int]:
    """Two real SyncClients join ``run`` with ``token`` and sync; returns their final versions."""

    def peer(i: int) -> int:
        model = tiny_gpt2(seed=i)
        with SyncClient(hub.url, run=run, peer=f"p{i}", token=token, min_peers=2, retry_seconds=30) as client:
            client.join(model)
            for _ in range(rounds):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * (i + 1))
                result = client.sync(model, samples=10 + i, metrics={"loss": 1.0})
        return result.version

    return run_peers(2, peer, timeout=120)


def test_run_token_syncs_its_own_run(hub: Hub) -> None:
    assert sync_two_peers(hub, "run-a", TOKEN_A) == [2, 2]
    status = HTTP.get(f"{hub.url}/v1/runs/run-a", headers=bearer(TOKEN_A)).json()
    assert status["version"] == 2 and {p["peer"] for p in status["peers"]} == {"p0", "p1"}


def test_run_token_opens_nothing_else(hub: Hub) -> None:
    sync_two_peers(hub, "run-b", TOKEN_B, rounds=1)
    a = bearer(TOKEN_A)
    # run-b's every endpoint, with run-a's token: the same 401 as a wrong token
    for method, path, kwargs in [
        ("GET", "/v1/runs/run-b", {}),
        ("POST", "/v1/runs/run-b/peers", {"json": {"peer": "intruder"}}),
        ("GET", "/v1/runs/run-b/model", {}),
        ("GET", "/v1/runs/run-b/rounds/0/result", {}),
        ("POST", "/v1/runs/run-b/peers/p0/heartbeat", {}),
        ("POST", "/v1/runs/run-b/peers/p0/leave", {}),
        ("PUT", "/v1/runs/run-b/rounds/1/updates/p0", {"content": b"x", "headers": {"X-Sync-Samples": "1"}}),
        # and what is not a run's: the list of runs, a run nobody declared, the metrics
        ("GET", "/v1/runs", {}),
        ("POST", "/v1/runs/run-c/peers", {"json": {"peer": "p0"}}),
        ("GET", "/metrics", {}),
    ]:
        headers = {**a, **kwargs.pop("headers", {})}
        r = HTTP.request(method, f"{hub.url}{path}", headers=headers, **kwargs)
        assert r.status_code == 401, (method, path, r.text)
        assert r.json() == {"error": "unauthorized", "detail": "missing or wrong bearer token"}
    status = HTTP.get(f"{hub.url}/v1/runs/run-b", headers=bearer(TOKEN_B)).json()
    assert status["version"] == 1 and "intruder" not in {p["peer"] for p in status["peers"]}
    assert HTTP.get(f"{hub.url}/v1/runs/run-c", headers=bearer(ADMIN)).status_code == 404  # never created


def test_admin_creates_runs_and_reads_all(hub: Hub) -> None:
    sync_two_peers(hub, "run-a", TOKEN_A, rounds=1)
    admin = bearer(ADMIN)
    # a run with no run token: only the admin (or a hub-wide token) may create and use it
    assert sync_two_peers(hub, "run-c", ADMIN, rounds=1) == [1, 1]
    runs = {r["run"] for r in HTTP.get(f"{hub.url}/v1/runs", headers=admin).json()}
    assert runs == {"run-a", "run-c"}
    assert HTTP.get(f"{hub.url}/v1/runs/run-a", headers=admin).json()["version"] == 1
    assert HTTP.get(f"{hub.url}/v1/runs/run-a/model", headers=admin).status_code == 200
    assert HTTP.get(f"{hub.url}/metrics", headers=admin).status_code == 200


def test_view_token_reads_and_changes_nothing(hub: Hub) -> None:
    sync_two_peers(hub, "run-a", TOKEN_A, rounds=1)
    view = bearer(VIEW)
    assert HTTP.get(f"{hub.url}/v1/runs", headers=view).status_code == 200
    assert HTTP.get(f"{hub.url}/v1/runs/run-a", headers=view).json()["version"] == 1
    for method, path in [
        ("GET", "/v1/runs/run-a/model"),
        ("POST", "/v1/runs/run-a/peers/p0/leave"),
        ("GET", "/v1/runs/run-a/rounds/0/result"),
    ]:
        assert HTTP.request(method, f"{hub.url}{path}", headers=view).status_code == 401, path
    r = HTTP.post(f"{hub.url}/v1/runs/run-a/peers", headers=view, json={"peer": "viewer"})
    assert r.status_code == 401
    peers = HTTP.get(f"{hub.url}/v1/runs/run-a", headers=view).json()["peers"]
    assert {p["peer"]: p["state"] for p in peers} == {"p0": "left", "p1": "left"}


def test_no_or_wrong_token_is_401_everywhere_but_healthz(hub: Hub) -> None:
    assert HTTP.get(f"{hub.url}/healthz").status_code == 200
    for token in [None, "wrong", TOKEN_A + "x", TOKEN_A[:-1], ADMIN.upper(), f"{TOKEN_A} {TOKEN_A}"]:
        headers = bearer(token) if token is not None else {}
        for path in ["/v1/runs", "/v1/runs/run-a", "/v1/runs/run-a/model", "/metrics"]:
            assert HTTP.get(f"{hub.url}{path}", headers=headers).status_code == 401, (token, path)
        r = HTTP.post(f"{hub.url}/v1/runs/run-a/peers", headers=headers, json={"peer": "p0"})
        assert r.status_code == 401, token
    for scheme in ("Basic", "Token", ""):
        r = HTTP.get(f"{hub.url}/v1/runs", headers={"Authorization": f"{scheme} {ADMIN}".strip()})
        assert r.status_code == 401, scheme
    assert HTTP.get(f"{hub.url}/v1/runs", headers=bearer(ADMIN)).json() == []  # nothing was created


def test_sdk_with_a_wrong_token_fails_at_once(hub: Hub) -> None:
    """401 is not retried: the SDK raises AuthError, it does not spin for retry_seconds."""
    client = SyncClient(hub.url, run="run-a", peer="p0", token="not-the-token-1b2c", retry_seconds=60)
    started = time.monotonic()
    with pytest.raises(AuthError) as caught:
        client.join(tiny_gpt2())
    client.close()
    assert time.monotonic() - started < 10
    assert caught.value.status == 401 and "not-the-token" not in str(caught.value)


def test_no_token_in_the_log(hub: Hub) -> None:
    """After syncs, refusals and a dashboard link with ``?token=``, the log holds no token."""
    sync_two_peers(hub, "run-a", TOKEN_A, rounds=1)
    HTTP.get(f"{hub.url}/v1/runs/run-b", headers=bearer(TOKEN_A))  # refused
    HTTP.get(f"{hub.url}/v1/runs", headers=bearer(TOKEN_B + "-guess"))  # refused
    for token in (VIEW, ADMIN):
        HTTP.get(f"{hub.url}/", params={"token": token})  # the dashboard link
        HTTP.get(f"{hub.url}/v1/runs", params={"token": token, "x": "1"}, headers=bearer(token))
        for key in ENCODED_KEYS:  # the key spelled so that only a decoder sees "token" (*was* logged)
            HTTP.get(f"{hub.url}/?{key}={token}")
            HTTP.get(f"{hub.url}/v1/runs?x=1&{key}={token}", headers=bearer(token))
    hub.stop()
    log = hub.log()
    assert '"GET /v1/runs/run-a' in log and "token=***" in log  # the access log was on, and redacted
    assert "GET /?%74oken=***" in log
    for secret in (*SECRETS, TOKEN_B + "-guess"):
        assert secret not in log, secret


ENCODED_KEYS = ["%74oken", "%54%4F%4B%45%4E", "t%6Fken", "access%5Ftoken", "%2574oken", "Token"]


@pytest.mark.parametrize(
    ("line", "redacted"),
    [
        ('"GET /?token=s3cret HTTP/1.1"', '"GET /?token=*** HTTP/1.1"'),
        ('"GET /?%74oken=s3cret HTTP/1.1"', '"GET /?%74oken=*** HTTP/1.1"'),
        ("/v1/runs?x=1&%54%4f%4b%45%4e=s3cret&y=2", "/v1/runs?x=1&%54%4f%4b%45%4e=***&y=2"),
        ("/?access%5Ftoken=s3cret;token=s3cret", "/?access%5Ftoken=***;token=***"),
        ("/?%2574oken=s3cret", "/?%2574oken=***"),  # decoded twice: hiding too much is harmless
        ("/?tokens=public&to=ken", "/?tokens=public&to=ken"),  # other keys stay
    ],
)
def test_redaction_decodes_the_key(line: str, redacted: str) -> None:
    assert redact(line) == redacted


def test_open_hub_needs_no_token(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory()
    assert HTTP.get(f"{hub.url}/v1/runs").json() == []
    assert sync_two_peers(hub, "anything", "", rounds=1) == [1, 1]


def test_hub_wide_token_opens_every_run(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory(env={"SYNC_TOKEN": "hub-wide-token", **ENV})
    assert sync_two_peers(hub, "run-a", "hub-wide-token", rounds=1) == [1, 1]
    assert sync_two_peers(hub, "run-z", "hub-wide-token", rounds=1) == [1, 1]
    assert HTTP.get(f"{hub.url}/v1/runs/run-a", headers=bearer(TOKEN_A)).status_code == 200


@pytest.mark.parametrize(
    ("run_tokens", "problem"),
    [
        ({"../etc": "secret-value-1"}, "not a run name"),
        ({"ok": ""}, "empty"),
        ("not json secret-value-1", "run_tokens"),
    ],
)
def test_bad_run_tokens_stop_the_hub_without_printing_them(
    tmp_path: Any, run_tokens: dict[str, str] | str, problem: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    env["SYNC_RUN_TOKENS"] = run_tokens if isinstance(run_tokens, str) else json.dumps(run_tokens)
    proc = subprocess.run(
        [sys.executable, "-m", "syncserver", "serve", "--port", "0", "--data-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    text = " ".join(out.replace("│", " ").split())  # rich wraps the message in a box
    assert proc.returncode != 0 and problem in text, out
    assert "secret-value-1" not in out
