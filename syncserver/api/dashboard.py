"""The live dashboard: ``GET /`` serves a static page, ``GET /v1/dashboard`` feeds it (what it
shows, its tokens: docs/observability.md).

The page (``static/``: hand-written, no build step, no CDN: a hub may have no internet) needs no
token; its data does, sent as ``Authorization: Bearer``. ``/v1/dashboard`` is a long poll on a
state fingerprint, not server-sent events: ``EventSource`` cannot send that header. Everything the
page draws is computed here by pure functions, testable without a browser: :func:`round_trace`
(each participant's phases per round) and :func:`curves` (per peer, loss, perplexity and the
codec's ratio and error against step, from the metrics peers attach to their updates).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from syncserver import __version__
from syncserver.api import answers
from syncserver.api.deps import Hub, RunQuery, Viewer, Wait
from syncserver.api.schemas import DashboardData, DashboardRun
from syncserver.core.changes import until
from syncserver.core.samedata import LOSS_KEYS
from syncserver.records import RoundRecord, UpdateRecord

__all__ = ["add_dashboard", "curves", "round_trace"]

STATIC = Path(__file__).parent / "static"
TRACE_ROUNDS = 20  # rounds with phase spans (the timeline draws the last 8, the table 20)
CURVE_UPDATES = 2000  # latest updates whose metrics make the curves

# metric names peers use, in order of preference (the first one found wins; LOSS_KEYS: samedata's)
PPL_KEYS = ("eval_ppl", "val_ppl", "eval_perplexity", "perplexity", "ppl")
EVAL_LOSS_KEYS = ("eval_loss", "val_loss")  # perplexity = exp(loss) when no perplexity is sent
STEP_KEYS = ("step", "global_step")
EPSILON = 1e-3  # seconds: shorter gaps are clock noise, not a phase


def round_trace(
    rounds: Iterable[RoundRecord],
    updates: Iterable[UpdateRecord],
    downloads: Mapping[int, Mapping[str, tuple[float, float]]],
) -> list[dict[str, Any]]:
    """Each round as lanes of ``[phase, start, end]`` spans (wall seconds), one lane per participant:
    ``train`` (from its previous download), ``upload``, ``wait`` (for stragglers, until aggregation
    began), ``aggregate`` (until its download began) and ``download``. ``downloads``: round -> peer
    -> (began, ended); a download starts no earlier than the round's publication."""
    by_round: dict[int, list[UpdateRecord]] = {}
    for u in updates:
        by_round.setdefault(u.round, []).append(u)
    trace = []
    for r in rounds:
        fold, merge = r.timings.get("fold", 0.0), r.timings.get("merge", 0.0)
        aggregation = (r.closed - fold - merge, r.closed)
        lanes = []
        for u in sorted(by_round.get(r.round, []), key=lambda u: u.seq):
            began = u.received - u.seconds
            spans: list[tuple[str, float, float]] = []
            previous = downloads.get(r.round - 1, {}).get(u.peer)
            if previous is not None and began - previous[1] > EPSILON:
                spans.append(("train", previous[1], began))
            spans.append(("upload", began, u.received))
            if aggregation[0] - u.received > EPSILON:
                spans.append(("wait", u.received, aggregation[0]))
            # the hub's side runs until the result is out: fold, merge, then the commit (an
            # fsync) and waking the waiters, so it ends when this peer's download began
            fetched = downloads.get(r.round, {}).get(u.peer)
            published = max(r.closed, fetched[0]) if fetched is not None else r.closed
            spans.append(("aggregate", aggregation[0], published))
            if fetched is not None:
                spans.append(("download", published, max(fetched[1], published)))
            lanes.append(
                {
                    "peer": u.peer,
                    "samples": u.samples,
                    "bytes": u.nbytes,
                    "staleness": u.round - u.base,
                    "spans": [[phase, round(a, 4), round(b, 4)] for phase, a, b in spans],
                }
            )
        trace.append(
            {
                "round": r.round,
                "opened": r.opened,
                "closed": r.closed,
                "dropped": r.dropped,
                "aggregate_seconds": fold + merge,
                "lanes": lanes,
            }
        )
    return trace


def _first(metrics: Mapping[str, float], keys: tuple[str, ...]) -> float | None:
    return next((metrics[k] for k in keys if k in metrics), None)


def curves(updates: Iterable[UpdateRecord]) -> dict[str, Any]:
    """Per peer, ``[[x, y], …]`` for loss, val_ppl, codec_ratio and codec_error. x is the ``step``
    metric when every update with metrics carries one, else the update's round (steps at another
    scale); ``x`` in the answer says which."""
    rows = [u for u in updates if u.metrics]
    use_step = bool(rows) and all(_first(u.metrics, STEP_KEYS) is not None for u in rows)
    peers: dict[str, dict[str, list[list[float]]]] = {}
    for u in rows:
        x = _first(u.metrics, STEP_KEYS) if use_step else float(u.round)
        assert x is not None
        ppl = _first(u.metrics, PPL_KEYS)
        if ppl is None:
            eval_loss = _first(u.metrics, EVAL_LOSS_KEYS)
            ppl = math.exp(min(eval_loss, 50.0)) if eval_loss is not None else None
        values = {
            "loss": _first(u.metrics, LOSS_KEYS),
            "val_ppl": ppl,
            "codec_ratio": u.metrics.get("codec_ratio"),
            "codec_error": u.metrics.get("codec_error"),
        }
        series = peers.setdefault(u.peer, {key: [] for key in values})
        for key, value in values.items():
            if value is not None and math.isfinite(value):
                series[key].append([x, value])
    return {"x": "step" if use_step else "round", "peers": peers}


api = APIRouter(prefix="/v1")


@api.get("/dashboard", summary="Everything the dashboard shows, as a long poll on a state fingerprint")
async def dashboard_data(
    hub: Hub,
    only: Viewer,
    run: RunQuery = None,
    since: Annotated[str | None, Query(max_length=64, description="Fingerprint last seen.")] = None,
    wait: Wait = 0.0,
) -> DashboardData:
    view = hub.view
    if since is not None:  # every change the page shows wakes the view (acknowledgements, uploads, closes, leases)
        seconds = min(wait, hub.settings.long_poll_seconds)
        await until(lambda: view.fingerprint(view.find(run)) != since, view.changes, seconds, lambda: view.stopping)
    found, detail = view.find(run), None
    if found is not None:  # the updates' metrics as curves, their timings as the trace
        rounds = view.rounds(found.name, limit=TRACE_ROUNDS)
        updates = [u for r in rounds for u in view.updates(found.name, r.round)]
        detail = DashboardRun(
            **view.state(found),
            trace=round_trace(rounds, updates, found.downloads),
            curves=curves(view.latest_updates(found.name, limit=CURVE_UPDATES)),
            lease_seconds=view.lease_seconds,
        )
    return DashboardData(  # `only`: a run token's view, which must not learn of the hub's other runs
        fingerprint=view.fingerprint(found),
        now=time.time(),
        runs=[r for r in answers.run_lines(view.list_runs()) if only is None or r.run == only],
        run=detail,
        reducers=answers.reducers(view.reducers()) if only is None else [],
    )


def add_dashboard(app: FastAPI) -> None:
    """Serve the page at ``/`` (no token: it is static), its files under ``/static``, its data."""

    # the version in the asset URLs makes a browser fetch new scripts after an upgrade
    page = (STATIC / "index.html").read_text(encoding="utf-8").replace("{{version}}", __version__)

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(api)
