"""``/docs`` works on a hub without internet, and the schema is public by decision (docs/SECURITY.md)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin

import httpx
import pytest

from syncserver.docs import SWAGGER_UI_VERSION
from tests.conftest import Hub
from tests.test_dashboard import browser  # noqa: F401 (the fixture: one Chromium, skipped without one)

TOKEN = "hub-secret"


@pytest.fixture
def guarded_hub(hub_factory: Callable[..., Hub]) -> Hub:
    return hub_factory(env={"SYNC_TOKEN": TOKEN})


def test_docs_page_loads_only_its_own_assets(guarded_hub: Hub) -> None:
    page = httpx.get(f"{guarded_hub.url}/docs")
    assert page.status_code == 200
    assert not re.search(r"(?i)\b(?:https?:)?//", page.text), "the page points outside the hub"
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert len(assets) == 3, assets  # the bundle, its CSS, the favicon
    types = {}
    for asset in assets:
        response = httpx.get(urljoin(f"{guarded_hub.url}/docs", asset))
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
    schema = httpx.get(f"{guarded_hub.url}/openapi.json").json()
    operations = sum(len(methods) for methods in schema["paths"].values())
    assert page.locator(".opblock").count() == operations
    assert outside == [] and errors == []
    page.close()


def test_redoc_is_off(guarded_hub: Hub) -> None:
    # its page would load its bundle from a CDN; Swagger UI at /docs shows the same schema
    assert httpx.get(f"{guarded_hub.url}/redoc").status_code == 404


def test_docs_and_schema_need_no_token_but_the_api_does(guarded_hub: Hub) -> None:
    """The decision, pinned: the schema is the open-source API and holds no secret, and the page
    must load before anyone can type a token into it. Everything else still asks for one."""
    schema = httpx.get(f"{guarded_hub.url}/openapi.json")
    assert schema.status_code == 200
    assert schema.json()["info"]["title"] == "weightsync hub"
    assert TOKEN not in schema.text
    assert httpx.get(f"{guarded_hub.url}/docs").status_code == 200
    assert httpx.get(f"{guarded_hub.url}/v1/runs").status_code == 401
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{guarded_hub.url}/v1/runs", headers=headers).status_code == 200
