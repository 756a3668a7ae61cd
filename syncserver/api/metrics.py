"""Prometheus metrics of one hub, ``GET /metrics`` (names, labels, scrape config: docs/observability.md).

Each app has its own :class:`~prometheus_client.CollectorRegistry` (tests build many apps in one
process; the global one would refuse the second). Events (counters, histograms) are fed by
observers of the run view and, from the app's error handlers, by every refused upload; state
(version, peers, bytes) is read from the view at scrape time, so it cannot drift from
``/v1/runs/{run}``. The ``run`` label is bounded: the first ``SYNC_METRICS_RUNS`` runs seen are
named, every other one is summed under ``run="_other"`` (with 2,000 runs ``/metrics`` *was* 881 KB,
and a scraper's series grew with every run made); a run never changes label, so sums stay monotonic.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections import defaultdict
from collections.abc import Iterator

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from syncserver.api.deps import authenticate_view
from syncserver.core.policy import PeerState
from syncserver.core.view import HubView
from syncserver.records import RoundRecord, UpdateRecord

__all__ = ["HubMetrics", "router"]

# Rounds across continents take from milliseconds (a tiny model on loopback) to many
# minutes (a straggler on a slow link): buckets span that range.
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf"))

#: The label of every run past the first SYNC_METRICS_RUNS.
OTHER = "_other"

# The routes that carry an update (or version 0): refusals there count as rejected updates.
_UPLOAD_ROUTES = {
    ("PUT", "/v1/runs/{run}/rounds/{round}/updates/{peer}"),
    ("PUT", "/v1/runs/{run}/versions/0"),
    ("POST", "/v1/runs/{run}/rounds/{round}/updates/{peer}/presign"),  # SYNC_STORE: the size caps
    ("POST", "/v1/runs/{run}/rounds/{round}/updates/{peer}/uploaded"),  # SYNC_STORE: the checks
}


_C, _G = CounterMetricFamily, GaugeMetricFamily
#: per reducer: (the ReducerStats field, counter or gauge, metric, help)
_REDUCER_SERIES: list[tuple[str, type[CounterMetricFamily | GaugeMetricFamily], str, str]] = [
    ("leases", _C, "weightsync_reducer_leases", "Merge and version-build leases the reducer did."),
    ("seconds", _C, "weightsync_reducer_lease_seconds", "Seconds of work in the reducer's leases, summed."),
    ("last_seconds", _G, "weightsync_reducer_last_lease_seconds", "Seconds the reducer's last lease took."),
    ("expired", _C, "weightsync_reducer_leases_expired", "Leases the reducer took and lost (not renewed)."),
    ("bytes", _C, "weightsync_reducer_bytes", "Bytes the reducer's leases read and wrote."),
    # the reducers' check leases (SYNC_STORE)
    ("checks", _C, "weightsync_reducer_checks", "Uploaded update bodies the reducer checked."),
    ("check_seconds", _C, "weightsync_reducer_check_seconds", "Seconds of the reducer's checks, summed."),
    (
        "check_failures",
        _C,
        "weightsync_reducer_check_failures",
        "The reducer's check reports the hub did not take (failed, not holding up, or contradicted by the hub's "
        "own check of the body, which then answered the peer).",
    ),
]


def _reducer_metrics(view: HubView | None) -> Iterator[Metric]:
    """Per-reducer lease timings (SYNC_REDUCERS), for the reducers heard from lately: a
    restarted reducer is a new name, and the old one leaves the list (and the series)."""
    known = view.reducers() if view is not None else []
    count = GaugeMetricFamily("weightsync_reducers", "Reducers heard from lately (SYNC_REDUCERS).")
    count.add_metric([], len(known))
    yield count
    for field, family, name, text in _REDUCER_SERIES:
        series = family(name, text, labels=["reducer"])
        for r in known:
            if getattr(r, field) is not None:
                series.add_metric([r.name], getattr(r, field))
        yield series


class HubMetrics(Collector):
    """The registry of one app, the observers that feed it, and the state it reads at scrape time."""

    def __init__(self, max_runs: int = 50) -> None:
        self.registry = CollectorRegistry()
        self.view: HubView | None = None
        self.max_runs = max_runs
        self._labelled: set[str] = set()

        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(name, text, ["run", *labels], registry=self.registry)

        self.rounds = counter("weightsync_rounds_completed", "Rounds closed.")
        self.phases = Histogram(
            "weightsync_round_phase_seconds",
            "Seconds spent in each phase of a round: upload and download per peer, wait (for "
            "stragglers, per participant, from its acknowledgement to the start of aggregation), "
            "fold and merge (aggregation), round (first update to publication).",
            ["run", "phase"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.accepted = counter("weightsync_updates_accepted", "Updates acknowledged.")
        self.samples = counter("weightsync_samples", "Training samples reported with acknowledged updates.")
        self.rejected = counter(
            "weightsync_updates_rejected",
            "Uploads refused, by reason (the error code of the answer: round_closed, "
            "invalid_update, bad_request, conflict, unauthorized, payload_too_large, ...).",
            "reason",
        )
        self.dropped = counter(
            "weightsync_stragglers_dropped", "Live peers a round closed without (its deadline passed)."
        )
        self.download_bytes = counter(
            "weightsync_download_bytes",
            "Result and model bytes peers downloaded, by where from: via=hub (the hub's link) or via=store "
            "(redirected to the object store, SYNC_STORE).",
            "via",
        )
        self.upload_bytes = counter(
            "weightsync_upload_bytes",
            "Bytes of acknowledged updates, by the way they came: via=hub (a PUT to the hub, through its link) or "
            "via=store (uploaded to the object store through presigned URLs, SYNC_STORE).",
            "via",
        )
        self.store_bytes = counter(
            "weightsync_store_upload_bytes",
            "Result and version bytes the hub uploaded to the object store (once per object).",
        )
        self.registry.register(self)

    def attach(self, view: HubView) -> None:
        """Listen to a started hub's view."""
        self.view = view
        view.listeners.update.append(self._updated)
        view.listeners.round.append(self._closed)
        view.listeners.download.append(self._downloaded)
        view.listeners.stored.append(self._stored)
        for run in view.names():  # show every known run at 0 from the start
            self._touch(run)

    def label(self, run: str) -> str:
        """``run``'s label: its name if it is among the first ``max_runs`` runs seen, else ``_other``."""
        if run not in self._labelled:
            if len(self._labelled) >= self.max_runs:
                return OTHER
            self._labelled.add(run)
        return run

    def _touch(self, run: str) -> None:
        for counter in (self.rounds, self.accepted, self.samples, self.dropped):
            counter.labels(self.label(run))

    # ---- observers (event loop thread; cheap) --------------------------------------------
    def _updated(self, run: str, update: UpdateRecord) -> None:
        label = self.label(run)
        self.accepted.labels(label).inc()
        self.samples.labels(label).inc(update.samples)
        self.phases.labels(label, "upload").observe(update.seconds)
        self.upload_bytes.labels(label, "hub" if update.object is None else "store").inc(update.nbytes)

    def _closed(self, run: str, record: RoundRecord) -> None:
        self._touch(run)
        label = self.label(run)
        self.rounds.labels(label).inc()
        self.dropped.labels(label).inc(len(record.dropped))
        fold, merge = record.timings.get("fold", 0.0), record.timings.get("merge", 0.0)
        for phase, seconds in (("fold", fold), ("merge", merge), ("round", max(0.0, record.closed - record.opened))):
            self.phases.labels(label, phase).observe(seconds)
        aggregation_began = record.closed - fold - merge
        assert self.view is not None
        for update in self.view.updates(run, record.round):
            self.phases.labels(label, "wait").observe(max(0.0, aggregation_began - update.received))

    def _downloaded(self, run: str, round_: int, peer: str, seconds: float) -> None:
        self.phases.labels(self.label(run), "download").observe(seconds)

    def _stored(self, run: str, nbytes: int) -> None:
        self.store_bytes.labels(self.label(run)).inc(nbytes)

    def served(self, run: str, via: str, nbytes: int) -> None:
        """A download answered: ``nbytes`` through the hub's link, or redirected to the store."""
        self.download_bytes.labels(self.label(run), via).inc(nbytes)

    def rejected_upload(self, request: Request, reason: str) -> None:
        """Count a refused upload (called by the app's error handlers for every error answer)."""
        route = request.scope.get("route")
        if (request.method, getattr(route, "path", None)) not in _UPLOAD_ROUTES:
            return
        run = request.path_params.get("run", "")
        # only known runs become label values: a stranger cannot grow the label set
        known = self.view is not None and run in self.view.names()
        self.rejected.labels(self.label(run) if known else "", reason).inc()

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: names are fixed below

    def collect(self) -> Iterator[Metric]:
        """The state, read from the coordinator at scrape time: gauges and byte counters."""
        view = self.view
        runs = GaugeMetricFamily("weightsync_runs", "Runs on the hub (labelled one by one or not).")
        version = GaugeMetricFamily("weightsync_version", "Current model version of the run.", labels=["run"])
        live = GaugeMetricFamily(
            "weightsync_live_peers", "Peers whose lease is fresh (waited for in rounds).", labels=["run"]
        )
        peers = GaugeMetricFamily(
            "weightsync_peers", "Peers of the run by state (live, late, gone, left).", labels=["run", "state"]
        )
        pending = GaugeMetricFamily(
            "weightsync_open_round_updates", "Updates acknowledged in the open round.", labels=["run"]
        )
        bytes_in = CounterMetricFamily("weightsync_bytes_received", "Update bytes received from peers.", labels=["run"])
        bytes_out = CounterMetricFamily(
            "weightsync_bytes_sent", "Result and model bytes served to peers.", labels=["run"]
        )
        lost = CounterMetricFamily(
            "weightsync_samples_lost",
            "Samples peers reported training that no acknowledged update carried (the ledger; kept across restarts).",
            labels=["run"],
        )
        facts = view.facts() if view is not None else []
        sums: defaultdict[str, Tally[str]] = defaultdict(Tally)  # label -> what is summed under it
        for run in facts:
            label = self.label(run.run)
            if label != OTHER:  # a version of many runs means nothing: only named runs have one
                version.add_metric([label], run.version)
            sums[label].update({state.value: count for state, count in run.peers.items()})
            sums[label].update(pending=run.open_updates, up=run.bytes_up, down=run.bytes_down, lost=run.samples_lost)
        for label, total in sums.items():
            live.add_metric([label], total["live"])  # PeerState.LIVE's (a late peer is not counted)
            for state in PeerState:
                peers.add_metric([label, state.value], total[state.value])
            pending.add_metric([label], total["pending"])
            bytes_in.add_metric([label], total["up"])
            bytes_out.add_metric([label], total["down"])
            lost.add_metric([label], total["lost"])
        runs.add_metric([], len(facts))
        yield from (runs, version, live, peers, pending, bytes_in, bytes_out, lost)
        if view is not None and view.store_reads is not None:
            read = CounterMetricFamily(
                "weightsync_store_read_bytes",
                "Bytes the hub read from the object store: the updates it checks (one GET each) and merges.",
            )
            read.add_metric([], view.store_reads())
            yield read
        yield from _reducer_metrics(view)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


router = APIRouter(dependencies=[Depends(authenticate_view)])


@router.get("/metrics", summary="Prometheus metrics (text format)", response_class=Response)
async def metrics(request: Request) -> Response:
    # async on purpose: the collector reads coordinator state, which lives on the event loop
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
