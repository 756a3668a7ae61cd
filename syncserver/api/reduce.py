"""HTTP for reducers (``syncserver reduce``): take a work lease of any kind, renew it, report it
(``/done``; a check: ``/checked``). Translation only: the board (:mod:`syncserver.core.leases`)
decides. Admin token if the hub has one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from syncserver.api import answers
from syncserver.api.deps import Hub, authenticate_admin, authenticate_view
from syncserver.api.schemas import Reducer, Renewed
from syncserver.core.leases import LEASE_POLL_MAX, Board
from syncserver.errors import Conflict
from syncserver.reduce.checklease import CheckReport
from syncserver.reduce.lease import Done, WorkJob

__all__ = ["router", "view_router"]

router = APIRouter(prefix="/v1/reduce", dependencies=[Depends(authenticate_admin)], tags=["reducers"])
view_router = APIRouter(prefix="/v1/reduce", dependencies=[Depends(authenticate_view)], tags=["reducers"])

LeaseId = Annotated[str, Path(pattern="^[0-9a-f]{32}$", description="The lease's id, as the hub gave it.")]
ReducerName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")]


class TakeLease(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reducer: ReducerName = Field(description="The reducer's name (host-pid): /metrics and status show it.")
    wait: float = Field(20.0, ge=0, le=LEASE_POLL_MAX, description="Seconds to wait for a lease (long poll).")


class RenewLease(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reducer: ReducerName


def _board(hub: Hub) -> Board:
    if hub.board is None:
        raise Conflict("this hub merges in its own threads: start it with --reducers K (SYNC_REDUCERS) to lease")
    return hub.board


@router.post(
    "/lease",
    summary=(
        "Wait for a work lease: a merge's (no `kind`), a check's (`kind: check`), a fold ahead's (`kind: fold`) "
        "or a version build's (`kind: build`) (long poll); 204 when none came within `wait`"
    ),
    response_model=WorkJob,
    responses={204: {"description": "No lease within the wait: ask again."}},
)
async def take_lease(body: TakeLease, hub: Hub) -> WorkJob | Response:
    job = await _board(hub).take(body.reducer, body.wait)
    return job if job is not None else Response(status_code=204)


@router.post("/leases/{lease}/renew", summary="Keep a lease while working on it (409 lease_lost once lost)")
def renew_lease(lease: LeaseId, body: RenewLease, hub: Hub) -> Renewed:
    return Renewed(seconds=_board(hub).renew(lease, body.reducer))


@router.post(
    "/leases/{lease}/done",
    summary="Report a lease: done, or the round not finite, or failed (409 lease_lost if it expired)",
    status_code=204,
)
def lease_done(lease: LeaseId, body: Done, hub: Hub) -> Response:
    _board(hub).done(lease, body)
    return Response(status_code=204)


@router.post(
    "/leases/{lease}/checked",
    summary="Report a check lease: the body's digest, size and norm, or its refusal, or failed (409 lease_lost)",
    status_code=204,
)
async def lease_checked(lease: LeaseId, body: CheckReport, hub: Hub) -> Response:
    # on the event loop: it answers the upload waiting on it
    _board(hub).checked(lease, body)
    return Response(status_code=204)


@view_router.get("/reducers", summary="The reducers heard from lately and their leases' timings")
def reducers(hub: Hub) -> list[Reducer]:
    return answers.reducers(hub.view.reducers())
