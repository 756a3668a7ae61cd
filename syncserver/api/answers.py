"""The core's plain data as the hub's answers: what the coordinator and the run view return
(dataclasses, TypedDicts) turned into the response models of :mod:`syncserver.api.schemas`.

The core knows no wire format; the field names and types of every answer live in ``schemas``
alone, and this is the one place that fills them in. Models read attributes
(``from_attributes``), so a dataclass whose fields are the answer's converts as it is.
"""

from __future__ import annotations

from typing import Any

from syncserver.api.schemas import (
    Heartbeat,
    Progress,
    Reducer,
    RunConfig,
    RunStatus,
    RunSummary,
    StartInitialise,
    StartReady,
    StartWaiting,
    UpdateAck,
    UploadPlan,
    VersionZero,
)
from syncserver.core.coordinator import RoundProgress, Start
from syncserver.core.leases import ReducerStats
from syncserver.core.presigned import Plan
from syncserver.core.rounds import Acknowledgement, InitialVersion
from syncserver.core.state import RunConfig as RunSettings
from syncserver.core.view import HubView, RunLine

__all__ = [
    "heartbeat",
    "initial_version",
    "progress",
    "reducers",
    "run_lines",
    "run_status",
    "start",
    "update_ack",
    "upload_plan",
]


def run_config(config: RunSettings | None) -> RunConfig:
    assert config is not None  # an initialise or ready start carries it
    return RunConfig(**config.__dict__)


def start(start: Start) -> StartInitialise | StartWaiting | StartReady:
    """What ``join`` and ``GET .../start`` answer. A ready answer is built without validation:
    its schema (100,000 tensors: 0.2 s) is the hub's own, made once."""
    base: dict[str, Any] = {"run": start.run, "peer": start.peer, "lease_seconds": start.lease_seconds}
    if start.state == "initialise":
        return StartInitialise(**base, state="initialise", config=run_config(start.config))
    if start.state == "waiting":
        return StartWaiting(**base, state="waiting", detail=start.detail)
    assert start.shape is not None
    return StartReady.model_construct(
        **base,
        state="ready",
        rank=start.rank,
        world_size=start.world_size,
        version=start.version,
        config=run_config(start.config),
        uploads=start.uploads,
        tensor_schema=start.shape.schema_lists,
    )


def initial_version(stored: InitialVersion) -> VersionZero:
    return VersionZero(version=0, tensors=stored.tensors, bytes=stored.nbytes)


def update_ack(ack: Acknowledgement) -> UpdateAck:
    return UpdateAck(
        round=ack.round, peer=ack.peer, seq=ack.seq, samples=ack.samples, bytes=ack.nbytes, repeat=ack.repeat
    )


def upload_plan(plan: Plan) -> UploadPlan:
    return UploadPlan.model_validate(plan)


def progress(state: RoundProgress) -> Progress:
    return Progress.model_validate(state)


def heartbeat(version: int, lease_seconds: float, watch: bool) -> Heartbeat:
    return Heartbeat(version=version, lease_seconds=lease_seconds, watch=watch)


def run_lines(lines: list[RunLine]) -> list[RunSummary]:
    return [RunSummary.model_validate(line) for line in lines]


def run_status(view: HubView, name: str) -> RunStatus:
    """A run's state and its latest updates (``GET /v1/runs/{run}``)."""
    run = view.get(name)
    return RunStatus(**view.state(run), updates=view.latest_updates(run.name))


def reducers(known: list[ReducerStats]) -> list[Reducer]:
    """The reducers the board knows, as /v1/reduce/reducers and the dashboard show them."""
    return [
        Reducer(
            name=r.name,
            last_seen=r.last_seen,
            leases=r.leases,
            expired=r.expired,
            seconds=r.seconds,
            last_seconds=r.last_seconds,
            bytes=r.bytes,
            busy=r.holding is not None,
            checks=r.checks,
            check_seconds=r.check_seconds,
            check_failures=r.check_failures,
        )
        for r in known
    ]
