"""The app factory: ``create_app(settings)`` wires the layers into one FastAPI app (the store,
the coordinator, the routes, the dashboard, /metrics, /docs) and holds the one table that turns
the hub's errors into answers. ``uvicorn syncserver.app:app`` is the process entry point
(:mod:`syncserver.app`); tests and embedders call ``syncserver.create_app``.
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import unquote_plus

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from syncserver import __version__
from syncserver.api.dashboard import add_dashboard
from syncserver.api.docs import add_docs
from syncserver.api.metrics import HubMetrics
from syncserver.api.metrics import router as metrics_router
from syncserver.api.protocol import end_polls_on_exit, guard_uvicorn
from syncserver.api.reduce import router as reduce_router
from syncserver.api.reduce import view_router as reduce_view_router
from syncserver.api.routes import router, view_router
from syncserver.api.schemas import ErrorBody, Health
from syncserver.core.coordinator import Coordinator
from syncserver.core.leases import Board
from syncserver.core.planes import BucketPlane, LocalPlane
from syncserver.core.workers import BucketReducers, Reducers, Threads, Workers
from syncserver.errors import HubError
from syncserver.reduce.engine import MergeEngine
from syncserver.settings import HubSettings
from syncserver.storage.bucket import open_store
from syncserver.storage.s3 import StoreUnavailable
from syncserver.storage.store import Store, storage_error

log = logging.getLogger(__name__)


def _configure_logging() -> None:
    # The hub is an application: give its logs a handler unless the host (uvicorn's
    # --log-config, a test runner) already set one up.
    logger = logging.getLogger("syncserver")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


#: Query keys whose values are secrets (compared once URL-decoded, in any case).
SECRET_KEYS = frozenset({"token", "access_token"})
_QUERY_ITEM = re.compile(r"([?&;])([^=&;#\s\"?]*)=([^&;#\s\"]*)")


def redact(text: str) -> str:
    """``text`` with the value of every secret query item replaced by ``***``. The key is compared
    decoded, until it no longer changes: ``?%74oken=`` is ``?token=`` to the dashboard and to
    Starlette, and matching the literal ``token=`` let it through (hiding too much is harmless)."""

    def item(match: re.Match[str]) -> str:
        key, previous = match.group(2), None
        while key != previous:
            key, previous = unquote_plus(key), key
        return f"{match.group(1)}{match.group(2)}=***" if key.strip().lower() in SECRET_KEYS else match.group(0)

    return _QUERY_ITEM.sub(item, text) if "=" in text else text


class RedactTokens(logging.Filter):
    """``token=***`` in every record: uvicorn's access log prints query strings, and a dashboard link
    may carry ``?token=`` (Bearer headers are never logged). On every handler the hub's records
    go through, so no logger can print one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if record.exc_info and not record.exc_text:  # a traceback may quote a URL too
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


#: The loggers whose handlers print the hub's records (uvicorn's do not propagate to the root).
_LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "syncserver")


def _redact_logs() -> None:
    # at startup, after uvicorn has configured its loggers; a filter on a handler sees the
    # records of every logger that propagates to it, a filter on a logger only its own
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if not any(isinstance(f, RedactTokens) for f in target.filters):
                target.addFilter(RedactTokens())


#: Declared on every operation, so that the OpenAPI schema tells the truth about errors (and
#: FastAPI's default 422 body, ``{"detail": [...]}``, which the hub never sends, is replaced).
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        400: "Malformed input: a bad body, header or digest.",
        401: "Missing or wrong bearer token.",
        403: "A limit of the hub is reached: runs per token, peers per run (the answer names it).",
        404: "Unknown run, peer or path.",
        409: "Conflicts with the run's state (a closed round, another config, another update).",
        413: "The body is over the run's size limit.",
        422: "Well-formed but wrong: parameters, schema, NaN/Inf, a poisoned update.",
        503: "The hub cannot store anything right now; retry after Retry-After.",
    }.items()
}


async def choose_modes(settings: HubSettings, store: Store) -> tuple[LocalPlane, Workers]:
    """The hub's two modes, chosen here once: where the bytes live (the hub's disk; with
    ``SYNC_STORE`` a bucket too) and who does the tensor work (the hub's threads; with
    ``SYNC_REDUCERS`` leased reducers, through the bucket when there is one)."""
    seconds, reducers = settings.reduce_lease_seconds, settings.reducers
    if not settings.store:
        plane = LocalPlane(store, settings.keep_versions)
        engine = MergeEngine(store, settings.fold_threads)
        return plane, Reducers(engine, plane, Board(seconds), reducers) if reducers else Threads(engine, plane)
    try:  # `syncserver serve` checked it already (one line, exit 2); plain uvicorn lands here
        objects = await to_thread.run_sync(
            open_store, settings.store, settings.store_url_seconds, settings.store_control_seconds
        )
    except StoreUnavailable as exc:
        log.error("SYNC_STORE: %s", exc.reason)
        raise RuntimeError(f"SYNC_STORE: {exc.reason}") from None
    bucket = BucketPlane(store, settings.keep_versions, objects)
    engine = MergeEngine(store, settings.fold_threads, objects)
    if not reducers:
        return bucket, Threads(engine, bucket)
    return bucket, BucketReducers(engine, bucket, Board(seconds, lambda: objects), reducers)


def create_app(settings: HubSettings | None = None) -> FastAPI:
    """Build a hub. Its state lives in ``settings.data_dir`` and is recovered on start."""
    settings = settings or HubSettings()
    _configure_logging()
    metrics = HubMetrics(settings.metrics_runs)  # one registry per app: tests build many apps in one process

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # before the server listens, however it was started (what one client can hold: docs/SECURITY.md)
        connections = guard_uvicorn(settings.header_timeout, settings.idle_timeout)
        store = Store(settings.data_dir, spares=settings.spare_files)
        coordinator = Coordinator(settings, store, *await choose_modes(settings, store))
        await coordinator.start()
        _redact_logs()
        metrics.attach(coordinator.view)
        app.state.coordinator = coordinator
        log.info(
            "hub ready: data in %s%s, %s; connections: %s",
            store.describe(),
            f", updates, results and versions through {coordinator.plane.url}" if coordinator.plane.url else "",
            "token required" if settings.auth_required else "open (no token)",
            connections,
        )
        undo = end_polls_on_exit(coordinator.end_polls)
        try:
            yield
        finally:
            undo()
            await coordinator.stop()
            store.close()
            coordinator.plane.close()

    app = FastAPI(
        title="weightsync hub",
        version=__version__,
        summary="Averages the weights of training peers far apart on the internet.",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
        docs_url=None,  # add_docs serves /docs from the package, not a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics

    @app.exception_handler(HubError)
    async def hub_error(request: Request, exc: HubError) -> JSONResponse:
        metrics.rejected_upload(request, exc.code)
        headers = {"Retry-After": str(exc.extra["retry_after"])} if "retry_after" in exc.extra else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(OSError)
    @app.exception_handler(sqlite3.OperationalError)
    async def storage_failure(request: Request, exc: OSError | sqlite3.Error) -> JSONResponse:
        # A storage failure the route did not translate itself (sqlite's "database or disk is
        # full" on a join, say): a 503 with the reason, never a bare 500. sqlite rolled back.
        log.error("storage error on %s %s: %s", request.method, request.url.path, exc)
        return await hub_error(request, storage_error(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected_upload(request, "invalid_request")
        errors = [
            {"where": ".".join(str(p) for p in e.get("loc", ())), "problem": e.get("msg", "")} for e in exc.errors()
        ]
        detail = "; ".join(f"{e['where']}: {e['problem']}" for e in errors)
        return JSONResponse({"error": "invalid_request", "detail": detail, "errors": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (no such route, wrong method) in the same shape as ours, so
        # that a client can read any error, e.g. a run name with a "/" in it that matched nothing
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            {"error": code, "detail": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers
        )

    @app.get("/healthz", summary="Liveness probe (no auth)")
    def healthz() -> Health:
        return Health(status="ok", version=__version__)

    app.include_router(view_router)
    app.include_router(router)
    app.include_router(reduce_view_router)
    app.include_router(reduce_router)
    app.include_router(metrics_router)
    add_dashboard(app)
    add_docs(app)
    return app
