"""The dashboard: its maths (pure), its data API and tokens (real hub), its page (real Chromium)."""

from __future__ import annotations

import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from syncserver.api.dashboard import STATIC, curves, round_trace
from syncserver.records import RoundRecord, UpdateRecord
from syncserver.settings import HubSettings
from tests.conftest import REPO, Hub
from tests.harness import HTTP, Peers
from tests.test_samedata import delta, round_, start_run

TOKEN, VIEW = "hub-secret", "view-only"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"  # as .ci/install-chromium.sh
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def update(peer: str, round_: int, received: float, seconds: float, seq: int, **metrics: float) -> UpdateRecord:
    return UpdateRecord(peer, round_, seq, "d" * 64, 8, metrics, 1000, received, seconds, round_)


def closed_round(round_: int, opened: float, closed: float, fold: float, merge: float, **kw: Any) -> RoundRecord:
    return RoundRecord(
        round=round_,
        opened=opened,
        closed=closed,
        participants=kw.get("participants", ["a", "b"]),
        dropped=kw.get("dropped", []),
        samples=16,
        bytes_in=2000,
        result_bytes=1000,
        timings={"fold": fold, "merge": merge},
    )


# ---- the maths ----------------------------------------------------------------------------------
def test_round_trace_phases_by_hand() -> None:
    rounds = [
        closed_round(0, opened=100.0, closed=103.0, fold=0.5, merge=0.5),
        closed_round(1, opened=110.5, closed=110.7, fold=0.1, merge=0.1, participants=["a"], dropped=["b"]),
    ]
    updates = [
        update("a", 0, received=100.0, seconds=0.4, seq=1),
        update("b", 0, received=101.8, seconds=1.0, seq=2),
        update("a", 1, received=110.5, seconds=0.5, seq=3),
    ]
    downloads = {0: {"a": (103.2, 103.5)}, 1: {"a": (110.7, 110.95)}}
    r0, r1 = round_trace(rounds, updates, downloads)

    assert [lane["peer"] for lane in r0["lanes"]] == ["a", "b"]
    a, b = (lane["spans"] for lane in r0["lanes"])
    # aggregation began fold + merge before the round closed; the hub's side lasts until a's
    # download began (the commit and wake-up are the hub's time too)
    assert a == [
        ["upload", 99.6, 100.0],
        ["wait", 100.0, 102.0],
        ["aggregate", 102.0, 103.2],
        ["download", 103.2, 103.5],
    ]
    # b never fetched the result (as far as the hub knows): no download, aggregation to the close
    assert b == [["upload", 100.8, 101.8], ["wait", 101.8, 102.0], ["aggregate", 102.0, 103.0]]
    assert r0["aggregate_seconds"] == pytest.approx(1.0)

    (a1,) = (lane["spans"] for lane in r1["lanes"])
    # between its previous download and this upload, a was training; aggregation began as
    # its update arrived (b was dropped), so it waited for nobody
    assert a1 == [
        ["train", 103.5, 110.0],
        ["upload", 110.0, 110.5],
        ["aggregate", 110.5, 110.7],
        ["download", 110.7, 110.95],
    ]
    assert r1["dropped"] == ["b"]


def test_curves_use_steps_and_perplexity_from_eval_loss() -> None:
    updates = [
        update("a", 0, 1.0, 0.1, 1, loss=3.0, eval_loss=2.0, step=10, codec_ratio=3.9, codec_error=0.01),
        update("b", 0, 1.0, 0.1, 2, loss=3.2, eval_ppl=8.0, step=10),
        update("a", 1, 2.0, 0.1, 3, loss=2.5, step=20),
        update("b", 1, 2.0, 0.1, 4),  # no metrics at all: ignored
    ]
    c = curves(updates)
    assert c["x"] == "step"
    a, b = c["peers"]["a"], c["peers"]["b"]
    assert a["loss"] == [[10, 3.0], [20, 2.5]]
    assert a["val_ppl"] == [[10, pytest.approx(math.exp(2.0))]]
    assert b["val_ppl"] == [[10, 8.0]]  # a perplexity sent as such wins over exp(eval_loss)
    assert a["codec_ratio"] == [[10, 3.9]] and a["codec_error"] == [[10, 0.01]]
    assert b["codec_error"] == []


def test_curves_fall_back_to_rounds_without_steps() -> None:
    c = curves([update("a", 3, 1.0, 0.1, 1, loss=3.0, step=5), update("b", 4, 1.0, 0.1, 2, train_loss=2.0)])
    assert c["x"] == "round"
    assert c["peers"]["a"]["loss"] == [[3.0, 3.0]] and c["peers"]["b"]["loss"] == [[4.0, 2.0]]


def test_view_token_needs_a_hub_token(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="SYNC_VIEW_TOKEN"):
        HubSettings(data_dir=tmp_path, view_token="look")


# ---- the page's files and data, over HTTP ------------------------------------------------------------
def test_static_page_ships_everything_itself() -> None:
    """No CDN: a hub may have no internet. The only URL in the page's files is SVG's namespace,
    and every file the page loads is a relative path served by the hub."""
    names = sorted(p.name for p in STATIC.iterdir())
    assert names == ["app.css", "app.js", "index.html"]
    for path in STATIC.iterdir():
        urls = set(re.findall(r"[a-z]+://[^\s\"'`)]+", path.read_text(encoding="utf-8")))
        assert urls <= {"http://www.w3.org/2000/svg"}, (path.name, urls)
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    loaded = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sorted(loaded) == ["data:,", "static/app.css?v={{version}}", "static/app.js?v={{version}}"]


def test_view_token_watches_but_cannot_act(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--min-peers", "1", env={"SYNC_TOKEN": TOKEN, "SYNC_VIEW_TOKEN": VIEW})
    view = {"Authorization": f"Bearer {VIEW}"}
    full = {"Authorization": f"Bearer {TOKEN}"}
    page = HTTP.get(f"{hub.url}/")  # the page itself is static: no token
    assert page.status_code == 200 and 'src="static/app.js?v=' in page.text
    assert HTTP.get(f"{hub.url}/static/app.js").status_code == 200
    assert HTTP.get(f"{hub.url}/v1/dashboard").status_code == 401
    assert HTTP.get(f"{hub.url}/v1/dashboard", headers={"Authorization": "Bearer nope"}).status_code == 401

    Peers(hub.url, "v", ["solo"], token=TOKEN, retry_seconds=30).train_all(1).wait()
    for path in ("/v1/dashboard?run=v", "/v1/runs", "/v1/runs/v", "/metrics"):
        assert HTTP.get(f"{hub.url}{path}", headers=view).status_code == 200, path
        assert HTTP.get(f"{hub.url}{path}", headers=full).status_code == 200, path
    # nothing that changes state, renews a lease or serves weights takes the view token
    refused = [
        HTTP.post(f"{hub.url}/v1/runs/v/peers", json={"peer": "spy"}, headers=view),
        HTTP.get(f"{hub.url}/v1/runs/v/model", headers=view),
        HTTP.get(f"{hub.url}/v1/runs/v/rounds/0/result", headers=view),
        HTTP.get(f"{hub.url}/v1/runs/v/peers/solo/start", headers=view),
        HTTP.post(f"{hub.url}/v1/runs/v/peers/solo/heartbeat", headers=view),
        HTTP.put(f"{hub.url}/v1/runs/v/rounds/1/updates/solo", content=b"x", headers=view),
    ]
    assert [r.status_code for r in refused] == [401] * len(refused)
    assert HTTP.get(f"{hub.url}/v1/runs/v/model", headers=full).status_code == 200

    data = HTTP.get(f"{hub.url}/v1/dashboard", params={"run": "v"}, headers=view).json()
    assert [r["run"] for r in data["runs"]] == ["v"]
    run = data["run"]
    assert run["version"] == 1 and [p["peer"] for p in run["peers"]] == ["solo"]
    assert "updates" not in run  # they come as curves and trace, not raw
    (trace,) = run["trace"]
    phases = [s[0] for s in trace["lanes"][0]["spans"]]
    assert phases[0] == "upload" and "aggregate" in phases  # "wait": the hub folding its update
    assert run["curves"]["x"] == "step" and len(run["curves"]["peers"]["solo"]["loss"]) == 1
    assert HTTP.get(f"{hub.url}/v1/dashboard", params={"run": "nope"}, headers=view).json()["run"] is None


def test_run_token_sees_its_run_only(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory(env={"SYNC_RUN_TOKENS": '{"r1": "tok1", "r2": "tok2"}'})
    for run, token in (("r1", "tok1"), ("r2", "tok2")):
        r = HTTP.post(
            f"{hub.url}/v1/runs/{run}/peers", json={"peer": "p"}, headers={"Authorization": f"Bearer {token}"}
        )
        r.raise_for_status()

    def dashboard(token: str, **params: str) -> httpx.Response:
        return HTTP.get(f"{hub.url}/v1/dashboard", params=params, headers={"Authorization": f"Bearer {token}"})

    mine = dashboard("tok1", run="r1")
    assert mine.status_code == 200
    assert [r["run"] for r in mine.json()["runs"]] == ["r1"]  # not a word of r2
    assert mine.json()["run"]["run"] == "r1"
    assert dashboard("tok1", run="r2").status_code == 401  # another run's token: as a wrong one
    assert dashboard("tok1").status_code == 401  # the list of every run is not its to see


def test_dashboard_long_poll_answers_on_change(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory()
    first = HTTP.get(f"{hub.url}/v1/dashboard").json()
    assert first["runs"] == [] and first["run"] is None

    started = time.monotonic()
    same = HTTP.get(f"{hub.url}/v1/dashboard", params={"since": first["fingerprint"], "wait": 1.5}).json()
    assert 1.4 <= time.monotonic() - started < 5  # nothing changed: held for `wait`
    assert same["fingerprint"] == first["fingerprint"]

    def join_soon() -> None:
        time.sleep(0.5)
        HTTP.post(f"{hub.url}/v1/runs/lp/peers", json={"peer": "p"}).raise_for_status()

    threading.Thread(target=join_soon).start()
    started = time.monotonic()
    changed = HTTP.get(f"{hub.url}/v1/dashboard", params={"since": first["fingerprint"], "wait": 15}, timeout=30).json()
    assert time.monotonic() - started < 5  # answered when the run appeared, not after 15 s
    assert [r["run"] for r in changed["runs"]] == ["lp"]


# ---- the page in a real browser -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is in the dev extra: pip install -e .[dev]"
    )
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed: run .ci/install-chromium.sh (apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def test_page_shows_two_peers_training_live(hub_factory: Callable[..., Hub], browser: Any, tmp_path: Path) -> None:
    hub = hub_factory("--min-peers", "2", env={"SYNC_TOKEN": TOKEN, "SYNC_VIEW_TOKEN": VIEW})
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # before any peer: an honest empty state, and the token left the address bar
    page.goto(f"{hub.url}/?token={VIEW}")
    page.get_by_text("No runs yet").wait_for(timeout=15_000)
    assert "token" not in page.url
    assert page.locator("#conn").get_attribute("data-state") == "live"

    peers = Peers(hub.url, "live-run", ["peer-a", "peer-b"], token=TOKEN, min_peers=2, retry_seconds=30)
    peers.train_all(4, pause=0.3)
    try:
        # the page follows by itself: no reload
        page.wait_for_function("document.querySelectorAll('#rounds tbody tr').length >= 2", timeout=60_000)
        page.wait_for_function("document.querySelectorAll('#chart-loss svg path.line').length == 2", timeout=30_000)
        assert page.locator("#runs button").all_inner_texts()[0].startswith("live-run")
        assert "#run=live-run" in page.url

        rows = page.locator("#peers tbody tr")
        assert rows.count() == 2
        assert [rows.nth(i).get_attribute("data-peer") for i in range(2)] == ["peer-a", "peer-b"]
        assert rows.nth(0).locator("td").nth(0).inner_text() == "0"  # ranks by sorted name
        assert page.locator("#rounds tbody tr").count() >= 2
        assert page.locator("#rounds tbody tr").last.get_attribute("data-round") == "0"  # newest first

        # the trace: every phase of both peers drawn as rectangles in lanes
        for phase in ("upload", "wait", "aggregate", "download"):
            assert page.locator(f"#timeline svg rect.span[data-phase={phase}]").count() >= 1, phase
        assert page.locator("#timeline .lane-label").all_text_contents() == ["peer-a", "peer-b"]
        assert page.locator("#timeline svg").get_attribute("data-mode") == "rounds"  # sync phases per round
        page.click("#timeline-mode button[data-mode=wall]")  # one time axis, training between rounds
        assert page.locator("#timeline svg").get_attribute("data-mode") == "wall"
        assert page.locator("#timeline svg rect.span[data-phase=train]").count() >= 1

        # curves: one drawn line per peer for loss and for perplexity, with at least two points
        for chart in ("#chart-loss", "#chart-ppl"):
            paths = page.locator(f"{chart} svg path.line")
            assert paths.count() == 2
            for i in range(2):
                assert paths.nth(i).get_attribute("d").count("L") >= 1
        assert "Compression is off" in page.locator("#chart-codec").inner_text()  # fp32: said so
        # where the bytes went: no object store here, so none through one
        summary = page.locator("#summary").inner_text()
        assert "bytes up" in summary and "bytes down" in summary and "store 0 B" in summary, summary

        out = tmp_path / "dashboard.png"
        page.screenshot(path=str(out), full_page=True)
        artifacts = REPO / "artifacts"
        artifacts.mkdir(exist_ok=True)
        shutil.copy(out, artifacts / "dashboard.png")
        assert out.stat().st_size > 20_000
    finally:
        peers.wait()
    page.wait_for_function("document.querySelector('#summary .v').textContent === '4'", timeout=30_000)
    assert errors == []
    page.close()


def test_page_says_when_two_peers_trained_on_the_same_data(hub_factory: Callable[..., Hub], browser: Any) -> None:
    """The hub's same-data notice (tests/test_samedata.py) is the first thing on the run's page."""
    hub = hub_factory()
    http = httpx.Client(base_url=hub.url, timeout=30)
    start_run(http, "twins")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(f"{hub.url}/#run=twins")
    page.locator("#summary .stat").first.wait_for(timeout=15_000)
    assert page.locator("#notice").is_hidden()  # nothing to say yet
    round_(http, "twins", 0, delta(2), delta(2))  # one seed on both peers
    notice = page.locator("#notice")
    notice.wait_for(state="visible", timeout=30_000)  # the page follows by itself
    text = notice.inner_text()
    assert "peers peer-0 and peer-1 sent identical updates in round 0" in text, text
    assert "give each peer its own seed or data shard" in text, text
    page.close()


def test_page_asks_for_a_token_and_refuses_a_wrong_one(hub_factory: Callable[..., Hub], browser: Any) -> None:
    hub = hub_factory(env={"SYNC_TOKEN": TOKEN, "SYNC_VIEW_TOKEN": VIEW})
    page = browser.new_page()
    page.goto(f"{hub.url}/")
    page.get_by_text("This hub needs a token").wait_for(timeout=15_000)
    assert page.locator("#conn").get_attribute("data-state") == "token"
    page.fill("#token", "wrong")
    page.click("#login-form button")
    page.locator("#login-error").wait_for(state="visible", timeout=15_000)
    page.fill("#token", VIEW)
    page.click("#login-form button")
    page.get_by_text("No runs yet").wait_for(timeout=15_000)
    assert page.evaluate("sessionStorage.getItem('weightsync.token')") == VIEW
    page.close()
