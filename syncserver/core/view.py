"""The read-only view of a hub's runs: what status, the dashboard and the metrics read.

The coordinator tells it of every change (:meth:`HubView.changed`: it wakes the long polls) and of
the events the metrics count (its listeners). Readers never touch the coordinator, its policies,
locks or store: the view answers in plain data (:class:`RunLine`, :class:`RunState`, the records
of :mod:`syncserver.records`), which the HTTP layer turns into response models.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from syncserver.core.changes import Changes
from syncserver.core.planes import LocalPlane
from syncserver.core.policy import PeerState
from syncserver.core.samedata import SameData
from syncserver.core.state import Run, Via
from syncserver.core.workers import Workers
from syncserver.errors import NotFound
from syncserver.records import Loss, RoundRecord, UpdateRecord
from syncserver.storage.store import Store

__all__ = [
    "HubView",
    "LedgerState",
    "Listeners",
    "OpenRoundState",
    "PeerLine",
    "RunFacts",
    "RunLine",
    "RunState",
    "SameDataState",
]


@dataclass(frozen=True)
class RunFacts:
    """A run's numbers, as the metrics export them."""

    run: str
    version: int
    peers: dict[PeerState, int]  # by state
    open_updates: int  # acknowledged in the open round
    bytes_up: int  # update bytes received
    bytes_down: int  # result and model bytes served
    samples_lost: int  # reported trained, in no acknowledged update (the ledger)


@dataclass(frozen=True)
class RunLine:
    run: str
    version: int
    peers: int  # live
    codec: str
    outer: str


class OpenRoundState(TypedDict):
    round: int
    submitted: list[str]
    uploading: list[str]
    closing: bool
    rejected: list[str]
    seconds_left: float | None
    samples: int
    due: bool
    merge_floor: int
    waiting_on_floor: bool


class PeerLine(TypedDict):
    peer: str
    rank: int | None
    group_size: int
    state: PeerState
    last_seen_seconds: float
    active_from: int
    samples: int
    samples_per_second: float
    bytes_up: int
    bytes_down: int


class PeerSamples(TypedDict):
    peer: str
    acknowledged: int
    lost: int
    pending: int


class LedgerState(TypedDict):
    """The samples ledger (core/ledger.py): totals, per peer, and the latest losses by round."""

    acknowledged: int
    lost: int
    pending: int
    peers: list[PeerSamples]
    losses: list[Loss]  # latest round first


class SameDataState(TypedDict):
    round: int
    peers: list[str]
    by: str
    message: str


class RunState(TypedDict):
    """What run status and the dashboard both show of a run."""

    run: str
    version: int
    config: dict[str, Any]
    sealed: bool
    world_size: int
    tensors: int
    parameters: int
    open_round: OpenRoundState
    peers: list[PeerLine]
    rounds: list[RoundRecord]  # oldest first
    store: str | None  # the object store results and versions go out through (SYNC_STORE), no credential
    traffic: dict[str, dict[Via, int]]  # up/down -> via -> bytes since the hub started (state.Traffic)
    same_data: SameDataState | None  # two peers trained on the same data (samedata.py); a restart forgets
    interval: dict[str, Any] | None  # sync_every auto: the interval picked last and why (interval.py)
    ledger: LedgerState


@dataclass
class Listeners:
    """Observers called on the event loop; they must be cheap."""

    update: list[Callable[[str, UpdateRecord], None]] = field(default_factory=list)  # after an ack
    round: list[Callable[[str, RoundRecord], None]] = field(default_factory=list)  # after a commit
    download: list[Callable[[str, int, str, float], None]] = field(default_factory=list)  # (run, round, peer, s)
    stored: list[Callable[[str, int], None]] = field(default_factory=list)  # (run, bytes uploaded to the store)


class HubView:
    """Read the runs of one hub; be told when they change."""

    def __init__(self, runs: dict[str, Run], store: Store, lease_seconds: float, plane: LocalPlane, workers: Workers):
        self._runs = runs
        self._store = store
        self.store_url = plane.url  # SYNC_STORE, as ObjectStore.url says it: no credential
        self.store_reads = plane.reads  # SYNC_STORE: bytes the hub has read from it (checks, merges)
        self.reducers = workers.live  # the reducers heard from lately (SYNC_REDUCERS)
        self.lease_seconds = lease_seconds
        self.listeners = Listeners(stored=plane.stored)  # the plane tells of its uploads itself
        self.changes = Changes()  # every change a reader shows (the dashboard's long poll)
        self.stopping = False  # the server is shutting down: long polls answer at once

    # ---- events (from the coordinator) -------------------------------------------------
    def changed(self, run: Run | None = None) -> None:
        """Something a reader shows changed: wake the run's waiters and the view's."""
        if run is not None:
            run.changed.notify()
        self.changes.notify()

    def updated(self, run: Run, update: UpdateRecord) -> None:
        for listener in self.listeners.update:
            listener(run.name, update)
        self.changed(run)

    def closed(self, run: Run, record: RoundRecord) -> None:
        for listener in self.listeners.round:
            listener(run.name, record)
        self.changed(run)

    def downloaded(self, run: Run, round_: int, peer: str, seconds: float) -> None:
        for listener in self.listeners.download:
            listener(run.name, round_, peer, seconds)
        self.changed(run)

    # ---- reading -------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._runs)

    def get(self, name: str) -> Run:
        if name not in self._runs:
            raise NotFound(f"unknown run {name!r}")
        return self._runs[name]

    def find(self, name: str | None) -> Run | None:
        return self._runs.get(name) if name else None

    def list_runs(self, limit: int | None = None, after: str | None = None) -> list[RunLine]:
        """Runs by name: all of them, or ``limit`` after the run named ``after``."""
        names = sorted(name for name in self._runs if after is None or name > after)[:limit]
        runs = [self._runs[name] for name in names]
        return [RunLine(r.name, r.version, len(r.policy.live), r.config.codec, r.config.outer) for r in runs]

    def samples_through(self, run: str, round_: int) -> int:
        """Samples the run had trained by the end of round ``round_``: a peer stops on a budget."""
        return self._store.samples_through(run, round_)

    def rounds(self, run: str, limit: int = 50) -> list[RoundRecord]:
        """The latest ``limit`` closed rounds of ``run``, oldest first."""
        return self._store.rounds(run, limit=limit)

    def updates(self, run: str, round_: int) -> list[UpdateRecord]:
        """The updates that went into round ``round_``, in order of acknowledgement."""
        return self._store.updates(run, round_)

    def latest_updates(self, run: str, limit: int = 500) -> list[UpdateRecord]:
        """The latest ``limit`` updates of ``run``, oldest first (their metrics: status, the curves)."""
        return self._store.round_metrics(run, limit=limit)

    def facts(self) -> list[RunFacts]:
        return [
            RunFacts(
                run.name,
                run.version,
                {state: sum(run.policy.state(name) is state for name in run.peers) for state in PeerState},
                len(run.acked),
                sum(p.bytes_up for p in run.peers.values()),
                sum(p.bytes_down for p in run.peers.values()),
                sum(a.lost for a in run.ledger.accounts.values()),
            )
            for run in self._runs.values()
        ]

    def state(self, run: Run) -> RunState:
        """What run status and the dashboard both show of ``run``."""
        now = time.monotonic()
        policy = run.policy
        deadline = policy.deadline
        return {
            "run": run.name,
            "version": run.version,
            "config": run.config.__dict__,
            "sealed": run.sealed,
            "world_size": run.world_size(),
            "tensors": len(run.schema or {}),
            "parameters": run.shape.parameters if run.shape else 0,
            "open_round": {
                "round": run.version,
                "submitted": sorted(run.acked),
                "uploading": sorted(run.uploading),
                "closing": run.closing,
                "rejected": sorted(policy.refused),
                "seconds_left": None if deadline is None else max(0.0, deadline - now),
                "samples": policy.round_total(),
                "due": policy.due,
                "merge_floor": policy.quorum(),
                "waiting_on_floor": policy.floor_wait(now),
            },
            "peers": [
                {
                    "peer": p.name,
                    "rank": p.rank,
                    "group_size": p.group_size,
                    "state": policy.state(p.name),
                    "last_seen_seconds": round(now - policy.members[p.name].last_seen, 3),
                    "active_from": policy.members[p.name].active_from,
                    "samples": p.samples,
                    "samples_per_second": round(p.rate, 3),
                    "bytes_up": p.bytes_up,
                    "bytes_down": p.bytes_down,
                }
                for p in sorted(run.peers.values(), key=lambda p: (p.rank is None, p.rank, p.name))
            ],
            "rounds": self.rounds(run.name),
            "store": self.store_url,
            "traffic": {"up": dict(run.traffic.up), "down": dict(run.traffic.down)},
            "same_data": _same_data(run.same_data),
            "interval": _interval(run),
            "ledger": self.ledger(run),
        }

    def ledger(self, run: Run) -> LedgerState:
        """Every sample each peer reported or sent: acknowledged, lost, or pending (in neither yet)."""
        peers: list[PeerSamples] = [
            {"peer": name, "acknowledged": a.acknowledged, "lost": a.lost, "pending": run.ledger.pending(name)}
            for name, a in sorted(run.ledger.accounts.items())
        ]
        return {
            "acknowledged": sum(p["acknowledged"] for p in peers),
            "lost": sum(p["lost"] for p in peers),
            "pending": sum(p["pending"] for p in peers),
            "peers": peers,
            "losses": self._store.losses(run.name),
        }

    def fingerprint(self, run: Run | None) -> str:
        """Changes whenever anything status shows changes (but the ages of last-seen times)."""
        parts: list[Any] = [sorted((r.name, r.version, len(r.policy.live)) for r in self._runs.values())]
        if run is not None:
            policy = run.policy
            peers = sorted((name, policy.state(name).value, p.rank) for name, p in run.peers.items())
            downloads = sorted((r, sorted(names)) for r, names in run.downloads.items())
            open_round = [run.version, sorted(run.acked), sorted(run.uploading), run.closing, policy.due]
            parts += [*open_round, policy.floor_wait(time.monotonic()), sorted(policy.live), peers, downloads]
            parts.append(run.same_data is not None)
            parts.append(sorted((name, a.acknowledged, a.lost) for name, a in run.ledger.accounts.items()))
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def _interval(run: Run) -> dict[str, Any] | None:
    picked = run.pacer.current
    if picked is None:
        return None
    return {**picked.as_dict(), "unit": run.policy.unit, "why": picked.why(run.policy.unit)}


def _same_data(found: SameData | None) -> SameDataState | None:
    if found is None:
        return None
    return {"round": found.round, "peers": list(found.peers), "by": found.by, "message": found.message}
