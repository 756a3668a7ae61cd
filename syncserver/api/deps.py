"""What the routes depend on: the coordinator, who may call, and the parameters they share, as
``Annotated`` aliases (as full-stack-fastapi-template's ``api/deps.py``). Authentication lives here
and only here; which token opens what: docs/SECURITY.md. A run's token opens its run alone, and the
same 401 answers a wrong token and a token of another run.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Header, Path, Query, Request
from pydantic import SecretStr

from syncserver.core.coordinator import Coordinator
from syncserver.errors import Unauthorized
from syncserver.limits import MAX_ROUND
from syncserver.names import NAME_PATTERN, NAME_RULE

__all__ = [
    "Caller",
    "Hub",
    "PeerName",
    "Round",
    "RunName",
    "RunQuery",
    "Viewer",
    "Wait",
    "authenticate",
    "authenticate_admin",
    "authenticate_view",
]

RunName = Annotated[str, Path(pattern=NAME_PATTERN, description=f"Run name: {NAME_RULE}.")]
PeerName = Annotated[str, Path(pattern=NAME_PATTERN, description="Peer name, unique within a run.")]
#: Bounded before use: a round past sqlite's 64 bits was a 500.
Round = Annotated[int, Path(ge=0, le=MAX_ROUND, description="Round number: the version the round starts from.")]
Wait = Annotated[float, Query(ge=0, le=600, description="Seconds to hold the request open (long poll).")]
#: ``GET /v1/dashboard?run=``: the run to detail, and the scope of a run token.
RunQuery = Annotated[str | None, Query(pattern=NAME_PATTERN, description="The run to detail.")]
Authorization = Annotated[str | None, Header()]


def _coordinator(request: Request) -> Coordinator:
    coordinator: Coordinator = request.app.state.coordinator
    return coordinator


Hub = Annotated[Coordinator, Depends(_coordinator)]


def _bearer_is(authorization: str | None, secret: SecretStr | None) -> bool:
    """Constant-time comparison of a ``Bearer`` header with a secret."""
    scheme, _, given = (authorization or "").partition(" ")
    return (
        secret is not None
        and scheme.lower() == "bearer"
        and secrets.compare_digest(given.encode(), secret.get_secret_value().encode())
    )


def _granted(request: Request, authorization: str | None, *, view: bool, run: str | None) -> bool:
    """Does the request's bearer token open an endpoint (read-only if ``view``) of ``run``?"""
    settings = request.app.state.settings
    if not settings.auth_required:
        return True
    if _bearer_is(authorization, settings.token) or _bearer_is(authorization, settings.admin_token):
        return True
    if view and _bearer_is(authorization, settings.view_token):
        return True
    return run is not None and _bearer_is(authorization, settings.run_tokens.get(run))


def authenticate(request: Request, authorization: Authorization = None) -> None:
    """Every endpoint that changes state or serves weights."""
    if not _granted(request, authorization, view=False, run=request.path_params.get("run")):
        raise Unauthorized("missing or wrong bearer token")


def authenticate_view(request: Request, authorization: Authorization = None) -> None:
    """Read-only endpoints: run status, run list, metrics."""
    if not _granted(request, authorization, view=True, run=request.path_params.get("run")):
        raise Unauthorized("missing or wrong bearer token")


def _dashboard_viewer(request: Request, run: RunQuery = None, authorization: Authorization = None) -> str | None:
    """The dashboard names its run in the query, not the path: None to see every run (view,
    hub or admin token, or an open hub), else the one run whose own token was given."""
    if _granted(request, authorization, view=True, run=None):
        return None
    if _granted(request, authorization, view=True, run=run):
        return run
    raise Unauthorized("missing or wrong bearer token")


def _caller(request: Request, authorization: Authorization = None) -> str:
    """Which kind of credential made an authenticated request: ``open`` (no token set),
    ``admin``, ``token`` (the hub's) or ``run`` (a run's own). Never the token itself: this
    is kept with each run it creates, for its quota (:mod:`syncserver.core.quotas`)."""
    settings = request.app.state.settings
    if not settings.auth_required:
        return "open"
    if _bearer_is(authorization, settings.admin_token):
        return "admin"
    if _bearer_is(authorization, settings.token):
        return "token"
    return "run"  # authenticate() let it in, so it holds the run's token


#: Who calls (the kind of its token), for the quotas.
Caller = Annotated[str, Depends(_caller)]

#: Whom the dashboard shows: None for every run, else the name of the one run it may show.
Viewer = Annotated[str | None, Depends(_dashboard_viewer)]


def authenticate_admin(request: Request, authorization: Authorization = None) -> None:
    """Reducers' endpoints: the admin token if the hub has one, else the hub token (an open
    hub lets everyone in). A run token or the view token never opens them: a lease names
    files of every run."""
    settings = request.app.state.settings
    if not settings.auth_required:
        return
    secret = settings.admin_token if settings.admin_token is not None else settings.token
    if not _bearer_is(authorization, secret):
        raise Unauthorized("missing or wrong bearer token (reducers need the admin token, or the hub's)")
