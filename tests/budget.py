"""The suite's time budget, printed at the end of every run (``make test``, ``make check``).

A test suite gets slow one test at a time, and nobody notices a test that took 40 s when the run
as a whole is green. So every run ends with a "time budget" section: the wall time and the
test-seconds (setup + call + teardown, summed over workers), and every test over
``SLOW_SECONDS`` that is not in :data:`BUDGETS`, or that took more than twice its budget there.
A reviewer sees a new slow test in the output of the change that added it. The section never
fails a run: a loaded machine makes every test slower, and CI must not go red on a busy box.

:data:`BUDGETS` is the list of tests allowed to take longer, each with the seconds it took on a
quiet 2-core VM (docs/TESTING.md says why each needs a process of its own). A test's budget is
checked against its setup + call + teardown, so a fixture that got slow shows up too.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

SLOW_SECONDS = 8.0
"""A test above this (setup + call + teardown) needs a line in BUDGETS."""

BUDGETS: dict[str, float] = {
    # 3 rounds x 8 racing attempts at a 17 MiB update against a real hub: 8.4 s on a shared 2-core VM
    "tests/test_resume.py::test_a_peer_racing_its_own_retries_is_acknowledged_once": 8.0,
}
"""nodeid (without parameters) -> seconds on a quiet 2-core VM."""

_seconds: defaultdict[str, float] = defaultdict(float)
_started = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # on the xdist controller too: each worker's reports come back through this hook
    _seconds[report.nodeid] += report.duration


def _budget(nodeid: str) -> float | None:
    return BUDGETS.get(nodeid, BUDGETS.get(nodeid.split("[", 1)[0]))


def over_budget(seconds: dict[str, float]) -> list[tuple[str, float, float | None]]:
    """(nodeid, seconds, budget or None) for each test over its budget, slowest first."""
    rows = []
    for nodeid, took in seconds.items():
        budget = _budget(nodeid)
        if (budget is None and took > SLOW_SECONDS) or (budget is not None and took > 2 * budget):
            rows.append((nodeid, took, budget))
    return sorted(rows, key=lambda row: -row[1])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds or hasattr(terminalreporter.config, "workerinput"):
        return
    write = terminalreporter.write_line
    terminalreporter.section("time budget")
    total = sum(_seconds.values())
    write(f"{len(_seconds)} tests: {total:.0f} test-seconds in {time.monotonic() - _started:.0f} s of wall time")
    rows = over_budget(_seconds)
    for nodeid, took, budget in rows:
        if budget is None:
            write(f"SLOW {took:6.1f} s  {nodeid}  (over {SLOW_SECONDS:.0f} s and not in tests/budget.py BUDGETS)")
        else:
            write(f"SLOW {took:6.1f} s  {nodeid}  (more than twice its budget of {budget:.0f} s)")
    if not rows:
        write(f"every test within its budget (a test over {SLOW_SECONDS:.0f} s needs a line in tests/budget.py)")
