"""``syncserver status URL [--run NAME] [--watch | --json]``: a run's state as terminal tables (rich).

It reads the web page's data (``/v1/dashboard``), so the terminal and the browser agree (what the
tables show: docs/observability.md); ``--json`` prints that data as it came. The view token is
enough. Errors are one line, no traceback.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["StatusError", "fetch", "render", "show"]

STATE_STYLE = {"live": "green", "late": "yellow", "gone": "red", "left": "dim"}
ROUNDS_SHOWN = 10
TEXT_MIN = 8  # characters a text column (peer names, dropped peers) may wrap down to


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


@dataclass(frozen=True)
class Col:
    """A table column, and how long it stays when the terminal is narrow (higher ``keep``: later to go)."""

    header: str
    keep: int
    numeric: bool = True  # numbers are shown whole or not at all; text (names) may wrap


Cell = str | Text


def _fit(title: str, columns: Sequence[Col], rows: Sequence[Sequence[Cell]], width: int, empty: str) -> Table:
    """The table with as many columns as fit in ``width`` without cutting a number: rich would
    shrink columns and cut cells (``2.108e+04`` became ``2.108…``, another number). A number column
    never wraps; text wraps down to :data:`TEXT_MIN`; while still too wide, the least important
    column goes, and the caption names what went."""

    def need(i: int) -> int:
        widest = max(cell_len(str(cell)) for cell in [columns[i].header, *(row[i] for row in rows)])
        return widest if columns[i].numeric else min(widest, TEXT_MIN)

    shown = list(range(len(columns)))
    # each column has 1 space of padding either side and a border on its right, plus the left edge
    while len(shown) > 1 and sum(need(i) for i in shown) + 3 * len(shown) + 1 > width:
        shown.remove(min(shown, key=lambda i: columns[i].keep))
    table = Table(title=title, title_justify="left")
    for i in shown:
        if columns[i].numeric:
            table.add_column(columns[i].header, justify="right", no_wrap=True)
        else:
            table.add_column(columns[i].header, justify="left", overflow="fold")
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    hidden = [c.header for i, c in enumerate(columns) if i not in shown]
    if not rows:
        table.caption = empty
    elif hidden:
        table.caption = f"not shown at this width: {', '.join(hidden)}"
    return table


def _runs_table(data: dict[str, Any], base: str, width: int) -> RenderableType:
    if not data["runs"]:
        return Text(f"no runs at {base} yet: peers create one when they join")
    columns = [Col("run", 5, numeric=False), Col("version", 4), Col("live peers", 3), Col("codec", 2), Col("outer", 1)]
    rows = [[r["run"], str(r["version"]), str(r["peers"]), r["codec"], r["outer"]] for r in data["runs"]]
    return _fit(f"runs at {base}", columns, rows, width, empty="")


def _reducers_table(reducers: list[dict[str, Any]], width: int) -> RenderableType:
    """The reducers that share the hub's merges (SYNC_REDUCERS), with their leases' timings."""
    columns = [
        Col("reducer", 5, numeric=False),
        Col("leases", 4),
        Col("busy", 3, numeric=False),
        Col("last lease", 2),
        Col("lease s total", 1),
        Col("expired", 1),
        Col("checks", 1),
        Col("check failures", 2),
    ]
    rows = [
        [
            r["name"],
            str(r["leases"]),
            "yes" if r["busy"] else "",
            _s(r["last_seconds"]),
            _s(r["seconds"]),
            str(r["expired"]),
            str(r.get("checks", 0)),
            str(r.get("check_failures", 0)),
        ]
        for r in reducers
    ]
    return _fit("reducers", columns, rows, width, empty="")


def _slowest(lanes: list[dict[str, Any]], phase: str) -> str:
    """The most seconds one participant spent in ``phase`` ("-" when none had it)."""
    spent = [[b - a for name, a, b in lane["spans"] if name == phase] for lane in lanes]
    return _s(max((sum(x) for x in spent if x), default=None))


PEER_COLUMNS = [
    Col("rank", 6),
    Col("peer", 10, numeric=False),
    Col("ranks", 1),
    Col("state", 9, numeric=False),
    Col("last seen s", 0),
    Col("samples", 4),
    Col("samples/s", 5),
    Col("MB up", 2),
    Col("MB down", 3),
    Col("loss", 7),
    Col("val ppl", 8),
]
ROUND_COLUMNS = [
    Col("round", 10),
    Col("peers", 4),
    Col("dropped", 3, numeric=False),
    Col("samples", 1),
    Col("MB in", 2),
    Col("upload", 6),
    Col("wait", 7),
    Col("aggregate", 8),
    Col("download", 5),
    Col("total", 9),
    Col("computing", 6),
    Col("next", 5),
]


def _run_tables(s: dict[str, Any], width: int) -> list[RenderableType]:
    cfg = s["config"]
    live = sum(p["state"] in ("live", "late") for p in s["peers"])
    title = (
        f"run {s['run']}: version {s['version']}, {live}/{len(s['peers'])} peers live, "
        f"codec {cfg['codec']}, outer {cfg['outer']}, min_peers {cfg['min_peers']}, rounds {cfg['policy']}"
        + (f", downloads from {s['store']}" if s.get("store") else "")
    )
    curves = s["curves"]["peers"]
    peer_rows: list[list[Cell]] = [
        [
            "-" if p["rank"] is None else str(p["rank"]),
            p["peer"],
            str(p["group_size"]),
            Text(p["state"], style=STATE_STYLE.get(p["state"], "")),
            f"{p['last_seen_seconds']:.1f}",
            f"{p['samples']:,}",
            f"{p['samples_per_second']:.1f}",
            _mb(p["bytes_up"]),
            _mb(p["bytes_down"]),
            _latest(curves.get(p["peer"], {}).get("loss")),
            _latest(curves.get(p["peer"], {}).get("val_ppl")),
        ]
        for p in s["peers"]
    ]
    # where the run's bytes went since the hub started: through its link, or the object store's
    traffic = "; ".join(
        f"{way} {_mb(s['traffic'][way]['hub'])} MB via the hub, {_mb(s['traffic'][way]['store'])} MB via the store"
        for way in ("up", "down")
    )
    out: list[RenderableType] = [_fit(title, PEER_COLUMNS, peer_rows, width, empty="no peers yet")]
    if s.get("interval"):  # sync_every auto (core/interval.py)
        out.append(Text(f"interval: {s['interval']['why']}"))
    if s.get("same_data"):  # said once per run by the hub (core/samedata.py)
        out.append(Text(f"same data: {s['same_data']['message']}", style="bold yellow"))
    out.append(Text(f"bytes since the hub started: {traffic}"))
    if s.get("ledger"):  # every sample reported, counted once (core/ledger.py)
        out.append(_samples(s["ledger"]))

    lanes = {t["round"]: t["lanes"] for t in s["trace"]}
    round_rows: list[list[Cell]] = [
        [
            str(r["round"]),
            str(len(r["participants"])),
            Text(", ".join(r["dropped"]) or "-", style="yellow" if r["dropped"] else ""),
            f"{r['samples']:,}",
            _mb(r["bytes_in"]),
            _slowest(lanes.get(r["round"], []), "upload"),
            _slowest(lanes.get(r["round"], []), "wait"),
            _s(r["timings"].get("fold", 0.0) + r["timings"].get("merge", 0.0)),
            _slowest(lanes.get(r["round"], []), "download"),
            _s(r["closed"] - r["opened"]),
            *_picked(r.get("interval")),
        ]
        for r in s["rounds"][-ROUNDS_SHOWN:]
    ]
    title = "recent rounds (seconds: slowest peer's upload, its wait, aggregation, slowest download"
    title += "; sync_every auto: the slowest peer's share of its interval computing, the interval picked)"
    out.append(_fit(title, ROUND_COLUMNS, round_rows, width, empty="no round has closed yet"))

    o = s["open_round"]
    line = f"open round {o['round']}: submitted {', '.join(o['submitted']) or 'none'}"
    if o["uploading"]:
        line += f"; uploading {', '.join(o['uploading'])}"
    if o["closing"]:
        line += "; closing"
    elif o.get("waiting_on_floor"):
        line += f"; waiting for min_merge_peers: {len(o['submitted'])} of {o['merge_floor']} updates"
    elif o["seconds_left"] is not None:
        line += f"; stragglers dropped in {o['seconds_left']:.0f}s"
    if s["version"] < 0:
        line = "waiting for the first peer to upload version 0"
    elif not s["sealed"]:
        line = f"waiting for peers: {len(s['peers'])} of {cfg['min_peers']} have joined"
    out.append(Text(line))
    return out


def _samples(ledger: dict[str, Any]) -> Text:
    """``samples: acknowledged N, lost M (peer n, ...), pending P``: the lost ones per peer."""
    line = f"samples: acknowledged {ledger['acknowledged']:,}, lost {ledger['lost']:,}"
    if ledger["lost"]:
        line += " (" + ", ".join(f"{p['peer']} {p['lost']:,}" for p in ledger["peers"] if p["lost"]) + ")"
    return Text(line + f", pending {ledger['pending']:,}", style="yellow" if ledger["lost"] else "")


def _picked(interval: dict[str, Any] | None) -> list[str]:
    """A round's utilization and the interval picked at its close (sync_every auto), or dashes."""
    if interval is None:
        return ["-", "-"]
    used = interval.get("utilization")
    return ["-" if used is None else f"{used:.1%}", str(interval["every"])]


@dataclass(frozen=True)
class _View:
    """One answer of :func:`fetch` as tables, laid out for the width rich offers when it draws
    (so ``--watch`` follows a resized terminal)."""

    data: dict[str, Any]
    base: str

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.data.get("run") is None:
            yield _runs_table(self.data, self.base, options.max_width)
        else:
            yield from _run_tables(self.data["run"], options.max_width)
        if self.data.get("reducers"):
            yield _reducers_table(self.data["reducers"], options.max_width)


def render(data: dict[str, Any], base: str) -> RenderableType:
    """The tables for one answer of :func:`fetch`."""
    return _View(data, base)


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
                    warning = Text(f"{time.strftime('%H:%M:%S')} {exc}; retrying", style="red")
                    live.update(Group(render(data, base), warning))
                else:
                    live.update(render(data, base))
    except KeyboardInterrupt:
        return
