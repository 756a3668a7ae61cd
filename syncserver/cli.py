"""``syncserver``: run a hub, or look at one.

syncserver serve --host 0.0.0.0 --port 8000 --data-dir /srv/weightsync --min-peers 3
syncserver status http://hub:8000 --run imdb-gpt2 [--watch | --json]
syncserver reduce --hub http://hub:8000 [--token T]     (a reducer; serve --reducers K starts K)

Every field of :class:`~syncserver.settings.HubSettings` is a ``SYNC_*`` variable and, made from
the same field, a flag of ``serve`` (``keep_versions`` -> ``--keep-versions``): a flag beats its
variable, a variable the default, and pydantic checks every value wherever it came from.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, get_args, get_origin

import typer
from pydantic import SecretStr
from pydantic.fields import FieldInfo

from syncserver.process import run_uvicorn
from syncserver.settings import HubSettings, SettingsInputError, env_name, flag_name, hub_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="The weightsync hub.")

SETTINGS_PANEL = "Hub settings (each also a SYNC_* environment variable; the flag wins)"


def _metavar(field: FieldInfo) -> str:
    kind = field.annotation
    if get_origin(kind) is Literal:
        return "|".join(get_args(kind))
    if get_origin(kind) is dict:
        return "JSON"
    types = set(get_args(kind)) or {kind}
    if SecretStr in types:
        return "TOKEN"
    names = {int: "INTEGER", float: "FLOAT", Path: "PATH"}
    return next((names[t] for t in names if t in types), "TEXT")


def _help(name: str, field: FieldInfo) -> str:
    """The field's description, its variable and its default (none shown for a secret or an
    unset value). The default goes in the text, not click's ``show_default``: the option's own
    default is None, so that "not given" falls through to the variable."""
    default = field.get_default(call_default_factory=True)
    shown = "" if default is None or default == {} or _metavar(field) == "TOKEN" else f", default: {default}"
    return f"{field.description} [{env_name(name)}{shown}]"  # [UPPER...]: not rich markup


def with_settings_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` one flag per settings field; it receives those given, as raw strings by
    field name, in its ``flags`` argument. Typed ``str`` on purpose: pydantic, not click, parses
    and checks the value, so a flag and its variable give the same one-line error."""
    params = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "flags"]
    for name, field in HubSettings.model_fields.items():
        option = typer.Option(
            flag_name(name), help=_help(name, field), metavar=_metavar(field), rich_help_panel=SETTINGS_PANEL
        )
        annotation = Annotated[Optional[str], option]  # noqa: UP045 (typer reads Optional on 3.10)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation))

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        command(flags={k: v for k in HubSettings.model_fields if (v := kwargs.pop(k)) is not None}, **kwargs)

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # what typer reads
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


@app.command()
@with_settings_flags
def serve(
    flags: dict[str, str],
    host: Annotated[str, typer.Option(help="Interface to bind (0.0.0.0 for the internet).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: one the OS picks; see --ready-file).")] = 8000,
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

    from syncserver.api.factory import create_app
    from syncserver.arenas import limit_arenas
    from syncserver.storage.bucket import open_store
    from syncserver.storage.s3 import StoreUnavailable

    limit_arenas()  # before the hub's threads exist: they take arenas as they first allocate
    try:  # a bad setting, or a store that cannot work, is one line before anything listens
        settings = hub_settings(flags)
        if settings.store:
            open_store(settings.store, settings.store_url_seconds, settings.store_control_seconds).close()
    except (SettingsInputError, StoreUnavailable) as exc:
        typer.echo(f"error: --store: {exc.reason}" if isinstance(exc, StoreUnavailable) else f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    hint = " (open it with ?token=<view or hub token>, or paste the token when asked)" if settings.auth_required else ""

    reducers = None
    local = settings.reducers if settings.local_reducers is None else settings.local_reducers
    if local:  # at most settings.reducers
        from syncserver.reduce.children import LocalReducers

        secret = settings.admin_token or settings.token
        # the merge's threads, shared out: K local reducers on the cores the hub's pool would use
        threads = max(1, settings.fold_threads // local)
        reducers = LocalReducers(local, secret.get_secret_value() if secret else None, threads, settings.store)

    def listening(url: str) -> None:
        scheme, _, rest = url.partition("://")
        host, _, port = rest.rpartition(":")
        shown = "127.0.0.1" if host in ("0.0.0.0", "[::]", "::", "") else host  # what a browser here can open
        typer.echo(f"dashboard: {scheme}://{shown}:{port}/{hint}", err=True)
        if reducers is not None:
            reducers.start(f"{scheme}://{shown}:{port}")

    # the app puts the connection deadlines on this server as it starts (syncserver.api.protocol)
    config = uvicorn.Config(
        create_app(settings),
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )
    try:
        run_uvicorn(config, ready_file=ready_file, on_listening=listening)
    finally:
        if reducers is not None:
            reducers.stop()


@app.command()
def reduce(
    hub: Annotated[str, typer.Option(help="The hub whose merges to share, e.g. http://127.0.0.1:8000")],
    token: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(envvar="SYNC_REDUCE_TOKEN", help="The hub's admin token (or its token if it has no admin one)."),
    ] = None,
    threads: Annotated[int, typer.Option(min=1, max=256, help="Threads that work a lease's slices.")] = 1,
) -> None:
    """Work a hub's work leases (checks, folds, merges, builds) until killed: on the hub's machine, or on
    any machine when the hub has a store (SYNC_STORE): then it reads and writes only the bucket."""
    import logging

    from syncserver.reduce.worker import ReducerError, main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per long poll otherwise
    try:
        main(hub, token, threads)
    except ReducerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@app.command()
def status(
    url: Annotated[str, typer.Argument(help="The hub, e.g. http://hub:8000")],
    run: Annotated[Optional[str], typer.Option(help="Show one run in detail.")] = None,  # noqa: UP045
    token: Annotated[Optional[str], typer.Option(envvar="SYNC_TOKEN", help="Bearer token.")] = None,  # noqa: UP045
    watch: Annotated[bool, typer.Option(help="Refresh every 2 seconds.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the data the tables show as JSON (the hub's /v1/dashboard), once.")
    ] = False,
) -> None:
    """Print runs (or one run) as tables."""
    from syncserver.status import StatusError, fetch, show

    if as_json and watch:
        typer.echo("error: --json prints once: leave out --watch", err=True)
        raise typer.Exit(2)
    try:
        if as_json:
            typer.echo(json.dumps(fetch(url, run, token), indent=2))
        else:
            show(url, run=run, token=token, watch=watch)
    except StatusError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def main() -> None:
    app()
