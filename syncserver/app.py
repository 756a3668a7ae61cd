"""The hub's ASGI entry point: ``app`` for uvicorn (the factory is :func:`syncserver.create_app`).

uvicorn syncserver.app:app --host 0.0.0.0 --port 8000      # settings from SYNC_* env vars
"""

from __future__ import annotations

from fastapi import FastAPI

from syncserver.api.factory import create_app
from syncserver.arenas import limit_arenas


def __getattr__(name: str) -> FastAPI:
    # `uvicorn syncserver.app:app` builds the hub from SYNC_* variables only when asked for,
    # so importing this module (tests, create_app users) never reads the environment.
    if name == "app":
        limit_arenas()  # a hub's own process (not create_app: an embedding process keeps its allocator)
        return create_app()
    raise AttributeError(name)
