"""The docs: the hub's ``/docs`` page works without internet and the schema is public by decision
(docs/SECURITY.md); the docs site builds strictly, offline, and its reference holds every hub setting,
CLI flag, HTTP operation and public SDK name because they exist in the code (docs/gen_reference.py)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import pytest
import typer.main

from syncserver.api.docs import SWAGGER_UI_VERSION
from syncserver.cli import app as syncserver_cli
from syncserver.cli import env_name, flag_name
from syncserver.settings import HubSettings
from tests.conftest import REPO, Hub, shared_hub
from tests.harness import HTTP
from tests.test_dashboard import browser  # noqa: F401 (the fixture: one Chromium, skipped without one)
from weightsync_run.cli import build_parser

TOKEN = "hub-secret"


@pytest.fixture(scope="module")
def guarded_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One hub for the module's tests: each only reads its pages and schema."""
    with shared_hub(tmp_path_factory, "guarded-hub", env={"SYNC_TOKEN": TOKEN}) as hub:
        yield hub


def test_docs_page_loads_only_its_own_assets(guarded_hub: Hub) -> None:
    page = HTTP.get(f"{guarded_hub.url}/docs")
    assert page.status_code == 200
    assert not re.search(r"(?i)\b(?:https?:)?//", page.text), "the page points outside the hub"
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert len(assets) == 3, assets  # the bundle, its CSS, the favicon
    types = {}
    for asset in assets:
        response = HTTP.get(urljoin(f"{guarded_hub.url}/docs", asset))
        assert response.status_code == 200, asset
        types[asset.split("?")[0].rsplit(".", 1)[-1]] = response.headers["content-type"].split(";")[0]
        if asset.endswith(f"swagger-ui-bundle.js?v={SWAGGER_UI_VERSION}"):
            assert b"SwaggerUIBundle" in response.content
    assert types == {"js": "text/javascript", "css": "text/css", "png": "image/png"}
    assert "url: '/openapi.json'" in page.text


def test_docs_page_draws_the_api_with_no_internet(guarded_hub: Hub, browser: Any) -> None:  # noqa: F811 (the fixture)
    """In a real Chromium that may reach nothing but the hub, Swagger UI draws every operation."""
    page = browser.new_page()
    outside: list[str] = []
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    def only_the_hub(route: Any) -> None:
        if route.request.url.startswith(guarded_hub.url):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_hub)
    page.goto(f"{guarded_hub.url}/docs")
    page.wait_for_selector(".opblock")  # Playwright waits for it (30 s at most)
    schema = HTTP.get(f"{guarded_hub.url}/openapi.json").json()
    operations = sum(len(methods) for methods in schema["paths"].values())
    assert page.locator(".opblock").count() == operations
    assert outside == [] and errors == []
    page.close()


def test_redoc_is_off(guarded_hub: Hub) -> None:
    # its page would load its bundle from a CDN; Swagger UI at /docs shows the same schema
    assert HTTP.get(f"{guarded_hub.url}/redoc").status_code == 404


def test_docs_and_schema_need_no_token_but_the_api_does(guarded_hub: Hub) -> None:
    """The decision, pinned: the schema is the open-source API and holds no secret, and the page
    must load before anyone can type a token into it. Everything else still asks for one."""
    schema = HTTP.get(f"{guarded_hub.url}/openapi.json")
    assert schema.status_code == 200
    assert schema.json()["info"]["title"] == "weightsync hub"
    assert TOKEN not in schema.text
    assert HTTP.get(f"{guarded_hub.url}/docs").status_code == 200
    assert HTTP.get(f"{guarded_hub.url}/v1/runs").status_code == 401
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert HTTP.get(f"{guarded_hub.url}/v1/runs", headers=headers).status_code == 200


# --- the docs site ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict`` (what CI and ``make docs`` run) into a folder of this test: about
    4 s. Strict: a broken link or anchor, a reference mkdocstrings cannot resolve, fails it."""
    out = tmp_path_factory.mktemp("site")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "WEIGHTSYNC_"))}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env={**env, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _text(page: Path) -> str:
    """The page's text without tags, so that ``<code>--data-dir</code>`` reads ``--data-dir``."""
    return unescape(re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8")))


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings if o not in ("-h", "--help")}


def test_every_hub_setting_is_in_the_reference(site: Path) -> None:
    settings = _text(site / "reference" / "settings.html")
    cli = _text(site / "reference" / "cli.html")
    for name, field in HubSettings.model_fields.items():
        assert env_name(name) in settings, name
        assert flag_name(name) in settings and flag_name(name) in cli, name
        assert field.description and field.description.split(":")[0][:40] in settings, name


def test_every_cli_flag_is_in_the_reference(site: Path) -> None:
    cli = _text(site / "reference" / "cli.html")
    group = typer.main.get_command(syncserver_cli)
    flags = {
        f"syncserver {name}": {
            o if o.startswith("-") else o.upper() for p in command.params for o in [*p.opts, *p.secondary_opts]
        }
        for name, command in group.commands.items()  # type: ignore[attr-defined]  # a click Group
    }
    flags["weightsync-run"] = _options(build_parser())
    spec = importlib.util.spec_from_file_location("finetune_gpt2", REPO / "train" / "finetune_gpt2.py")
    assert spec is not None and spec.loader is not None
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    flags["train/finetune_gpt2.py"] = _options(finetune.build_parser())
    assert all(flags.values()) and "--local-peers" in flags["weightsync-run"]
    for command, options in flags.items():
        assert command in cli, command
        missing = {o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", cli)}
        assert not missing, f"{command}: {sorted(missing)}"


def test_every_public_name_is_in_the_python_reference(site: Path) -> None:
    page = (site / "reference" / "python.html").read_text(encoding="utf-8")
    lightning = (REPO / "syncclient" / "lightning.py").read_text()
    modules = {
        "syncclient": __import__("syncclient").__all__,
        "syncwire": __import__("syncwire").__all__,
        "syncserver": [n for n in __import__("syncserver").__all__ if not n.startswith("__")],
        "syncclient.lightning": re.findall(r'"(\w+)"', re.search(r"__all__ = \[(.*?)\]", lightning, re.S)[1]),  # type: ignore[index]
    }
    assert "SyncClient" in modules["syncclient"] and "SyncCallback" in modules["syncclient.lightning"]
    for module, names in modules.items():
        for name in names:
            # an anchor mkdocstrings made from the docstrings: the name resolved to real code
            assert f'id="{module}.{name}"' in page, f"{module}.{name}"


def test_every_http_operation_is_in_the_reference(site: Path, tmp_path: Path) -> None:
    from syncserver import create_app

    page = _text(site / "reference" / "http.html")
    schema = create_app(HubSettings(data_dir=tmp_path)).openapi()
    operations = [(m.upper(), p) for p, methods in schema["paths"].items() for m in methods]
    assert len(operations) > 10
    for method, path in operations:
        assert f"{method} {path}" in page, (method, path)
    for name in schema["components"]["schemas"]:
        assert name in page, name


def test_the_site_loads_nothing_from_outside(site: Path) -> None:
    """Offline at view time: no page loads a script, style, font or image from another host."""
    pages = list(site.rglob("*.html"))
    assert len(pages) > 15
    for page in pages:
        html = page.read_text(encoding="utf-8")
        loads = re.findall(r"<(?:script|link|img|iframe)\b[^>]*?(?:src|href)=\"([^\"]+)\"", html)
        outside = [url for url in loads if re.match(r"(?i)(?:[a-z]+:)?//", url)]
        assert not outside, (page.name, outside)
        assert "fonts.googleapis" not in html and "fonts.gstatic" not in html, page.name


def test_the_results_open_with_one_table_of_targets() -> None:
    """bench/RESULTS.md answers "what is the current figure?" in its first table: every row has a
    figure, a target, met or not, a command, a machine and a date, and links to its notebook entry,
    which exists (the strict build checks the anchor)."""
    text = (REPO / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    table = re.search(r"\n(\| benchmark target \|.*?)\n\n", text, re.S)
    assert table is not None and text.index(table[1]) < text.index("\n## ")
    rows = table[1].splitlines()
    assert rows[0].split("|")[1:-1] == [
        f" {c} " for c in ("benchmark target", "current figure", "target", "met", "command", "machine", "date")
    ]
    assert len(rows) > 20
    for row in rows[2:]:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert len(cells) == 7 and all(cells), row
        assert re.match(r"\[\w+\]\(#[\w-]+\)", cells[0]), row
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", cells[6]), row
