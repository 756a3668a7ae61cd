"""HTTP only: parse, authenticate, call the coordinator, shape the answer.

Every error is raised as a :class:`~syncserver.errors.HubError` and turned into JSON by the
one handler in :func:`syncserver.api.factory.create_app`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field, create_model
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from syncserver.api import answers
from syncserver.api.deps import Caller, Hub, PeerName, Round, RunName, Wait, authenticate, authenticate_view
from syncserver.api.responses import BlobResponse, requested_range
from syncserver.api.schemas import (
    Heartbeat,
    Left,
    Progress,
    RunStatus,
    RunSummary,
    StartState,
    UpdateAck,
    UploadHeld,
    UploadPlan,
    VersionZero,
)
from syncserver.core.coordinator import Coordinator
from syncserver.core.planes import Redirect
from syncserver.core.presigned import UploadReport
from syncserver.core.rounds import Ticket
from syncserver.core.state import Via
from syncserver.errors import BadRequest, HubError, Incomplete, Superseded
from syncserver.limits import MAX_BYTES, MAX_ROUND, MAX_SAMPLES, header_int
from syncserver.names import NAME_PATTERN
from syncserver.settings import run_type
from syncserver.storage.store import Blob
from syncserver.storage.uploads import BodyInterrupted, Held, Received, partial_offset, receive
from syncwire.runsettings import RUN_SETTINGS

#: ``?peer=``: who downloads (for the dashboard's download log); absent for other clients.
Downloader = Annotated[str | None, Query(pattern=NAME_PATTERN)]

#: safetensors bytes: the two uploads (read as a stream, so FastAPI cannot infer them for the
#: schema) and the two downloads (files, which FastAPI leaves undescribed).
SAFETENSORS = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
SAFETENSORS_BODY = {"requestBody": {"required": True, "content": SAFETENSORS}}
router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])
view_router = APIRouter(prefix="/v1", dependencies=[Depends(authenticate_view)])


class _Peer(BaseModel):
    peer: str = Field(pattern=NAME_PATTERN)


# the run settings, from their table (syncwire.runsettings): each optional, with the table's bounds
_JOIN_FIELDS: dict[str, Any] = {s.name: (run_type(s) | None, None) for s in RUN_SETTINGS}
_JoinSettings = create_model("_JoinSettings", __base__=_Peer, **_JOIN_FIELDS)


class JoinRequest(_JoinSettings):  # a base made from the table
    """Join a run. The first peer of a new run may set its config; later peers that set a
    field must agree with the run's value (409 otherwise). Unset fields accept the run's."""

    group_size: int = Field(1, ge=1, le=65_536, description="Ranks of the torch.distributed group this peer is.")


def parse_digest(value: str) -> str:
    """``Content-Digest: sha-256=:<base64>:`` (RFC 9530) -> hex."""
    for item in value.split(","):
        algo, _, encoded = item.strip().partition("=")
        if algo.strip().lower() == "sha-256" and encoded.startswith(":") and encoded.endswith(":"):
            try:
                raw = base64.b64decode(encoded[1:-1], validate=True)
            except binascii.Error:
                break
            if len(raw) == 32:
                return raw.hex()
    raise BadRequest("Content-Digest must be 'sha-256=:<base64 of the 32-byte digest>:'")


def parse_flag(value: str | None, header: str, default: bool = False) -> bool:
    """An RFC 8941 boolean header (``?1`` or ``?0``): ``X-Sync-Final``, ``Upload-Complete``."""
    if value is None:
        return default
    if value in ("?0", "?1"):
        return value == "?1"
    raise BadRequest(f"{header} must be ?1 or ?0, got {value[:40]!r}")


#: ``Upload-Key``: names a body whose digest comes later (a peer encoding while it uploads).
UPLOAD_KEY_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"


def update_digest(digest: str | None, key: str | None, *, complete: bool) -> str | None:
    """The hex digest of an update's headers, which name its body by ``Content-Digest`` or, for a body
    whose digest comes later, ``Upload-Key``; one that ends the upload (``complete``) needs the digest."""
    if complete and digest is None:
        raise BadRequest(
            "Content-Digest is required to complete an upload; a body whose digest comes later "
            "is sent with Upload-Key and Upload-Complete: ?0, then completed from its end"
        )
    if digest is None and key is None:
        raise BadRequest("an update needs its Content-Digest or an Upload-Key to name it")
    return None if digest is None else parse_digest(digest)


def parse_metrics(value: str | None) -> dict[str, float]:
    if not value:
        return {}
    if len(value) > 4096:
        raise BadRequest("X-Sync-Metrics is over 4096 bytes")
    try:  # integers as floats: one of 400 digits is then Inf, refused below (math.isfinite of the int overflows)
        metrics = json.loads(value, parse_int=float)
    except (ValueError, RecursionError):  # RecursionError: "[[[[...": 4096 bytes nest deep enough
        raise BadRequest("X-Sync-Metrics must be a JSON object of numbers") from None
    if not isinstance(metrics, dict) or not all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()):
        raise BadRequest("X-Sync-Metrics must be a JSON object of finite numbers")
    return metrics


DRAIN_IDLE_SECONDS = 2.0


async def _drain(request: Request, limit: int) -> None:
    """Read and drop the rest of a refused body so the client sees our answer, not a reset. Bounded
    both ways: a body declared over ``limit`` is not read, and one that stops for
    ``DRAIN_IDLE_SECONDS`` (a Content-Length that promised more) is answered then."""
    length = request.headers.get("content-length")
    declared = header_int(length)
    if length is not None and (declared is None or declared > limit):
        return
    chunks = request.stream().__aiter__()
    try:
        while True:
            await asyncio.wait_for(chunks.__anext__(), DRAIN_IDLE_SECONDS)
    except (StopAsyncIteration, asyncio.TimeoutError, ClientDisconnect, RuntimeError):
        pass


async def _receive(
    request: Request, hub: Coordinator, ticket: Ticket, offset: int = 0, *, complete: bool = True
) -> Received | Held:
    """Stream the body into the ticket's upload (a resumable one from ``offset``; held whole,
    not acknowledged, unless ``complete``)."""
    assert ticket.upload is not None
    try:
        return await receive(
            request.stream(),
            ticket.upload,
            max_bytes=ticket.max_bytes,
            content_length=header_int(request.headers.get("content-length")),
            check_header=ticket.check_header,
            offset=offset,
            idle_seconds=hub.settings.lease_seconds,
            complete=complete,
        )
    except HubError:
        await _drain(request, ticket.max_bytes)
        raise
    except (ClientDisconnect, BodyInterrupted) as exc:  # no draining: the body is not coming
        if isinstance(exc, BodyInterrupted) and exc.superseded:
            raise Superseded(str(exc)) from None
        raise Incomplete(f"the body did not arrive whole: {exc}") from None


@view_router.get("/runs", summary="List runs by name, a page at a time (the next page: Link rel=next)")
async def list_runs(
    hub: Hub,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=1000, description="Runs per page.")] = 100,
    after: Annotated[str | None, Query(pattern=NAME_PATTERN, description="The last run of the page before.")] = None,
) -> list[RunSummary]:
    page = hub.view.list_runs(limit=limit + 1, after=after)
    if len(page) > limit:  # there is more: say where (RFC 8288), the body stays a plain list
        page = page[:limit]
        response.headers["Link"] = f'</v1/runs?limit={limit}&after={page[-1].run}>; rel="next"'
    return answers.run_lines(page)


@view_router.get("/runs/{run}", summary="A run's state: config, version, peers, open round, recent rounds")
async def run_status(run: RunName, hub: Hub) -> RunStatus:
    return RunStatus(**hub.view.state(hub.view.get(run)), updates=hub.view.latest_updates(run))


@router.post(
    "/runs/{run}/peers",
    summary="Join a run (creating it if new); says what the peer must do next",
    response_model=StartState,
)
async def join(run: RunName, body: JoinRequest, hub: Hub, caller: Caller) -> StartState | Response:
    requested = body.model_dump(exclude={"peer", "group_size"})
    return answers.start(hub.join(run, body.peer, requested, group_size=body.group_size, creator=caller))


@router.get(
    "/runs/{run}/peers/{peer}/start",
    summary="Long poll until the peer may start: state is waiting, initialise or ready",
    response_model=StartState,
)
async def wait_start(run: RunName, peer: PeerName, hub: Hub, wait: Wait = 20.0) -> StartState | Response:
    return answers.start(await hub.wait_start(run, peer, wait))


@router.put(
    "/runs/{run}/versions/0",
    summary="Upload version 0 (only the peer told to initialise)",
    openapi_extra=SAFETENSORS_BODY,
)
async def put_initial(
    run: RunName, request: Request, hub: Hub, peer: Annotated[str, Query(pattern=NAME_PATTERN)]
) -> VersionZero:
    ticket = hub.rounds.init_ticket(hub.seen(run, peer), peer)
    received = await _receive(request, hub, ticket)
    assert isinstance(received, Received)  # version 0 is not held
    stored = await hub.commit_init(ticket, received)
    return VersionZero(version=0, tensors=stored.tensors, bytes=stored.nbytes)


@router.post(
    "/runs/{run}/peers/{peer}/heartbeat",
    summary="Renew the peer's lease; with wait, the peer's watch: held until news, or wait seconds",
)
async def heartbeat(request: Request, run: RunName, peer: PeerName, hub: Hub, wait: Wait = 0.0) -> Heartbeat:
    """``wait`` > 0 makes this request the peer's watch: the hub holds it (at most a third of
    the lease) and sees at once when its connection drops, as it does when the peer's process
    dies; the peer asks again as soon as it is answered (the SDK's heartbeat does)."""
    version = await hub.heartbeat(run, peer, wait, _disconnected(request) if wait > 0 else None)
    return Heartbeat(version=version, lease_seconds=hub.settings.lease_seconds, watch=wait > 0)


async def _disconnected(request: Request) -> None:
    """Until the client closes the connection: once the body is read, uvicorn answers ``receive()``
    with ``http.disconnect`` when the socket closes (an EOF, a reset), and not before."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ProgressReport(BaseModel):
    """Samples trained since the update to ``round`` began (a peer's running count, not a delta)."""

    round: int = Field(ge=0, le=MAX_ROUND, description="The version this peer trains from.")
    samples: int = Field(ge=0, le=MAX_SAMPLES, strict=True, description="Samples since its last update.")


@router.post(
    "/runs/{run}/peers/{peer}/progress",
    summary="Report training progress (renews the lease); in samples runs, long poll until the round is due",
)
async def progress(run: RunName, peer: PeerName, body: ProgressReport, hub: Hub, wait: Wait = 0.0) -> Progress:
    return Progress.model_validate(await hub.progress(run, peer, body.round, body.samples, wait))


@router.post("/runs/{run}/peers/{peer}/leave", summary="Leave the run: no longer waited for")
async def leave(run: RunName, peer: PeerName, hub: Hub) -> Left:
    hub.leave(run, peer)
    return Left(left=True)


#: ``Upload-Key``, ``Upload-Complete``: a body sent before its digest is known (the SDK encodes
#: while it uploads), then completed by a request from its end that brings the digest.
UploadKey = Annotated[
    str | None,
    Header(
        alias="Upload-Key",
        pattern=UPLOAD_KEY_PATTERN,
        description="Names the body instead of its digest (16-64 of A-Z a-z 0-9 _ -), for a body sent before "
        "its digest is known.",
    ),
]
UploadComplete = Annotated[
    str | None,
    Header(
        alias="Upload-Complete",
        description="?0: hold the whole body, unacknowledged, for a PUT from its end that brings "
        "Content-Digest (202). Default ?1.",
    ),
]


@router.put(
    "/runs/{run}/rounds/{round}/updates/{peer}",
    summary="Submit the peer's update for a round (safetensors, encoded with the run's codec)",
    openapi_extra=SAFETENSORS_BODY,
    response_model=UpdateAck,
    responses={202: {"model": UploadHeld, "description": "Upload-Complete: ?0: the whole body is held."}},
)
async def put_update(
    run: RunName,
    round: Round,
    peer: PeerName,
    request: Request,
    hub: Hub,
    samples: Annotated[int, Header(alias="X-Sync-Samples", description="Samples since the last sync.")],
    digest: Annotated[str | None, Header(alias="Content-Digest", description="sha-256=:<base64>: of the body.")] = None,
    key: UploadKey = None,
    complete: UploadComplete = None,
    metrics: Annotated[str | None, Header(alias="X-Sync-Metrics", description="JSON object of numbers.")] = None,
    final: Annotated[
        str | None,
        Header(
            alias="X-Sync-Final",
            description="?1: the peer's last update; a round of last updates is plain averaging.",
        ),
    ] = None,
    offset: Annotated[
        int, Header(alias="Upload-Offset", ge=0, le=MAX_BYTES, description="Resume: the body starts at this byte.")
    ] = 0,
) -> UpdateAck | Response:
    try:
        whole = parse_flag(complete, "Upload-Complete", default=True)
        hex_digest = update_digest(digest, key, complete=whole)
        numbers, last, the_run = parse_metrics(metrics), parse_flag(final, "X-Sync-Final"), hub.seen(run, peer)
        ticket = await hub.rounds.update_ticket(
            the_run, round, peer, hex_digest, samples, numbers, key=key, supersede=True, final=last
        )
    except HubError:
        await _drain(request, hub.settings.max_body_bytes)
        raise
    if ticket.acknowledged is not None:  # the same update again: answer as the first time
        await _drain(request, hub.settings.max_body_bytes)
        return answers.update_ack(ticket.acknowledged)
    with hub.rounds.uploading(the_run, peer):
        try:
            received = await _receive(request, hub, ticket, offset, complete=whole)
        except (Incomplete, Superseded):
            # the round may have closed while the body streamed: then say so (409 round_closed,
            # or the ack of this very update, which a newer attempt may have brought), so that
            # the peer catches up
            again = await hub.rounds.update_ticket(
                hub.seen(run, peer), round, peer, hex_digest, samples, numbers, key=key, final=last
            )
            if again.acknowledged is not None:
                return answers.update_ack(again.acknowledged)
            raise
        if isinstance(received, Held):
            held = UploadHeld(held=received.nbytes)
            return Response(held.model_dump_json(), status_code=202, media_type="application/json")
        return answers.update_ack(await hub.rounds.commit_update(the_run, ticket, received))


@router.head(
    "/runs/{run}/rounds/{round}/updates/{peer}",
    summary="Resume point of an update: Upload-Offset = bytes the hub holds (send the PUT's headers)",
    status_code=204,
)
async def update_offset(
    run: RunName,
    round: Round,
    peer: PeerName,
    hub: Hub,
    samples: Annotated[int, Header(alias="X-Sync-Samples")],
    digest: Annotated[str | None, Header(alias="Content-Digest")] = None,
    key: UploadKey = None,
    metrics: Annotated[str | None, Header(alias="X-Sync-Metrics")] = None,
) -> Response:
    """What a PUT with these headers would start from: ``Upload-Offset`` bytes are held (the
    rest is to send with ``Upload-Offset`` set); ``Upload-Complete: ?1`` when the update is
    already acknowledged (a PUT from that offset, with an empty body, gets its ack again).
    Asking supersedes an attempt still streaming on the hub: the client has given up on it."""
    hex_digest, numbers = update_digest(digest, key, complete=False), parse_metrics(metrics)
    ticket = await hub.rounds.update_ticket(hub.seen(run, peer), round, peer, hex_digest, samples, numbers, key=key)
    if ticket.acknowledged is not None:
        held, complete = ticket.acknowledged.nbytes, "?1"
    else:
        assert ticket.upload is not None
        held, complete = await partial_offset(ticket.upload), "?0"
    return Response(status_code=204, headers={"Upload-Offset": str(held), "Upload-Complete": complete})


class PresignRequest(BaseModel):
    """An update about to go to the object store (the hub says ``uploads: store`` when a peer
    starts): its size, and the key that names this upload (the PUT's ``Upload-Key`` rule)."""

    key: str = Field(pattern=UPLOAD_KEY_PATTERN, description="Names this upload; asking again with it resumes.")
    size: int = Field(ge=8, le=MAX_BYTES, strict=True, description="The body's bytes.")


@router.post(
    "/runs/{run}/rounds/{round}/updates/{peer}/presign",
    summary="Presigned part URLs to upload the peer's update straight to the object store (hubs with SYNC_STORE)",
)
async def presign_update(run: RunName, round: Round, peer: PeerName, body: PresignRequest, hub: Hub) -> UploadPlan:
    plan = await hub.presigned.presign(hub.seen(run, peer), round, peer, body.key, body.size)
    return UploadPlan.model_validate(plan)


#: sha-256 in hex, as the object store's update is named by nothing else once uploaded
DIGEST_PATTERN = r"^[0-9a-f]{64}$"


class UploadedReport(BaseModel):
    """An update is in the object store: what the peer says it uploaded (all of it is checked)
    and what a PUT carries in its headers (``X-Sync-Samples``, ``-Metrics``, ``-Final``)."""

    key: str = Field(pattern=UPLOAD_KEY_PATTERN)
    size: int = Field(ge=8, le=MAX_BYTES, strict=True)
    digest: str = Field(pattern=DIGEST_PATTERN, description="sha-256 of the body, hex.")
    etags: dict[int, Annotated[str, Field(max_length=130)]] = Field(
        max_length=10_000, description="Part number -> the ETag the store answered its PUT with."
    )
    samples: int = Field(ge=1, le=MAX_SAMPLES, strict=True, description="Samples since the last sync.")
    metrics: dict[str, Any] = Field(default_factory=dict, description="JSON object of numbers.")
    final: bool = Field(False, description="The peer's last update; a round of last updates is plain averaging.")


@router.post(
    "/runs/{run}/rounds/{round}/updates/{peer}/uploaded",
    summary="The peer's update is in the object store: the hub checks it and acknowledges it as a PUT",
)
async def update_uploaded(run: RunName, round: Round, peer: PeerName, body: UploadedReport, hub: Hub) -> UpdateAck:
    metrics = parse_metrics(json.dumps(body.metrics))
    report = UploadReport(body.key, body.size, body.digest, body.etags, body.samples, metrics, body.final)
    return answers.update_ack(await hub.presigned.uploaded(hub.seen(run, peer), round, peer, report))


#: ``?direct=1``: the peer was redirected to the object store and could not fetch from there.
Direct = Annotated[
    bool,
    Query(description="Serve from the hub's disk: the object store it redirected to failed for this peer."),
]
#: 307: what a download answers when its object is in the object store (SYNC_STORE).
REDIRECT: dict[int | str, dict[str, Any]] = {
    307: {
        "description": "The object is in the hub's object store: `Location` is a presigned GET of it (short-lived; "
        "ask the hub again when it has expired), with this answer's `ETag` and `X-Sync-*` headers."
    }
}


def _answer(
    request: Request,
    hub: Coordinator,
    run: str,
    peer: str | None,
    found: Blob | Redirect,
    headers: dict[str, str],
    background: BackgroundTask | None = None,
) -> Response:
    """A download: the hub's copy (ranges), or a 307 to the object store's. Counted either way."""
    try:
        start, end = requested_range(request.headers, found.size, None) or (0, found.size)
    except ValueError:  # 416: nothing is served
        start = end = 0
    via: Via = "store" if isinstance(found, Redirect) else "hub"
    hub.count_download(run, peer, end - start, via)
    request.app.state.metrics.served(run, via, end - start)
    if isinstance(found, Redirect):
        return Response(status_code=307, headers={**headers, "Location": found.url, "Cache-Control": "no-store"})
    return BlobResponse(found, headers=headers, background=background)


@router.get(
    "/runs/{run}/rounds/{round}/result",
    summary="Long poll for a round's merged update (204 while open; supports Range; 307 to the object store)",
    response_class=FileResponse,
    responses={
        200: {"description": "The round's merged update, in the run's codec.", "content": SAFETENSORS},
        204: {"description": "Still open after `wait` seconds: ask again."},
        **REDIRECT,
    },
)
async def get_result(
    run: RunName,
    round: Round,
    hub: Hub,
    request: Request,
    wait: Wait = 20.0,
    peer: Downloader = None,
    direct: Direct = False,
) -> Response:
    found = await hub.wait_result(run, round, peer, wait, direct=direct)
    if found is None:
        return Response(status_code=204)
    headers = {
        "ETag": f'"{run}-r{round}"',
        "X-Sync-Version": str(round + 1),
        "X-Sync-Run-Samples": str(hub.view.samples_through(run, round)),
        **_next_every(hub.run(run).pacer.after(round)),
    }
    # runs once the whole body is sent: the end of the peer's download phase (from the store,
    # the peer reports it: POST .../downloaded)
    background = BackgroundTask(_downloaded, hub, run, round, peer, time.time())
    return _answer(request, hub, run, peer, found, headers, background)


@router.get(
    "/runs/{run}/model",
    summary="The latest model version as float32 safetensors (ETag, Range; 307 to the object store)",
    response_class=FileResponse,
    responses={200: {"description": "Version `X-Sync-Version` of the model.", "content": SAFETENSORS}, **REDIRECT},
)
async def get_model(
    run: RunName, hub: Hub, request: Request, peer: Downloader = None, direct: Direct = False
) -> Response:
    version, found = await hub.model(run, direct=direct, peer_name=peer)
    headers = {
        "ETag": f'"{run}-v{version}"',
        "X-Sync-Version": str(version),
        "X-Sync-Run-Samples": str(hub.view.samples_through(run, version - 1)),
        **_next_every(hub.run(run).pacer.after(version - 1)),
    }
    return _answer(request, hub, run, peer, found, headers)


def _next_every(every: int | None) -> dict[str, str]:
    """``X-Sync-Next-Every``: in a run that picks its interval, the steps from the sync that made
    this version to the next (syncserver/core/interval.py); none in a run whose peers pick it."""
    return {} if every is None else {"X-Sync-Next-Every": str(every)}


class DownloadReport(BaseModel):
    """A result fetched from the object store: the hub sees no end of that download, so the peer says it."""

    round: int = Field(ge=0, le=MAX_ROUND, description="The round whose result the peer fetched.")
    seconds: float = Field(ge=0, le=86_400, allow_inf_nan=False, description="From the hub's 307 to the last byte.")


@router.post(
    "/runs/{run}/peers/{peer}/downloaded",
    summary="Report a result downloaded from the object store (the end of the peer's download phase)",
    status_code=204,
)
async def downloaded(run: RunName, peer: PeerName, body: DownloadReport, hub: Hub) -> Response:
    hub.downloaded(run, peer, body.round, body.seconds)
    return Response(status_code=204)


async def _downloaded(hub: Coordinator, run: str, round_: int, peer: str | None, began: float) -> None:
    # async so that Starlette runs it on the event loop (a sync task would go to a worker
    # thread, and the coordinator's state is touched from the event loop only)
    hub.record_download(run, round_, peer, began)
