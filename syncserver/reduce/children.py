"""``syncserver serve --reducers K``: K reducer processes on the hub's machine, started once the
hub listens, started again if one dies, and never left behind: each is killed by the kernel
when the thread that started it goes (``PR_SET_PDEATHSIG``), so a hub SIGKILLed takes its
reducers with it; a hub that stops cleanly stops them first."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading

__all__ = ["LocalReducers"]

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
RESTART_SECONDS = 1.0  # between a reducer's death and its restart


def _die_with_parent() -> None:  # in the child, between fork and exec
    with contextlib.suppress(OSError, AttributeError):  # not Linux: a clean stop still stops them
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalReducers:
    """K ``syncserver reduce`` children of this process, kept running until :meth:`stop`."""

    def __init__(self, count: int, token: str | None, threads: int = 1, store: str = "") -> None:
        self.count = count
        self.token = token
        self.store = store  # SYNC_STORE, which --store may have given: updates in the bucket are read there
        self.threads = threads  # each reducer's slice threads
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, hub: str) -> None:
        """Start them against ``hub`` from a thread that lives as long as they should (the kernel
        kills them when their starting thread exits)."""
        self._thread = threading.Thread(target=self._supervise, args=(hub,), daemon=True, name="reducers")
        self._thread.start()

    def _spawn(self, hub: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "SYNC_STORE": self.store}  # the AWS_* variables are the hub's own, inherited
        env.pop("SYNC_REDUCE_TOKEN", None)
        if self.token:
            env["SYNC_REDUCE_TOKEN"] = self.token  # not on the command line, which `ps` shows
        return subprocess.Popen(
            [sys.executable, "-m", "syncserver", "reduce", "--hub", hub, "--threads", str(self.threads)],
            env=env,
            preexec_fn=_die_with_parent,  # a prctl call only: safe between fork and exec
        )

    def _supervise(self, hub: str) -> None:
        self.procs = [self._spawn(hub) for _ in range(self.count)]
        log.info("reducers started: %d (pids %s)", self.count, ", ".join(str(p.pid) for p in self.procs))
        while not self._stop.wait(RESTART_SECONDS):
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    log.warning("reducer pid %d exited with %s: starting another", proc.pid, proc.returncode)
                    self.procs[i] = self._spawn(hub)
        for proc in self.procs:
            proc.terminate()  # a no-op for one that exited
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self) -> None:
        """Stop them and wait for them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
