"""Waiting for a change: the hub's one long poll. Every long poll (a peer's start, result, due
round and watch; a reducer's lease; the dashboard) is :func:`until`: look, and if what it waits
for is not there, sleep until a :class:`Changes` wakes it or the deadline passes. :class:`Tasks`
keeps the background work a request starts (a close, a version's file) until it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["Changes", "Tasks", "until"]


class Changes:
    """Wakes every waiter at each :meth:`notify` (a fresh event: a waiter waits for the next change)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None = None, also: asyncio.Future[Any] | None = None) -> None:
        """Until the next change (or ``also`` is done), at most ``timeout`` seconds."""
        news = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({news} if also is None else {news, also}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            news.cancel()


async def until(
    ready: Callable[[], bool],
    changes: Changes,
    seconds: float,
    stop: Callable[[], bool] = lambda: False,
    also: asyncio.Future[Any] | None = None,
    every: float = math.inf,
) -> bool:
    """Ask ``ready`` now and at each change (``also`` done, or every ``every`` seconds) until it says
    yes (True), or ``seconds`` pass or ``stop`` says the hub is stopping (False)."""
    deadline = time.monotonic() + seconds
    while not ready():
        remaining = deadline - time.monotonic()
        if remaining <= 0 or stop():
            return False
        await changes.wait(min(remaining, every), also)
    return True


class Tasks:
    """Background tasks, held until done (the event loop keeps only weak references to them)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        """Wait for every task (what failed or was cancelled was logged where it ran, or is moot)."""
        for task in list(self._tasks):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
