"""``syncserver status``: a run's state as terminal tables (rich), optionally refreshed."""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table


def _get(url: str, token: str | None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(url, headers=headers, timeout=10)
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise SystemExit(f"error: {url}: {response.status_code} {detail}")
    return response.json()


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def render(url: str, run: str | None, token: str | None) -> Group:
    base = url.rstrip("/")
    if run is None:
        table = Table(title=f"runs at {base}")
        for column in ("run", "version", "live peers", "codec", "outer"):
            table.add_column(column)
        for r in _get(f"{base}/v1/runs", token):
            table.add_row(r["run"], str(r["version"]), str(r["peers"]), r["codec"], r["outer"])
        return Group(table)
    s = _get(f"{base}/v1/runs/{run}", token)
    cfg = s["config"]
    peers = Table(title=f"run {s['run']}: version {s['version']}, codec {cfg['codec']}, outer {cfg['outer']}")
    for column in ("rank", "peer", "state", "last seen s", "samples", "samples/s", "MB up", "MB down"):
        peers.add_column(column)
    for p in s["peers"]:
        peers.add_row(
            "-" if p["rank"] is None else str(p["rank"]),
            p["peer"],
            p["state"],
            f"{p['last_seen_seconds']:.1f}",
            str(p["samples"]),
            f"{p['samples_per_second']:.1f}",
            _mb(p["bytes_up"]),
            _mb(p["bytes_down"]),
        )
    rounds = Table(title="recent rounds")
    for column in ("round", "peers", "dropped", "samples", "MB in", "seconds", "merge s"):
        rounds.add_column(column)
    for r in s["rounds"][-10:]:
        rounds.add_row(
            str(r["round"]),
            str(len(r["participants"])),
            ", ".join(r["dropped"]) or "-",
            str(r["samples"]),
            _mb(r["bytes_in"]),
            f"{r['closed'] - r['opened']:.2f}",
            f"{r['timings'].get('merge', 0):.2f}",
        )
    o = s["open_round"]
    line = f"open round {o['round']}: submitted {', '.join(o['submitted']) or 'none'}"
    if o["seconds_left"] is not None:
        line += f", deadline in {o['seconds_left']:.0f}s"
    return Group(peers, rounds, line)


def show(url: str, *, run: str | None, token: str | None, watch: bool) -> None:
    console = Console()
    if not watch:
        console.print(render(url, run, token))
        return
    with Live(render(url, run, token), console=console, refresh_per_second=1) as live:
        while True:
            time.sleep(2)
            live.update(render(url, run, token))
