"""The hub's answers on the wire: one pydantic model per JSON body, so that ``/openapi.json``
describes every answer (schemathesis checks each response against it). Field names and types are
the wire format: changing one is a protocol change. Models are strict (``extra="forbid"``: a field
the schema does not name is refused where the answer is built, not sent unannounced) and read
attributes, so the core's plain data converts as it is (:mod:`syncserver.api.answers`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from syncserver.core.policy import PeerState
from syncserver.settings import run_type
from syncwire.runsettings import RUN_SETTINGS, Outer

__all__ = [
    "Answer",
    "Bytes",
    "Curves",
    "DashboardData",
    "DashboardRun",
    "ErrorBody",
    "Health",
    "Heartbeat",
    "Interval",
    "IntervalNow",
    "Lane",
    "Ledger",
    "Left",
    "Loss",
    "OpenRound",
    "PeerCurves",
    "PeerSamples",
    "PeerStatus",
    "Progress",
    "Reducer",
    "Renewed",
    "RoundSummary",
    "RunConfig",
    "RunStatus",
    "RunSummary",
    "SameData",
    "StartInitialise",
    "StartReady",
    "StartState",
    "StartWaiting",
    "TraceRound",
    "Traffic",
    "UpdateAck",
    "UpdateSummary",
    "UploadPlan",
    "VersionZero",
]


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", from_attributes=True)


class ErrorBody(BaseModel):
    """Every error the hub answers: a code to branch on and a reason to show. Some carry more
    (``current_version`` with a 409, ``errors`` with a 422 from request validation, ...)."""

    model_config = ConfigDict(extra="allow")
    error: str
    detail: str


class Health(Answer):
    status: Literal["ok"]
    version: str = Field(description="The hub's weightsync version.")


# ---- a run's configuration and its members' start -------------------------------------------------
_CONFIG_FIELDS: dict[str, Any] = {
    s.name: (run_type(s, checked=False), Field(description=s.help[0].upper() + s.help[1:] + ".")) for s in RUN_SETTINGS
}
_RunFields = create_model("_RunFields", __base__=Answer, **_CONFIG_FIELDS)


class RunConfig(_RunFields):  # a base made from the run settings' table
    """What a run is, fixed at creation (the first peer may choose; later peers must agree)."""


class _Start(Answer):
    run: str
    peer: str
    lease_seconds: float = Field(description="Heartbeat at least this often, or be counted gone.")


class StartInitialise(_Start):
    """This peer uploads version 0 (``PUT /v1/runs/{run}/versions/0``), then asks again."""

    state: Literal["initialise"]
    config: RunConfig


class StartWaiting(_Start):
    """Ask again (``GET .../start`` long-polls): version 0 or ``min_peers`` are not there yet."""

    state: Literal["waiting"]
    detail: str = Field(description="What the run is waiting for.")


class StartReady(_Start):
    """Train: pull ``version`` and submit updates to round ``version``."""

    model_config = ConfigDict(validate_by_name=True)
    state: Literal["ready"]
    rank: int | None = Field(
        description="Fixed by sorted peer name when the run started; None for a peer that left before then "
        "and came back after."
    )
    world_size: int
    version: int
    config: RunConfig
    uploads: Literal["hub", "store"] = Field(
        "hub",
        description="Where updates go: hub (PUT .../updates/{peer}) or store (POST .../presign, PUT the parts to "
        "the object store, POST .../uploaded; the PUT to the hub stays the fallback).",
    )
    # "schema" would shadow BaseModel.schema(): the attribute has another name, the wire the same
    tensor_schema: dict[str, list[int]] = Field(alias="schema", description="Tensor name -> shape, in file order.")


#: What ``join`` and ``GET .../start`` answer, told apart by ``state``.
StartState = Annotated[StartInitialise | StartWaiting | StartReady, Field(discriminator="state")]


# ---- acknowledgements ----------------------------------------------------------------------------
class VersionZero(Answer):
    """Version 0 is stored: the run's schema is its tensors."""

    version: Literal[0]
    tensors: int
    bytes: int


class UpdateAck(Answer):
    """An update is durable and counted in its round (``repeat``: it was already, this is its
    first acknowledgement again)."""

    round: int
    peer: str
    seq: int = Field(description="Order of acknowledgement within the run.")
    samples: int
    bytes: int
    repeat: bool


class UploadPlan(Answer):
    """Where to upload an update in the object store: a multipart upload of one object, parts
    of ``part_size`` bytes (the last one shorter), a presigned PUT for each part the store lacks."""

    object: str = Field(description="The object's name in the store (under the hub's prefix).")
    upload_id: str
    size: int
    part_size: int
    urls: dict[int, str] = Field(description="Part number (from 1) -> presigned PUT URL, for the parts to send.")
    done: dict[int, str] = Field(description="Part number -> ETag, for the parts the store holds already.")
    expires: float = Field(description="When the URLs expire (unix time): ask /presign again after.")


class UploadHeld(Answer):
    """A whole update body is held, not acknowledged: a PUT from its end (``Upload-Offset``)
    with its ``Content-Digest`` completes it."""

    held: int = Field(description="Bytes held: the Upload-Offset that completes the upload.")


class Heartbeat(Answer):
    version: int = Field(description="The run's latest version: behind it, a peer should catch up.")
    lease_seconds: float
    watch: bool = Field(False, description="The request was held as the peer's watch (wait > 0): ask again at once.")


class Left(Answer):
    left: Literal[True]


class Progress(Answer):
    """Where the open round stands after a progress report (``due``: send your update now)."""

    round: int
    version: int = Field(description="The run's latest version (above round: that round closed).")
    due: bool = Field(description="The run's samples reached the round's target: every peer sends what it has.")
    samples: int = Field(description="Samples of the open round so far: live peers' reports and updates in.")
    target: int | None = Field(description="round_samples (samples runs), else None.")


# ---- a run's state -------------------------------------------------------------------------------
class RunSummary(Answer):
    """One line of the run list."""

    run: str
    version: int
    peers: int = Field(description="Live peers.")
    codec: str
    outer: Outer


class OpenRound(Answer):
    round: int
    submitted: list[str] = Field(description="Peers whose update is acknowledged.")
    uploading: list[str]
    closing: bool
    rejected: list[str] = Field(description="Peers whose update the norm guard refused this round.")
    seconds_left: float | None = Field(description="Until the deadline; None before the first update.")
    samples: int = Field(description="Samples so far: updates in, plus live peers' progress reports.")
    due: bool = Field(description="samples runs: the target is reached, every peer is asked for its update.")
    merge_floor: int = Field(description="Updates the round needs: min_merge_peers, fewer once peers left.")
    waiting_on_floor: bool = Field(
        description="Every live peer is in (or the deadline passed), and the round waits for its merge floor alone."
    )


class PeerStatus(Answer):
    peer: str
    rank: int | None
    group_size: int = Field(description="Ranks of the torch.distributed group that trains as this peer.")
    state: PeerState
    last_seen_seconds: float
    active_from: int = Field(description="First round this peer is waited for.")
    samples: int
    samples_per_second: float
    bytes_up: int
    bytes_down: int


class Interval(Answer):
    """An interval the hub picked (``sync_every="auto"``, ``core/interval.py``) and why."""

    every: int = Field(description="Steps from the sync that made the result to the next (samples runs: samples).")
    bound: str = Field(
        description="What set it: probe, round (the round's time must fit), stall (a peer's work per sync), "
        "sync_min, sync_max."
    )
    peer: str | None = Field(description="The peer whose need set it.")
    link: str | None = Field(description="The peer whose transfer was the round's slowest.")
    utilization: float | None = Field(description="The slowest peer's share of its last interval computing.")
    round_seconds: float | None = Field(description="The round's measured time: slowest upload + merge + download.")


class IntervalNow(Interval):
    unit: Literal["steps", "samples"]
    why: str = Field(description="One line, as syncserver status says it.")


class RoundSummary(Answer):
    """A closed round (``records.RoundRecord``)."""

    round: int
    opened: float
    closed: float
    participants: list[str]
    dropped: list[str]
    samples: int
    bytes_in: int
    result_bytes: int
    timings: dict[str, float] = Field(description="Seconds spent in each of the hub's phases (fold, merge, ...).")
    interval: Interval | None = Field(None, description="sync_every auto: the interval picked at this close.")


class UpdateSummary(Answer):
    """An acknowledged update (``records.UpdateRecord``)."""

    peer: str
    round: int
    seq: int
    digest: str
    samples: int
    metrics: dict[str, float]
    nbytes: int
    received: float
    seconds: float = Field(description="Upload time.")
    base: int = Field(description="The version it was computed from: its round, or older in async runs.")


class Bytes(Answer):
    hub: int = Field(description="Through the hub's link.")
    store: int = Field(description="Straight to or from the object store (SYNC_STORE), through presigned URLs.")


class Traffic(Answer):
    """A run's bytes since the hub started (a restart counts afresh), by the way they went: what
    /metrics exports as ``weightsync_upload_bytes_total{via}`` and ``weightsync_download_bytes_total{via}``."""

    up: Bytes = Field(description="Acknowledged updates: a PUT to the hub, or presigned parts to the store.")
    down: Bytes = Field(description="Results and versions: served by the hub, or a 307 to the store.")


class SameData(Answer):
    """Two peers' updates of one round were equal: they trained on the same data (``core/samedata.py``).
    Said once per run, from the first such pair; a restart forgets it."""

    round: int
    peers: list[str] = Field(description="The two peers: the one acknowledged first, then the other.")
    by: Literal["digest", "norm", "metrics"] = Field(
        description="What was equal: the body's sha-256, the L2 norm (to 1e-6), or the training loss and samples."
    )
    message: str = Field(description="What happened and what to do, as the log, status and the dashboard say it.")


class PeerSamples(Answer):
    peer: str
    acknowledged: int = Field(description="Samples its acknowledged updates carried.")
    lost: int = Field(description="Samples it reported training that no acknowledged update carried.")
    pending: int = Field(description="Samples it reported since its last acknowledged update: neither yet.")


class Loss(Answer):
    round: int = Field(description="The version the peer trained the samples from.")
    peer: str
    samples: int


class Ledger(Answer):
    """Every sample a peer reported training, counted once: acknowledged (an acknowledged update
    carried it) or lost (its round closed without the peer's update, or the peer came back or left
    first); ``core/ledger.py``. Kept with the hub's records: a restart keeps it, but forgets the open
    round's reports (pending)."""

    acknowledged: int
    lost: int
    pending: int
    peers: list[PeerSamples]
    losses: list[Loss] = Field(description="The latest 20 losses, latest round first.")


class _RunState(Answer):
    """What run status and the dashboard both say of a run."""

    run: str
    version: int
    config: RunConfig
    sealed: bool = Field(description="Ranks are fixed: version 0 exists and min_peers have joined.")
    world_size: int
    tensors: int
    parameters: int
    open_round: OpenRound
    peers: list[PeerStatus]
    rounds: list[RoundSummary] = Field(description="Latest first.")
    store: str | None = Field(
        None, description="The object store peers download results and versions from (SYNC_STORE); null: the hub."
    )
    traffic: Traffic
    same_data: SameData | None = Field(
        None, description="Two peers trained on the same data (the first pair the hub saw); null: none seen."
    )
    interval: IntervalNow | None = Field(
        None, description="sync_every auto: the interval picked last and why; null: the peers pick theirs."
    )
    ledger: Ledger = Field(description="The samples ledger: acknowledged and lost, per peer.")


class RunStatus(_RunState):
    updates: list[UpdateSummary] = Field(description="Latest first.")


# ---- the dashboard -------------------------------------------------------------------------------
Phase = Literal["train", "upload", "wait", "aggregate", "download"]
Point = tuple[float, float]


class Lane(Answer):
    """One participant of a round: its phases as ``[phase, start, end]`` (wall seconds)."""

    peer: str
    samples: int
    bytes: int
    staleness: int = Field(description="Versions its base lagged the round it went into (async; else 0).")
    spans: list[tuple[Phase, float, float]]


class TraceRound(Answer):
    round: int
    opened: float
    closed: float
    dropped: list[str]
    aggregate_seconds: float
    lanes: list[Lane]


class PeerCurves(Answer):
    """``[x, y]`` points; x is a step or a round (``Curves.x``)."""

    loss: list[Point]
    val_ppl: list[Point]
    codec_ratio: list[Point]
    codec_error: list[Point]


class Curves(Answer):
    x: Literal["step", "round"]
    peers: dict[str, PeerCurves]


class DashboardRun(_RunState):
    """A run's status as the page draws it: updates as a trace and curves instead of a list."""

    trace: list[TraceRound] = Field(description="Latest first.")
    curves: Curves
    lease_seconds: float


class Reducer(Answer):
    """A reducer the hub heard from lately, with its leases' timings."""

    name: str
    last_seen: float = Field(description="Unix time of its last request.")
    leases: int = Field(description="Leases it did that were used.")
    expired: int = Field(description="Leases it took and lost (not renewed in time).")
    seconds: float = Field(description="Its used leases' work, summed.")
    last_seconds: float | None = Field(description="Its last used lease's.")
    bytes: int = Field(description="Bytes its used leases read and wrote.")
    busy: bool = Field(description="It holds a lease now.")
    checks: int = Field(0, description="Uploaded bodies it checked (check leases reported).")
    check_seconds: float = Field(0.0, description="Its checks' work, summed.")
    check_failures: int = Field(
        0, description="Its check reports the hub did not take: the hub checked those bodies itself."
    )


class Renewed(Answer):
    """A reducer's lease, renewed."""

    seconds: float = Field(description="The lease is the reducer's for this many more seconds.")


class DashboardData(Answer):
    fingerprint: str = Field(description="Changes with anything the page shows: pass it back as ?since=.")
    now: float = Field(description="The hub's wall clock.")
    runs: list[RunSummary]
    run: DashboardRun | None = Field(description="The run asked for with ?run=, when it exists.")
    reducers: list[Reducer] = Field(
        default_factory=list, description="The reducers heard from lately (SYNC_REDUCERS); none for a run token."
    )
