"""The one retry helper: tries, gives up, waits as asked, stops when told."""

from __future__ import annotations

import threading

import pytest

from syncwire.retry import retrying


def _count(**kwargs: object) -> tuple[int, list[float], BaseException | None]:
    """Fail with OSError every time; how many tries were made, the waits asked for, what came out."""
    tries, waits = 0, []
    try:
        for attempt in retrying(lambda exc: isinstance(exc, OSError), sleep=waits.append, **kwargs):  # type: ignore[arg-type]
            with attempt:
                tries += 1
                raise OSError(f"try {tries}")
    except OSError as exc:
        return tries, waits, exc
    return tries, waits, None


def test_attempts_bound_the_tries_and_the_last_failure_comes_out_as_itself() -> None:
    tries, waits, exc = _count(attempts=3, first=0.25, jitter=0.0)
    assert tries == 3 and str(exc) == "try 3"
    assert waits == [0.25, 0.5]  # doubling from the first wait


def test_waits_are_capped_and_a_hint_wins_up_to_three_times_the_cap() -> None:
    _, waits, _ = _count(attempts=6, first=1.0, most=4.0, jitter=0.0)
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]
    _, waits, _ = _count(attempts=3, most=2.0, hint=lambda exc: 100.0)
    assert waits == [6.0, 6.0]


def test_a_failure_it_is_not_told_to_retry_leaves_at_once() -> None:
    tries = 0
    with pytest.raises(ValueError):
        for attempt in retrying(lambda exc: isinstance(exc, OSError), attempts=5, sleep=lambda s: None):
            with attempt:
                tries += 1
                raise ValueError("no")
    assert tries == 1


def test_stopped_ends_an_unbounded_retry() -> None:
    stop = threading.Event()
    tries = 0

    def sleep(seconds: float) -> None:
        if tries >= 4:
            stop.set()

    with pytest.raises(OSError):
        for attempt in retrying(lambda exc: True, stopped=stop.is_set, sleep=sleep):
            with attempt:
                tries += 1
                raise OSError("down")
    assert tries == 5


def test_a_success_after_failures_returns_normally() -> None:
    seen: list[int] = []
    for attempt in retrying(
        lambda exc: True, attempts=5, sleep=lambda s: None, before_sleep=lambda e, n: seen.append(n)
    ):
        with attempt:
            if len(seen) < 2:
                raise OSError
    assert seen == [1, 2]
