"""The one way the product tries a request again: capped exponential backoff with jitter.

Every HTTP loop of the hub, the reducers and the SDK goes through :func:`retrying` (tenacity
underneath), so all are waited on the same way and none spins; the last failure leaves as itself
(not a tenacity ``RetryError``)::

    for attempt in retrying(lambda exc: isinstance(exc, httpx.TransportError), attempts=3):
        with attempt:
            response = http.get(url)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, stop_any
from tenacity import stop_never as never
from tenacity.stop import stop_base

__all__ = ["retrying"]


def retrying(
    when: Callable[[BaseException], bool],
    *,
    attempts: int | None = None,
    seconds: float | None = None,
    first: float = 0.25,
    most: float = 20.0,
    jitter: float | None = None,
    hint: Callable[[BaseException], float | None] | None = None,
    sleep: Callable[[float], Any] = time.sleep,
    stopped: Callable[[], bool] | None = None,
    before_sleep: Callable[[BaseException, int], None] | None = None,
) -> Retrying:
    """Tries of one request: again while ``when(exc)`` says the failure may pass.

    ``attempts``/``seconds``: give up after that many tries or that long (neither: until
    ``stopped()`` says so). Waits start at ``first`` seconds and double up to ``most``, plus up to
    ``jitter`` seconds at random (default ``first``: clients that failed together do not come back
    together). ``hint(exc)``: a wait the failure asked for (``Retry-After``), up to 3 x ``most``.
    ``sleep``: how to wait (an ``Event.wait`` lets a stop cut it short); ``before_sleep(exc,
    attempt)``: say so in the log.
    """
    spread = first if jitter is None else jitter

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        asked = hint(exc) if hint is not None and exc is not None else None
        if asked is not None:
            return min(asked, 3 * most)
        return min(most, first * 2.0 ** (state.attempt_number - 1)) + random.uniform(0, spread)

    stops: list[stop_base] = []
    if attempts is not None:
        stops.append(stop_after_attempt(attempts))
    if seconds is not None:
        stops.append(stop_after_delay(seconds))
    if stopped is not None:
        stops.append(_When(stopped))

    def said(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if before_sleep is not None and exc is not None:
            before_sleep(exc, state.attempt_number)

    return Retrying(
        retry=retry_if_exception(when),
        wait=wait,
        stop=stop_any(*stops) if stops else never,
        sleep=sleep,
        before_sleep=said,
        reraise=True,
    )


class _When(stop_base):
    """Stop once ``stopped()`` says so (a reducer told to stop, say)."""

    def __init__(self, stopped: Callable[[], bool]) -> None:
        self.stopped = stopped

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.stopped()
