"""``syncserver status URL [--run NAME] [--watch]``: a run's state as terminal tables (rich).

It reads the same ``/v1/dashboard`` data as the web page, so the terminal and the browser
agree: peers (state, last seen, speed, bytes, latest loss and perplexity), the latest rounds
with where their time went (upload, waiting for stragglers, aggregation, download), and the
open round. The view token (``SYNC_VIEW_TOKEN``) is enough. Errors are one line, no traceback.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["StatusError", "fetch", "render", "show"]

STATE_STYLE = {"live": "green", "late": "yellow", "gone": "red", "left": "dim"}
ROUNDS_SHOWN = 10


class StatusError(Exception):
    """The hub could not be asked, or said no: a one-line reason for the terminal."""


def fetch(url: str, run: str | None, token: str | None, timeout: float = 10.0) -> dict[str, Any]:
    """The dashboard data of the hub at ``url`` (and of ``run``, which must exist)."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise StatusError(f"{url!r} is not a hub URL: expected http://HOST:PORT")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(
            f"{base}/v1/dashboard", params={"run": run} if run else {}, headers=headers, timeout=timeout
        )
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach the hub at {base}: {type(exc).__name__}: {exc}") from None
    if response.status_code == 401:
        hint = "wrong token" if token else "this hub needs a token: pass --token or set SYNC_TOKEN"
        raise StatusError(f"{base}: 401 unauthorized ({hint})")
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except (ValueError, AttributeError):
            detail = response.text[:200]
        raise StatusError(f"{base}: {response.status_code} {detail}")
    try:
        data: dict[str, Any] = response.json()
    except ValueError:
        raise StatusError(f"{base} answered something that is not a weightsync hub") from None
    if run and data.get("run") is None:
        names = ", ".join(r["run"] for r in data.get("runs", [])) or "none yet"
        raise StatusError(f"no run named {run!r} at {base} (runs: {names})")
    return data


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _latest(curve: list[list[float]] | None) -> str:
    return f"{curve[-1][1]:.4g}" if curve else "-"


def _runs_table(data: dict[str, Any], base: str) -> RenderableType:
    if not data["runs"]:
        return Text(f"no runs at {base} yet: peers create one when they join")
    table = Table(title=f"runs at {base}", title_justify="left")
    for column in ("run", "version", "live peers", "codec", "outer"):
        table.add_column(column)
    for r in data["runs"]:
        table.add_row(r["run"], str(r["version"]), str(r["peers"]), r["codec"], r["outer"])
    return table


def _phase_seconds(lane: dict[str, Any], phase: str) -> float | None:
    spans = [b - a for name, a, b in lane["spans"] if name == phase]
    return sum(spans) if spans else None


def _run_tables(s: dict[str, Any]) -> list[RenderableType]:
    cfg = s["config"]
    live = sum(p["state"] in ("live", "late") for p in s["peers"])
    title = (
        f"run {s['run']}: version {s['version']}, {live}/{len(s['peers'])} peers live, "
        f"codec {cfg['codec']}, outer {cfg['outer']}, min_peers {cfg['min_peers']}"
    )
    curves = s["curves"]["peers"]
    peers = Table(title=title, title_justify="left")
    for column in ("rank", "peer", "state", "last seen s", "samples", "samples/s", "MB up", "MB down"):
        peers.add_column(column, justify="left" if column in ("peer", "state") else "right")
    peers.add_column("loss", justify="right")
    peers.add_column("val ppl", justify="right")
    for p in s["peers"]:
        c = curves.get(p["peer"], {})
        peers.add_row(
            "-" if p["rank"] is None else str(p["rank"]),
            p["peer"],
            Text(p["state"], style=STATE_STYLE.get(p["state"], "")),
            f"{p['last_seen_seconds']:.1f}",
            f"{p['samples']:,}",
            f"{p['samples_per_second']:.1f}",
            _mb(p["bytes_up"]),
            _mb(p["bytes_down"]),
            _latest(c.get("loss")),
            _latest(c.get("val_ppl")),
        )
    if not s["peers"]:
        peers.caption = "no peers yet"
    out: list[RenderableType] = [peers]

    trace = {t["round"]: t for t in s["trace"]}
    rounds = Table(
        title="recent rounds (seconds: slowest peer's upload, its wait, aggregation, slowest download)",
        title_justify="left",
    )
    for column in ("round", "peers", "dropped", "samples", "MB in", "upload", "wait", "aggregate"):
        rounds.add_column(column, justify="left" if column == "dropped" else "right")
    rounds.add_column("download", justify="right")
    rounds.add_column("total", justify="right")
    for r in s["rounds"][-ROUNDS_SHOWN:]:
        lanes = trace.get(r["round"], {}).get("lanes", [])

        def slowest(phase: str, lanes: list[dict[str, Any]] = lanes) -> float | None:
            values = [v for lane in lanes if (v := _phase_seconds(lane, phase)) is not None]
            return max(values) if values else None

        rounds.add_row(
            str(r["round"]),
            str(len(r["participants"])),
            Text(", ".join(r["dropped"]) or "-", style="yellow" if r["dropped"] else ""),
            f"{r['samples']:,}",
            _mb(r["bytes_in"]),
            _s(slowest("upload")),
            _s(slowest("wait")),
            _s(r["timings"].get("fold", 0.0) + r["timings"].get("merge", 0.0)),
            _s(slowest("download")),
            _s(r["closed"] - r["opened"]),
        )
    if not s["rounds"]:
        rounds.caption = "no round has closed yet"
    out.append(rounds)

    o = s["open_round"]
    line = f"open round {o['round']}: submitted {', '.join(o['submitted']) or 'none'}"
    if o["uploading"]:
        line += f"; uploading {', '.join(o['uploading'])}"
    if o["closing"]:
        line += "; closing"
    elif o["seconds_left"] is not None:
        line += f"; stragglers dropped in {o['seconds_left']:.0f}s"
    if s["version"] < 0:
        line = "waiting for the first peer to upload version 0"
    elif not s["sealed"]:
        line = f"waiting for peers: {len(s['peers'])} of {cfg['min_peers']} have joined"
    out.append(Text(line))
    return out


def render(data: dict[str, Any], base: str) -> Group:
    """The tables for one answer of :func:`fetch`."""
    if data.get("run") is None:
        return Group(_runs_table(data, base))
    return Group(*_run_tables(data["run"]))


def show(url: str, *, run: str | None, token: str | None, watch: bool, interval: float = 2.0) -> None:
    """Print the tables once, or keep them fresh until Ctrl-C. Raises :class:`StatusError`
    when the first look fails; while watching, later failures are shown and retried."""
    console = Console()
    base = url.rstrip("/")
    data = fetch(url, run, token)
    if not watch:
        console.print(render(data, base))
        return
    try:
        with Live(render(data, base), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(interval)
                try:
                    data = fetch(url, run, token)
                except StatusError as exc:  # keep the last good tables, say what is wrong
                    stamp = time.strftime("%H:%M:%S")
                    live.update(Group(render(data, base), Text(f"{stamp} {exc}; retrying", style="red")))
                else:
                    live.update(render(data, base))
    except KeyboardInterrupt:
        return
