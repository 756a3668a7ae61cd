"""What every benchmark writes beside its table: one JSON file that says when, where and how it ran."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def save(path: Path, started: datetime.datetime, **fields: Any) -> None:
    """``path`` (its folder made) with the start time, the machine, and ``fields``; says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": started.isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        **fields,
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def targets_table(targets: list[dict[str, Any]], fmt: str = "{}") -> list[str]:
    """The lines of the "target | measured | threshold | met" table every benchmark ends with.

    Each target is ``{"target", "value", "threshold", "met"}``; ``met`` None is "not measured".
    ``fmt`` formats ``value`` and ``threshold`` (e.g. ``"{:.1%}"``), unless the target has its own."""
    lines = ["| target | measured | threshold | met |", "|---|---|---|---|"]
    for t in targets:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        f = t.get("fmt", fmt)
        lines.append(f"| {t['target']} | {f.format(t['value'])} | {f.format(t['threshold'])} | {met} |")
    return lines
