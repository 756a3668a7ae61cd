"""``syncserver``: run a hub, or look at one.

syncserver serve --host 0.0.0.0 --port 8000 --data-dir /srv/weightsync --token "$TOKEN"
syncserver status http://hub:8000 --run imdb-gpt2 [--watch]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="The weightsync hub.")


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind (0.0.0.0 for the internet).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    data_dir: Annotated[Optional[Path], typer.Option(help="SYNC_DATA_DIR: where state lives.")] = None,  # noqa: UP045
    token: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="SYNC_TOKEN: bearer token (prefer the env var)."),
    ] = None,
    view_token: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="SYNC_VIEW_TOKEN: read-only token for the dashboard, status and /metrics."),
    ] = None,
    min_peers: Annotated[Optional[int], typer.Option(help="SYNC_MIN_PEERS.")] = None,  # noqa: UP045
    round_timeout: Annotated[Optional[float], typer.Option(help="SYNC_ROUND_TIMEOUT, seconds.")] = None,  # noqa: UP045
    lease_seconds: Annotated[Optional[float], typer.Option(help="SYNC_LEASE_SECONDS.")] = None,  # noqa: UP045
    max_body_bytes: Annotated[Optional[int], typer.Option(help="SYNC_MAX_BODY_BYTES.")] = None,  # noqa: UP045
    codec: Annotated[Optional[str], typer.Option(help="SYNC_CODEC: default codec of new runs.")] = None,  # noqa: UP045
    outer: Annotated[Optional[str], typer.Option(help="SYNC_OUTER: avg or diloco.")] = None,  # noqa: UP045
    ssl_certfile: Annotated[Optional[str], typer.Option(help="Serve HTTPS with this certificate.")] = None,  # noqa: UP045
    ssl_keyfile: Annotated[Optional[str], typer.Option(help="The certificate's private key.")] = None,  # noqa: UP045
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    ready_file: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Once listening, write the hub's URL here (with --port 0: the port the OS chose)."),
    ] = None,
) -> None:
    """Run a hub. Flags override the matching SYNC_* environment variables."""
    import uvicorn
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from syncserver.app import create_app
    from syncserver.settings import HubSettings

    given: dict[str, Any] = {  # Any: each value goes to the field of its name, pydantic checks it
        "data_dir": data_dir,
        "token": token,
        "view_token": view_token,
        "min_peers": min_peers,
        "round_timeout": round_timeout,
        "lease_seconds": lease_seconds,
        "max_body_bytes": max_body_bytes,
        "codec": codec,
        "outer": outer,
    }
    try:
        settings = HubSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise typer.BadParameter(problems) from None
    except SettingsError as exc:  # an env value that does not parse at all, e.g. SYNC_RUN_TOKENS
        raise typer.BadParameter(f"{exc} (SYNC_RUN_TOKENS must be a JSON object)") from None
    scheme = "https" if ssl_certfile else "http"
    hint = " (open it with ?token=<view or hub token>, or paste the token when asked)" if settings.auth_required else ""
    config = uvicorn.Config(
        create_app(settings),
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )
    _Server(config, scheme, ready_file, hint).run()


class _Server:
    """uvicorn's server, saying where it listens once it does: with ``--port 0`` the OS picks a
    free port, and a launcher or a test reads it back instead of guessing one that may be taken."""

    def __init__(self, config: Any, scheme: str, ready_file: Path | None, hint: str) -> None:
        import uvicorn

        self.scheme, self.ready_file, self.hint = scheme, ready_file, hint
        self.server = uvicorn.Server(config)

    def run(self) -> None:
        import asyncio

        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import asyncio

        task = asyncio.create_task(self.server.serve())
        while not self.server.started and not task.done():
            await asyncio.sleep(0.01)
        if self.server.started:
            host, port = self.server.servers[0].sockets[0].getsockname()[:2]
            shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # what a browser here can open
            typer.echo(f"dashboard: {self.scheme}://{shown}:{port}/{self.hint}", err=True)
        if self.server.started and self.ready_file is not None:
            tmp = self.ready_file.with_name(self.ready_file.name + ".tmp")
            tmp.write_text(f"{self.scheme}://{host}:{port}\n")
            tmp.replace(self.ready_file)  # readers never see half a URL
        await task


@app.command()
def status(
    url: Annotated[str, typer.Argument(help="The hub, e.g. http://hub:8000")],
    run: Annotated[Optional[str], typer.Option(help="Show one run in detail.")] = None,  # noqa: UP045
    token: Annotated[Optional[str], typer.Option(envvar="SYNC_TOKEN", help="Bearer token.")] = None,  # noqa: UP045
    watch: Annotated[bool, typer.Option(help="Refresh every 2 seconds.")] = False,
) -> None:
    """Print runs (or one run) as tables."""
    from syncserver.status import StatusError, show

    try:
        show(url, run=run, token=token or os.environ.get("SYNC_TOKEN"), watch=watch)
    except StatusError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
