"""The core's plain data (dataclasses) as the response models of :mod:`syncserver.api.schemas`,
where that takes more than a model call (a route builds a one-line answer itself): the core knows
no wire format.
"""

from __future__ import annotations

from typing import Any

from fastapi import Response

from syncserver.api.schemas import Reducer, RunConfig, RunSummary, StartInitialise, StartReady, StartWaiting, UpdateAck
from syncserver.core.coordinator import Start
from syncserver.core.leases import ReducerStats
from syncserver.core.rounds import Acknowledgement
from syncserver.core.state import RunConfig as RunSettings
from syncserver.core.view import RunLine

__all__ = ["reducers", "run_lines", "start", "update_ack"]


def run_config(config: RunSettings | None) -> RunConfig:
    assert config is not None  # an initialise or ready start carries it
    return RunConfig(**config.__dict__)


def start(start: Start) -> StartInitialise | StartWaiting | Response:
    """What ``join`` and ``GET .../start`` answer. A ready answer's schema (7 MB of JSON for 100,000
    tensors) is spliced in from the run's own JSON, made once (:class:`~syncserver.core.shape.RunShape`),
    not validated and serialised again on the event loop for every request: the bytes of a
    :class:`StartReady`."""
    base: dict[str, Any] = {"run": start.run, "peer": start.peer, "lease_seconds": start.lease_seconds}
    if start.state == "initialise":
        return StartInitialise(**base, state="initialise", config=run_config(start.config))
    if start.state == "waiting":
        return StartWaiting(**base, state="waiting", detail=start.detail)
    assert start.shape is not None
    ready = StartReady.model_construct(
        **base,
        state="ready",
        rank=start.rank,
        world_size=start.world_size,
        version=start.version,
        config=run_config(start.config),
        uploads=start.uploads,
    )
    head = ready.model_dump_json(by_alias=True, exclude={"tensor_schema"}).encode()
    return Response(head[:-1] + b',"schema":' + start.shape.schema_json + b"}", media_type="application/json")


def update_ack(ack: Acknowledgement) -> UpdateAck:
    return UpdateAck(
        round=ack.round, peer=ack.peer, seq=ack.seq, samples=ack.samples, bytes=ack.nbytes, repeat=ack.repeat
    )


def run_lines(lines: list[RunLine]) -> list[RunSummary]:
    return [RunSummary.model_validate(line) for line in lines]


def reducers(known: list[ReducerStats]) -> list[Reducer]:
    """The reducers the board knows, as /v1/reduce/reducers and the dashboard show them."""
    fields = Reducer.model_fields.keys() - {"busy"}
    return [Reducer(**{f: getattr(r, f) for f in fields}, busy=r.holding is not None) for r in known]
