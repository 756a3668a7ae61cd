"""The two daemon threads that keep a peer's standing with the hub while it trains, so that the
training thread never waits on the network for them: the lease (:class:`Heartbeat`) and, in runs
whose rounds close on a sample count, the peer's progress (:class:`ProgressReporter`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from syncclient.exceptions import RoundClosed, StaleUpdate, SyncError
from syncclient.transport import Transport

__all__ = ["Heartbeat", "ProgressReporter"]

log = logging.getLogger(__name__)


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
    """Renews a peer's lease while the user trains for minutes between syncs: one POST every
    third of the lease, one try each (the next beat is the retry)."""

    def __init__(self, transport: Transport, path: str, *, lease: float, run: str, peer: str) -> None:
        self._transport, self._path, self._lease, self._run = transport, path, lease, run
        super().__init__(self._beat, f"weightsync-heartbeat-{peer}")

    def _beat(self) -> None:
        failures = 0
        while not self._stop.wait(self._lease / 3):
            try:
                self._transport.call("POST", self._path, retry=False, timeout=10)
                failures = 0
            except SyncError:
                failures += 1
            except RuntimeError:  # client closed under us
                return
            if failures == 3:
                log.warning("run %s: heartbeats are failing; the hub may drop this peer", self._run)


class ProgressReporter(_Daemon):
    """Samples runs: reports the peer's sample count of its open round (``version()``) and hears
    when the round is due. A new count goes out at once (at most every ``REPORT_SECONDS``, one
    request at a time), so the hub's sum lags by about a round trip; with nothing new to say it
    long-polls for ``poll`` seconds, so that it hears the round is due while the peer is in the
    middle of a long step. While ``syncing()``, the round is no longer the peer's to report."""

    REPORT_SECONDS = 0.05

    def __init__(
        self,
        transport: Transport,
        path: str,
        *,
        poll: float,
        version: Callable[[], int],
        syncing: Callable[[], bool],
        run: str,
        peer: str,
    ) -> None:
        self._transport, self._path, self._poll, self._run = transport, path, poll, run
        self._version, self._syncing = version, syncing
        self._lock = threading.Lock()
        self.count = 0  # samples since the last sync began
        self._paused = False  # a sync is under way
        self._due_round = -1  # the round the hub said was due
        super().__init__(self._report, f"weightsync-progress-{peer}")

    def add(self, samples: int) -> None:
        with self._lock:
            self.count += samples

    def sent(self) -> None:
        """A sync began with what was counted: count afresh, and report again once it is done."""
        with self._lock:
            self.count, self._paused = 0, True

    def due(self, version: int) -> bool:
        return self._due_round == version

    def _report(self) -> None:
        said = (-1, -1)
        while not self._stop.is_set():
            with self._lock:
                round_, count = self._version(), self.count
                if self._paused and not self._syncing():
                    self._paused = False
                paused = self._paused
            if paused or self._due_round == round_:
                self._stop.wait(0.02)  # nothing to say until the sync is done
                continue
            news = (round_, count) != said
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
                self._stop.wait(self.REPORT_SECONDS)
