"""The API's documentation page, ``GET /docs`` (Swagger UI), served from the package itself:
FastAPI's own loads its script and CSS from a CDN, and a hub without internet (the usual case on a
private network) showed a blank page. ReDoc is off: a second large bundle for the same schema. The
page and ``/openapi.json`` need no token, by decision (docs/SECURITY.md).

``swagger_ui/`` is the npm package ``swagger-ui-dist`` (Apache-2.0: its LICENSE, NOTICE and the
bundle's third-party licences beside it). To update: ``npm pack swagger-ui-dist``, copy
``swagger-ui-bundle.js`` (and its ``.LICENSE.txt``), ``swagger-ui.css``, ``favicon-32x32.png``,
``LICENSE`` and ``NOTICE`` over these, and change :data:`SWAGGER_UI_VERSION`.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["SWAGGER_UI_VERSION", "add_docs"]

SWAGGER_UI_VERSION = "5.35.0"  # the vendored swagger-ui-dist; also busts browser caches on update
FILES = Path(__file__).parent / "swagger_ui"
ASSETS = "/docs/assets"


def add_docs(app: FastAPI) -> None:
    """Serve ``/docs`` and its files (``app`` built with ``docs_url=None, redoc_url=None``)."""
    if app.openapi_url is None:
        raise ValueError("the docs page needs the app's OpenAPI schema (openapi_url is None)")
    openapi_url = app.openapi_url

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        # behind a proxy that mounts the hub under a prefix, every URL needs it, as in FastAPI's own page
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - API",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js?v={SWAGGER_UI_VERSION}",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css?v={SWAGGER_UI_VERSION}",
            swagger_favicon_url=f"{root}{ASSETS}/favicon-32x32.png",
            # Swagger UI would otherwise ask validator.swagger.io to check the schema
            swagger_ui_parameters={"validatorUrl": None},
        )

    app.mount(ASSETS, StaticFiles(directory=FILES), name="docs-assets")
