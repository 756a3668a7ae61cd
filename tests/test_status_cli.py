"""``syncserver status`` as a user runs it: a subprocess against a live hub."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from rich.console import Console

from syncserver.status import render
from tests.conftest import Hub
from tests.harness import Peers

TOKEN, VIEW = "hub-secret", "view-only"


def status(
    *args: str, token: str | None = None, columns: int = 200, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    env["COLUMNS"] = str(columns)  # rich fits tables to the terminal: give it room unless told
    if token:
        env["SYNC_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "syncserver", "status", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def hub_with_rounds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One hub with a run of three closed rounds, for every test here (peers are the slow part)."""
    tmp = tmp_path_factory.mktemp("status")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    env.update(SYNC_TOKEN=TOKEN, SYNC_VIEW_TOKEN=VIEW)
    hub = Hub(tmp / "hub", ["--min-peers", "2"], env, tmp / "hub.log").start()
    try:
        Peers(hub.url, "cli-run", ["peer-a", "peer-b"], token=TOKEN, min_peers=2, retry_seconds=30).train_all(3).wait()
        yield hub
    finally:
        hub.stop()


@pytest.fixture(scope="module")
def run_table(hub_with_rounds: Hub) -> subprocess.CompletedProcess[str]:
    """``status URL --run cli-run`` at 200 columns, run once for the tests that read it."""
    return status(hub_with_rounds.url, "--run", "cli-run", token=VIEW)  # the view token is enough


def test_run_table_lists_peers_and_rounds(run_table: subprocess.CompletedProcess[str]) -> None:
    out = run_table
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "run cli-run: version 3" in text
    for name in ("peer-a", "peer-b"):
        assert name in text
    assert "left" in text  # their state: both said goodbye
    assert "recent rounds" in text
    rounds = [line.split() for line in text.splitlines() if line.strip().startswith(("│", "┃"))]
    round_numbers = {cells[1] for cells in rounds if len(cells) > 2 and cells[1].isdigit()}
    assert {"0", "1", "2"} <= round_numbers, text
    assert "upload" in text and "wait" in text and "aggregate" in text and "download" in text
    assert "open round 3" in text
    # no object store: every byte went through the hub's link
    assert re.search(r"up [\d.,]+ MB via the hub, 0\.0 MB via the store; down [\d.,]+ MB via the hub, 0\.0 MB", text)
    assert "same data" not in text  # each peer drew its own batches
    assert "samples: acknowledged 48, lost 0, pending 0" in text  # 2 peers x 3 rounds x 8


def test_json_says_where_the_bytes_went(hub_with_rounds: Hub) -> None:
    """``--json``: the data the tables show, as the hub gave it; the run's bytes by the way they
    went agree with its rounds and its peers (a hub without a store: all through its link)."""
    out = status(hub_with_rounds.url, "--run", "cli-run", "--json", token=VIEW)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)["run"]
    traffic = run["traffic"]
    assert traffic["up"] == {"hub": sum(r["bytes_in"] for r in run["rounds"]), "store": 0}
    assert traffic["up"]["hub"] == sum(p["bytes_up"] for p in run["peers"]) > 0
    assert traffic["down"]["hub"] >= sum(p["bytes_down"] for p in run["peers"]) > 0
    assert traffic["down"]["store"] == 0
    both = status(hub_with_rounds.url, "--run", "cli-run", "--json", "--watch", token=VIEW)
    assert both.returncode == 2 and both.stderr == "error: --json prints once: leave out --watch\n"


NUMBER = re.compile(r"\d[\d,.]*(?:e[+-]\d+)?")


def numbers(text: str) -> set[str]:
    return set(NUMBER.findall(text))


def assert_numbers_whole(narrow: str, wide: str) -> None:
    """Every number drawn at a narrow width is one of the wide drawing's, never a cut one."""
    assert "…" not in narrow, narrow
    assert numbers(narrow) <= numbers(wide), (numbers(narrow) - numbers(wide), narrow)


@pytest.mark.parametrize("columns", [80, 60])
def test_numbers_are_never_cut_at_narrow_terminals(
    hub_with_rounds: Hub, run_table: subprocess.CompletedProcess[str], columns: int
) -> None:
    wide = run_table
    narrow = status(hub_with_rounds.url, "--run", "cli-run", token=VIEW, columns=columns)
    assert narrow.returncode == 0, narrow.stderr
    assert max(len(line) for line in narrow.stdout.splitlines()) <= columns, narrow.stdout
    assert_numbers_whole(narrow.stdout, wide.stdout)


def big_run() -> dict[str, Any]:
    """A run as ``/v1/dashboard`` describes it, with the wide numbers of a long run: the
    quickstart's early perplexity 2.108e+04 was drawn as ``2.108…`` at 80 columns."""
    peers = [
        {
            "peer": f"gpu-{region}-1",
            "rank": rank,
            "group_size": 2,
            "state": "live",
            "last_seen_seconds": 12345.6,
            "samples": 123456789,
            "samples_per_second": 98765.4,
            "bytes_up": 987654321098,
            "bytes_down": 876543210987,
        }
        for rank, region in enumerate(["europe-west", "us-east"])
    ]
    curves = {p["peer"]: {"loss": [[1.0, 9.876543]], "val_ppl": [[1.0, 21080.0 + 10000 * p["rank"]]]} for p in peers}
    rounds = [
        {
            "round": 12345 + i,
            "participants": ["gpu-europe-west-1", "gpu-us-east-1"],
            "dropped": ["gpu-asia-south-1"] if i else [],
            "samples": 123456789,
            "bytes_in": 987654321098,
            "timings": {"fold": 1234.5, "merge": 0.25},
            "opened": 1000.0,
            "closed": 13345.75,
        }
        for i in range(3)
    ]
    lane = {
        "peer": "gpu-us-east-1",
        "spans": [["upload", 0.0, 4321.5], ["wait", 4321.5, 5000.0], ["download", 0, 99.5]],
    }
    return {
        "run": "imdb-gpt2",
        "version": 12348,
        "sealed": True,
        "config": {"codec": "int8", "outer": "diloco", "min_peers": 2, "policy": "samples"},
        "peers": peers,
        "curves": {"x": "step", "peers": curves},
        "rounds": rounds,
        "traffic": {"up": {"hub": 0, "store": 987654321098}, "down": {"hub": 12345678, "store": 1975308642196}},
        "trace": [{"round": r["round"], "lanes": [lane]} for r in rounds],
        "open_round": {
            "round": 12348,
            "submitted": [],
            "uploading": ["gpu-us-east-1"],
            "closing": False,
            "seconds_left": 599.0,
        },
    }


def draw(width: int) -> str:
    out = io.StringIO()
    Console(width=width, file=out, color_system=None).print(render({"runs": [], "run": big_run()}, "http://hub:8000"))
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 60])
def test_big_numbers_stay_whole_and_the_least_important_columns_go(width: int) -> None:
    wide, narrow = draw(300), draw(width)
    assert "not shown at this width" not in wide
    assert_numbers_whole(narrow, wide)
    assert max(len(line) for line in narrow.splitlines()) <= width, narrow
    for kept in ("2.108e+04", "3.108e+04", "9.877", "12347"):  # each peer's val ppl, loss, the last round
        assert kept in narrow, narrow
    assert "not shown at this width: ranks, last seen s" in narrow


def test_runs_table_without_run(hub_with_rounds: Hub) -> None:
    out = status(hub_with_rounds.url, "--token", TOKEN)
    assert out.returncode == 0, out.stderr
    assert "cli-run" in out.stdout and "fp32" in out.stdout


@pytest.mark.parametrize(
    ("args", "token", "message"),
    [
        (["--run", "cli-run"], "wrong", "401 unauthorized (wrong token)"),
        (["--run", "cli-run"], None, "this hub needs a token"),
        (["--run", "other"], VIEW, "no run named 'other'"),
    ],
)
def test_refusals_are_one_line(hub_with_rounds: Hub, args: list[str], token: str | None, message: str) -> None:
    out = status(hub_with_rounds.url, *args, token=token)
    assert out.returncode == 1
    assert message in out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_unreachable_hub_is_one_line() -> None:
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        out = status(url, "--run", "x")
    assert out.returncode == 1
    assert out.stderr.startswith(f"error: cannot reach the hub at {url}")
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


# `syncserver` as a terminal starts it: a shell starts background jobs (CI's, say) with SIGINT
# ignored, their children inherit that, and Python then installs no KeyboardInterrupt handler
CTRL_C_ABLE = (
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from syncserver.cli import main; main()"
)


class Watch:
    """``syncserver status … --watch`` with a pseudo-terminal's behaviour (FORCE_COLOR makes rich
    redraw as it goes), its output read as it comes."""

    ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

    def __init__(self, *args: str, token: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
        env.update(COLUMNS="200", FORCE_COLOR="1")
        if token:
            env["SYNC_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CTRL_C_ABLE, "status", *args, "--watch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.chunks: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read(1):
            self.chunks.append(chunk)

    @property
    def text(self) -> str:
        return self.ANSI.sub("", "".join(self.chunks))

    def wait_for(self, needle: str, count: int = 1, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.text.count(needle) < count:
            assert self.proc.poll() is None, f"status exited with {self.proc.returncode}:\n{self.text}"
            assert time.monotonic() < deadline, f"no {needle!r} x{count} in:\n{self.text}"
            time.sleep(0.1)

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            return self.proc.wait(20)
        finally:
            if self.proc.poll() is None:  # a failed test leaves no watcher behind
                self.proc.kill()


def test_watch_refreshes_until_interrupted(hub_with_rounds: Hub) -> None:
    watch = Watch(hub_with_rounds.url, "--run", "cli-run", token=VIEW)
    watch.wait_for("recent rounds", count=2)  # drawn, then drawn again 2 s later
    assert "peer-a" in watch.text and "peer-b" in watch.text
    assert watch.interrupt() == 0  # Ctrl-C ends it quietly
    assert "Traceback" not in watch.text


def test_watch_keeps_going_when_the_hub_goes_away(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory()
    watch = Watch(hub.url)
    watch.wait_for("no runs at")
    hub.kill()
    watch.wait_for("cannot reach the hub")  # said under the last tables, and asked again
    watch.wait_for("retrying", count=2)
    assert watch.proc.poll() is None
    assert watch.interrupt() == 0
    assert "Traceback" not in watch.text


def test_a_round_waiting_on_its_merge_floor_says_so() -> None:
    """Every live peer is in, but the run's min_merge_peers is not reached (a member is gone)."""
    run = big_run()
    run["open_round"] |= {"submitted": ["gpu-europe-west-1"], "waiting_on_floor": True, "merge_floor": 2}
    out = io.StringIO()
    Console(width=200, file=out, color_system=None).print(render({"runs": [], "run": run}, "http://hub:8000"))
    assert "waiting for min_merge_peers: 1 of 2 updates" in out.getvalue()
    assert "stragglers dropped" not in out.getvalue()


def test_two_peers_on_the_same_data_get_a_line() -> None:
    """The hub's same-data notice (tests/test_samedata.py), under the peers; none without one."""
    run = big_run()
    message = "peers gpu-europe-west-1 and gpu-us-east-1 sent identical updates in round 12345: they trained ..."
    run["same_data"] = {
        "round": 12345,
        "peers": ["gpu-europe-west-1", "gpu-us-east-1"],
        "by": "digest",
        "message": message,
    }
    out = io.StringIO()
    Console(width=300, file=out, color_system=None).print(render({"runs": [], "run": run}, "http://hub:8000"))
    assert f"same data: {message}" in out.getvalue()
    assert "same data" not in draw(300)


def test_samples_lost_are_said_per_peer() -> None:
    """The ledger's line (syncserver/core/ledger.py): the peers that lost samples, by name."""
    run = big_run()
    peers = [
        {"peer": "a", "acknowledged": 900, "lost": 0, "pending": 5},
        {"peer": "b", "acknowledged": 1, "lost": 1234},
    ]
    run["ledger"] = {"acknowledged": 901, "lost": 1234, "pending": 5, "peers": peers, "losses": []}
    out = io.StringIO()
    Console(width=200, file=out, color_system=None).print(render({"runs": [], "run": run}, "http://hub:8000"))
    assert "samples: acknowledged 901, lost 1,234 (b 1,234), pending 5" in out.getvalue()
