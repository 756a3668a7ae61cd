"""SyncSchedule: a sync interval that changes over the run (frequent early, sparse late)."""

from __future__ import annotations

import pytest

from syncclient.peerlr import PeerLR
from syncclient.schedule import SyncClock, SyncSchedule, interval_after
from tests.test_finetune import load_script


def test_parse_and_the_steps_it_syncs_at() -> None:
    plan = SyncSchedule.parse(" 5:60 , 15 ")
    assert plan == SyncSchedule(((5, 60),), 15) and str(plan) == "5:60,15" and plan.first == 5
    # The interval after a sync depends only on that sync's global step: every peer agrees.
    steps = [plan.step_of_sync(n) for n in range(1, 16)]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 75, 90, 105]
    assert [interval_after(plan, s) for s in (0, 59, 60, 1000)] == [5, 5, 15, 15]
    assert interval_after(7, 60) == 7  # an int is the interval everywhere
    three = SyncSchedule.parse("2:10,5:40,20")
    assert [three.step_of_sync(n) for n in (5, 6, 11, 12)] == [10, 15, 40, 60]
    assert SyncSchedule.parse("15") == SyncSchedule((), 15)
    # A late joiner whose Trainer counts from 0 at the run's 12th sync (step 60) or 4th (step 20).
    later, sooner = plan.from_step(60), plan.from_step(20)
    assert later == SyncSchedule((), 15) and [later.step_of_sync(n) + 60 for n in (1, 2)] == [75, 90]
    assert [sooner.step_of_sync(n) + 20 for n in range(1, 11)] == steps[4:14]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("5:60", "want EVERY:UNTIL"),  # no interval for after step 60
        ("5:x,15", "want EVERY:UNTIL"),
        ("5:60:2,15", "want EVERY:UNTIL"),
        ("", "want EVERY:UNTIL"),
        ("0:60,15", "intervals must be ints >= 1"),
        ("5:60,-1", "intervals must be ints >= 1"),
        ("5:60,3:40,15", "must rise"),
        ("5:0,15", "must rise"),
    ],
)
def test_a_bad_schedule_is_refused_with_its_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=f"bad sync schedule .*{reason}"):
        SyncSchedule.parse(text)


def test_peer_lr_warms_up_over_the_first_interval() -> None:
    assert PeerLR("sqrt").for_rounds(SyncSchedule.parse("5:60,15")).warmup == 5
    assert PeerLR("sqrt", 3).for_rounds(SyncSchedule.parse("5:60,15")).warmup == 3


def test_the_reference_job_takes_a_schedule_instead_of_sync_every() -> None:
    script = load_script()
    base = ["--hub", "http://127.0.0.1:9", "--run", "r"]
    args = script.build_parser().parse_args([*base, "--sync-schedule", "5:60,15"])
    script.check_args(args)
    assert args.sync_every == 5 and script.schedule(args) == SyncSchedule(((5, 60),), 15)
    assert args.eval_every == 1  # defaults that follow --sync-every follow the first interval
    for extra, reason in [
        (["--sync-every", "10"], "exclude each other"),
        (["--sync-every", "0"], "exclude each other"),
        (["--sync-schedule", "5:60"], "--sync-schedule: bad sync schedule '5:60'"),
    ]:
        argv = [*base, *extra] if "--sync-schedule" in extra else [*base, "--sync-schedule", "5:60,15", *extra]
        with pytest.raises(script.Fail, match=reason):
            script.check_args(script.build_parser().parse_args(argv))


def test_the_clock_says_when_a_sync_is_due() -> None:
    """SyncClock, the one rule every integration asks: on time at each window's end; a sync inside
    a window takes that window's round, a flush round the next one's; a restart counts afresh."""
    clock, due = SyncClock(2), []
    for _ in range(6):
        clock.tick(3)
        if clock.on_time:
            due.append((clock.step, clock.samples))
            clock.sent()
    assert due == [(2, 6), (4, 6), (6, 6)] and not clock.unsynced
    clock = SyncClock(4)
    for _ in range(3):
        clock.tick(1)
    assert clock.window_open and not clock.on_time
    clock.sent()  # a final sync at step 3 (a read of the model's state): the round of steps 1-4
    clock.tick(1)
    assert not clock.on_time and not clock.window_open and clock.unsynced  # step 4: that round was taken
    clock.sent()  # a flush: the round of steps 5-8
    assert clock.next == 12
    clock.start(5)  # a late peer whose steps were dropped counts from step 5
    assert (clock.next, clock.samples, clock.unsynced) == (9, 0, False)
    steps = SyncClock(SyncSchedule.parse("1:3,2"))
    seen = []
    for _ in range(8):
        steps.tick(1)
        if steps.on_time:
            seen.append(steps.step)
            steps.sent()
    assert seen == [1, 2, 3, 5, 7] and SyncClock().next is None  # a samples run: the hub says when
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
            SyncClock(bad)  # type: ignore[arg-type]
