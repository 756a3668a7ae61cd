"""The two daemon threads that keep a peer's standing with the hub while it trains, so that the
training thread never waits on the network for them: the lease (:class:`Heartbeat`) and the
peer's progress (:class:`ProgressReporter`: the round's sample count in samples runs, the hub's
samples ledger in all)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from syncclient.exceptions import RoundClosed, StaleUpdate, SyncError
from syncclient.transport import Transport

__all__ = ["Heartbeat", "ProgressReporter"]

log = logging.getLogger(__name__)

#: a held heartbeat's timeout beyond its hold: the hub answers at the hold's end, give or take a
#: busy event loop and a slow link
WATCH_MARGIN = 10.0


class _Daemon:
    """A named daemon thread running ``target`` until :meth:`stop`."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class Heartbeat(_Daemon):
    """The peer's lease and its watch, on a connection of its own (``transport``, owned): a beat the
    hub holds open for a third of the lease (or until it has news), asked again once answered. The
    held connection closing tells the hub, within its ``disconnect_grace``, that this process died;
    the lease, that a hung or vanished machine is gone. A failed beat is tried again at once, then
    after 0.1 s doubling to 1 s (a reset link is back well within the 1.5 s grace). A hub that does
    not hold it (``watch: false``) gets one beat every third of the lease.
    """

    #: the first waits after failed beats (the first retry goes at once); then 1 s
    RETRY_SECONDS = (0.0, 0.1, 0.2, 0.4, 0.8)

    def __init__(self, transport: Transport, path: str, *, lease: float, run: str, peer: str) -> None:
        self._transport, self._path, self._lease, self._run = transport, path, lease, run
        super().__init__(self._beat, f"weightsync-heartbeat-{peer}")

    def stop(self) -> None:
        """Stop now: the held request ends at once (its socket shut down; the hub sees the
        connection close), and the connection with it."""
        self._stop.set()
        self._transport.abort()
        super().stop()
        self._transport.close()

    def _beat(self) -> None:
        hold = self._lease / 3
        failures = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                answer = self._transport.call(
                    "POST", self._path, params={"wait": hold}, retry=False, timeout=hold + WATCH_MARGIN
                ).json()
            except SyncError as exc:
                if self._stop.is_set():
                    return
                failures += 1
                if failures == 3:
                    log.warning("run %s: heartbeats are failing (%s); the hub may drop this peer", self._run, exc)
                self._stop.wait(self.RETRY_SECONDS[failures - 1] if failures <= len(self.RETRY_SECONDS) else 1.0)
                continue
            except (RuntimeError, OSError, ValueError):  # stopped under us (its transport shut down)
                if self._stop.is_set():
                    return
                raise
            if failures >= 3:
                log.info("run %s: heartbeats are answered again", self._run)
            failures = 0
            took = time.monotonic() - started
            if not answer.get("watch", False):  # a hub that answers at once: beat every third of the lease
                self._stop.wait(max(0.0, hold - took))
            elif took < hold / 2:  # answered early: the hub is stopping (or we left); do not spin on it
                self._stop.wait(min(1.0, hold / 3))


class ProgressReporter(_Daemon):
    """Reports the peer's sample count (``count()``) since its last sync, for its open round
    (``version()``): the hub's ledger books it lost if no update of this peer carries it
    (syncserver/core/ledger.py). ``listen`` (samples runs): a new count goes out at once (at most
    every ``REPORT_SECONDS``, one request at a time), so the hub's sum lags by about a round trip;
    with nothing new it long-polls for ``poll`` seconds, to hear the round is due in the middle of
    a long step. Else a count that changed goes out every ``LEDGER_SECONDS``, and nothing when it
    did not. While ``syncing()``, the round is no longer the peer's to report."""

    REPORT_SECONDS = 0.05
    LEDGER_SECONDS = 2.0  # what a killed peer's ledger may miss: its last seconds of training

    def __init__(
        self,
        transport: Transport,
        path: str,
        *,
        poll: float,
        count: Callable[[], int],
        version: Callable[[], int],
        syncing: Callable[[], bool],
        run: str,
        peer: str,
        listen: bool = True,
    ) -> None:
        self._transport, self._path, self._poll, self._run = transport, path, poll, run
        self._listen, self._every = listen, self.REPORT_SECONDS if listen else self.LEDGER_SECONDS
        self._count, self._version, self._syncing = count, version, syncing
        self._lock = threading.Lock()
        self._paused = False  # a sync is under way
        self._due_round = -1  # the round the hub said was due
        super().__init__(self._report, f"weightsync-progress-{peer}")

    def pause(self) -> None:
        """A sync begins with what was counted: report again once it is done."""
        with self._lock:
            self._paused = True

    def due(self, version: int) -> bool:
        return self._due_round == version

    def _report(self) -> None:
        said = (-1, -1)
        while not self._stop.is_set():
            with self._lock:
                round_, count = self._version(), self._count()
                if self._paused and not self._syncing():
                    self._paused = False
                paused = self._paused
            news = (round_, count) != said
            if paused or self._due_round == round_ or not (self._listen or (news and count)):
                self._stop.wait(0.02 if self._listen else self._every)  # nothing to say yet
                continue
            try:
                answer = self._transport.call(
                    "POST",
                    self._path,
                    json={"round": round_, "samples": count},
                    params={"wait": 0 if news else self._poll},
                    retry=False,
                ).json()
            except (RoundClosed, StaleUpdate):
                self._due_round = round_  # the round closed without us: the next sync catches up
                continue
            except SyncError as exc:
                log.debug("run %s: progress report failed (%s); trying again", self._run, exc)
                self._stop.wait(1.0)
                continue
            except RuntimeError:  # client closed under us
                return
            said = (round_, count)
            if answer["due"]:
                self._due_round = round_
            elif news:
                self._stop.wait(self._every)
