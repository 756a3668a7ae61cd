"""``sync_every="auto"``: the hub picks each interval (syncserver/core/interval.py).

The rule on made-up figures (pure), then a real hub and two peers that sync at the steps each
result says, the decision in status and on the round records, kept over a restart; and bad input.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import time
from typing import Any

import pytest
from rich.console import Console

from syncclient import SyncClient, SyncError
from syncclient.hooks.settings import HookSettings, SettingsError
from syncclient.schedule import SyncClock
from syncserver.core.interval import HISTORY, MARGIN, Auto, Pace
from syncserver.status import fetch, render
from syncwire.runsettings import PACE_KEYS, check_run_settings
from tests.conftest import Hub
from tests.harness import run_peers, status
from tests.models import tiny_bigram

U = 0.95
SHARE = U / (1 - U)  # 19: seconds of compute per second of stall


def pace(peer: str = "a", *, steps: int = 100, step_s: float = 0.05, host: float = 0.5, wait: float = 0.0,
         overlap: bool = True, up: float = 2.0, down: float | None = 2.0, samples: int = 0) -> Pace:  # fmt: skip
    seconds = steps * step_s + host + wait
    return Pace(peer, steps, samples or steps * 8, seconds, host, wait, overlap, up, down)


# ---- the rule ---------------------------------------------------------------------------------
def test_an_overlapped_peer_on_a_slow_link_is_bound_by_the_round() -> None:
    auto = Auto(U)
    assert auto.current.every == 10 and auto.current.bound == "probe"
    picked = auto.decide(0, [pace(up=10.0, down=10.0)], aggregate=1.0)
    # the round (10 + 1 + 10 s) plus the margin must fit in the interval's compute, at 0.05 s a step
    assert picked.every == math.ceil(21.0 * (1 + MARGIN) / 0.05)
    assert (picked.bound, picked.link, picked.round_seconds) == ("round", "a", 21.0)


def test_a_fast_link_leaves_the_stall_to_bound_it() -> None:
    picked = Auto(U).decide(0, [pace(host=0.9, up=0.5, down=0.5)], aggregate=0.1)
    assert picked.bound == "stall" and picked.peer == "a"
    assert picked.every == math.ceil(SHARE * 0.9 / 0.05)  # 342 steps: 0.9 s in 18.0 s is 5%


def test_a_blocking_peer_counts_the_whole_round_as_its_stall() -> None:
    blocking = pace(host=0.2, wait=5.0, overlap=False, up=2.0, down=2.0)
    picked = Auto(U).decide(0, [blocking], aggregate=1.0)
    assert picked.bound == "stall" and picked.every == math.ceil(SHARE * (0.2 + 5.0) / 0.05)
    # and its utilization is what its interval measured
    assert picked.utilization == round(blocking.compute / blocking.seconds, 4)


def test_the_fastest_peer_and_the_slowest_link_set_it() -> None:
    fast, slow = pace("fast", step_s=0.02, up=1.0, down=1.0), pace("slow", step_s=0.1, up=8.0, down=1.0)
    picked = Auto(U).decide(0, [fast, slow], aggregate=0.0)
    assert (picked.peer, picked.link) == ("fast", "slow")  # more steps to cover the round on the fast one
    assert picked.every == math.ceil((8.0 + 0.0 + 1.0) * (1 + MARGIN) / 0.02)


def test_one_slow_round_does_not_swing_it_and_a_lasting_change_moves_it() -> None:
    auto, steady, burst = Auto(U), pace(up=2.0, down=2.0), pace(up=20.0, down=20.0)
    for r in range(HISTORY):
        settled = auto.decide(r, [steady], aggregate=0.0).every
    assert auto.decide(HISTORY, [burst], aggregate=0.0).every == settled  # a retransmit burst: ignored
    assert auto.decide(HISTORY + 1, [steady], aggregate=0.0).every == settled
    auto.decide(HISTORY + 2, [steady], aggregate=0.0)  # (the burst leaves the window)
    moved = [auto.decide(HISTORY + 3 + k, [burst], aggregate=0.0).every for k in range(HISTORY)]
    assert moved[0] == settled and moved[1] > 5 * settled  # the link got slower for good: two rounds


def test_bounds_and_units() -> None:
    assert Auto(U, low=500).decide(0, [pace(up=0.1, down=0.1, host=0.01)], 0.0).bound == "sync_min"
    capped = Auto(U, high=50).decide(0, [pace(up=10.0, down=10.0)], 0.0)
    assert (capped.every, capped.bound) == (50, "sync_max")
    assert Auto(U, low=20).current.every == 20  # the probe within the bounds too
    # a samples run picks samples: the seconds needed times the run's rate (both peers')
    a, b = pace("a", samples=800, up=4.0, down=4.0), pace("b", samples=1600, up=1.0, down=1.0)
    picked = Auto(U, samples=True, first=4096).decide(0, [a, b], aggregate=0.0)
    rate = 800 / a.compute + 1600 / b.compute
    assert picked.every == math.ceil(8.0 * (1 + MARGIN) * rate)
    assert Auto(U, samples=True, first=4096).current.every == 4096


def test_a_close_tried_again_decides_once_and_no_pace_keeps_the_interval() -> None:
    auto = Auto(U)
    first = auto.decide(0, [pace(up=3.0)], 0.0)
    assert auto.decide(0, [pace(up=30.0)], 0.0) == first and auto.needs == auto.needs[:1]
    assert auto.decide(1, [], 0.0) == first  # an older SDK's updates carry no pace
    assert Pace.of("a", {"loss": 1.0}, 1.0, None) is None
    assert Pace.of("a", dict.fromkeys(PACE_KEYS, 0.0), 1.0, None) is None  # no step trained (a flush round)
    first = dict(zip(PACE_KEYS, (10.0, 80.0, 1.0, 0.0, 0.0, 1.0), strict=True))
    assert Pace.of("a", first, 1.0, None) is None  # the first interval held no sync: its cost is unknown
    assert Pace.of("a", first | {"sync_host_s": 0.1}, 1.0, None) is not None


def test_the_clock_waits_for_the_hub_to_say_how_far() -> None:
    clock = SyncClock("auto")
    clock.told(10)  # the join's version says the probe
    clock.start(0)
    assert clock.next == 10
    for _ in range(10):
        clock.tick(1)
    assert clock.on_time
    clock.sent()
    assert clock.next is None and not clock.on_time  # nothing due before the result says
    for _ in range(40):
        clock.tick(1)
    clock.told(25)  # a late result: the sync at step 10 + 25 is overdue, so it goes at once
    assert clock.next == 35 and clock.on_time
    fixed = SyncClock(5)
    fixed.told(99)  # a run whose peers pick: a result says nothing
    assert fixed.next == 5


# ---- bad input: one line ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ({"sync_every": "auto", "utilization": "1.5"}, "--utilization: must be > 0 and < 1, got 1.5"),
        ({"sync_every": "auto", "utilization": "0"}, "--utilization: must be > 0 and < 1, got 0.0"),
        ({"sync_every": "auto", "sync_min": "50", "sync_max": "10"}, "--sync-min 50 is over --sync-max 10"),
        ({"sync_every": "10", "utilization": "0.9"}, "--utilization picks the interval: give --sync-every auto"),
        ({"sync_min": "5"}, "--sync-min bounds an interval the hub picks"),
        ({"sync_every": "auto", "policy": "async", "round_samples": "64"}, "an async run's peers sync on their own"),
    ],
)
def test_bad_interval_settings_are_one_line(flags: dict[str, str], said: str) -> None:
    with pytest.raises(SettingsError, match=said.replace("(", r"\(")):
        HookSettings.resolve({"hub": "http://h:1", "run": "r", **flags}, env={})


def test_auto_alone_or_utilization_alone_makes_an_auto_run() -> None:
    for flags in ({"sync_every": "auto"}, {"utilization": "0.9"}):
        settings = HookSettings.resolve({"hub": "http://h:1", "run": "r", **flags}, env={})
        assert settings.sync_every == "auto" and settings.config["utilization"] in (0.95, 0.9)
    with pytest.raises(ValueError, match="utilization picks the interval"):
        SyncClient("http://h:1", run="r", sync_every=10, utilization=0.9)
    with pytest.raises(ValueError, match="sync_min 9 is over sync_max 3"):
        check_run_settings({"utilization": 0.9, "sync_min": 9, "sync_max": 3})


def test_the_launcher_says_it_in_one_line_and_exits_2() -> None:
    run = [sys.executable, "-m", "weightsync_run", "--hub", "http://127.0.0.1:9", "--run", "r"]
    done = subprocess.run([*run, "--sync-every", "auto", "--utilization", "2", "--", "true"], capture_output=True)
    assert done.returncode == 2
    assert done.stderr.decode().strip().splitlines()[-1].endswith("--utilization: must be > 0 and < 1, got 2.0")


# ---- a real hub ---------------------------------------------------------------------------------
def _peers(hub: Hub, run: str, steps: int, step_s: float, **settings: Any) -> list[list[tuple[int, int]]]:
    """Two peers that step (sleeping ``step_s``) and sync when due; each returns (step, version) per sync."""

    def peer(i: int) -> list[tuple[int, int]]:
        model = tiny_bigram(seed=i)
        client = SyncClient(hub.url, run=run, peer=f"p{i}", min_peers=2, retry_seconds=30, **settings)
        client.join(model)
        client.count_from(0)
        syncs = []
        for _ in range(steps):
            time.sleep(step_s)
            with_grad = next(model.parameters())
            with_grad.data.add_(0.001 * (i + 1))
            if client.step(model, samples=8) is not None:
                syncs.append((client.clock.last, client.version))
        client.leave()
        return syncs

    return run_peers(2, peer)


def test_two_peers_sync_at_the_steps_the_hub_picks(hub_factory: Any) -> None:
    hub = hub_factory()
    syncs = _peers(hub, "auto", steps=70, step_s=0.01, sync_every="auto", utilization=0.5, sync_max=20)
    assert syncs[0] == syncs[1], "every peer syncs at the same steps"
    steps = [step for step, _ in syncs[0]]
    assert steps[0] == 10  # the probe
    s = status(hub, "auto")
    rounds = {r["round"]: r for r in s["rounds"]}
    for k in range(1, len(steps)):  # each sync came as many steps after the one before as its result said
        assert steps[k] - steps[k - 1] == rounds[k - 1]["interval"]["every"], (steps, rounds[k - 1])
    picked = [rounds[r]["interval"] for r in sorted(rounds)]
    console = Console(width=200, record=True)  # what syncserver status prints
    console.print(render(fetch(hub.url, "auto", None), hub.url))
    printed = console.export_text()
    assert f"interval: every {picked[-1]['every']} steps" in printed and "computing" in printed
    # round 0's updates end the first interval, which held no sync: the probe again, then measured picks
    assert picked[0]["bound"] == "probe" and picked[0]["every"] == 10
    assert all(1 <= p["every"] <= 20 and p["utilization"] is not None for p in picked[1:])
    assert s["interval"]["unit"] == "steps" and s["interval"]["why"].startswith(f"every {picked[-1]['every']} steps")
    # kept over a restart: the next result and a joining peer's version carry the same interval
    hub.stop()
    hub.start()
    again = status(hub, "auto")
    assert again["interval"]["every"] == picked[-1]["every"]


def test_a_peer_that_keeps_its_own_interval_is_refused_at_join(hub: Hub) -> None:
    first = SyncClient(hub.url, run="auto-mixed", peer="a", sync_every="auto")
    first.join(tiny_bigram())
    other = SyncClient(hub.url, run="auto-mixed", peer="b", sync_every=10)
    with pytest.raises(SyncError, match=r"picks its interval .*give sync_every='auto'"):
        other.join(tiny_bigram())
    first.leave()
    plain = SyncClient(hub.url, run="fixed-run", peer="a", sync_every=10)
    plain.join(tiny_bigram())
    with pytest.raises(Exception, match="utilization"):  # the run exists without it: a 4xx naming it
        SyncClient(hub.url, run="fixed-run", peer="b", sync_every="auto").join(tiny_bigram())
    plain.leave()


def test_a_samples_run_sizes_its_rounds(hub: Hub) -> None:
    _peers(hub, "auto-samples", steps=60, step_s=0.01, round_samples=64, utilization=0.5, sync_max=160)
    s = status(hub, "auto-samples")
    rounds = sorted(s["rounds"], key=lambda r: r["round"])
    assert rounds[0]["samples"] >= 64  # the first round: round_samples
    assert s["interval"]["unit"] == "samples" and len(rounds) >= 4, rounds
    for before, after in itertools.pairwise(rounds[:-1]):  # (the last: the peers' final updates)
        picked = before["interval"]["every"]
        assert 1 <= picked <= 160 and after["samples"] >= picked, (before, after)
