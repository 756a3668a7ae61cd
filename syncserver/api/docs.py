"""The API's documentation page, ``GET /docs`` (Swagger UI), served from the package itself.

FastAPI's own ``/docs`` loads Swagger UI's script and CSS from a CDN (and its favicon from
fastapi.tiangolo.com), so a hub without internet, the usual case on a private network, shows a
blank page. The few files it needs are vendored in ``syncserver/api/swagger_ui/`` (from the npm
package ``swagger-ui-dist`` 5.35.0, Apache-2.0: its LICENSE, NOTICE and the bundle's third-party
licences sit beside them) and served under ``/docs/assets``, apart from the dashboard's files. To
update: ``npm pack swagger-ui-dist``, copy ``swagger-ui-bundle.js``,
``swagger-ui-bundle.js.LICENSE.txt``, ``swagger-ui.css``, ``favicon-32x32.png``, ``LICENSE`` and
``NOTICE`` over these, and change :data:`SWAGGER_UI_VERSION`.

ReDoc (``/redoc``) is off: a second viewer of the same schema would add a second large bundle for
nothing Swagger UI lacks.

The page and ``/openapi.json`` need no token, by decision (docs/SECURITY.md): the schema is the
open-source API and holds no secret, and the page must load before a user can type a token.
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
    """Serve ``/docs`` and its files. Build ``app`` with ``docs_url=None, redoc_url=None`` so
    that FastAPI does not add its CDN-backed pages first."""
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
