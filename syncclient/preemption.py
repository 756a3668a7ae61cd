"""Spot and preemptible VMs: hear the notice a cloud gives before it takes the machine.

Clouds warn. AWS posts a spot interruption notice two minutes ahead (IMDSv2,
``/latest/meta-data/spot/instance-action``: ``{"action": "terminate", "time": "...Z"}``); GCP sets
``instance/preempted`` to ``TRUE`` about 30 s ahead, then shuts the VM down (SIGTERM to its
processes); Azure posts a ``Preempt`` scheduled event (``/metadata/scheduledevents``, 30 s ahead at
least). A :class:`Watch` hears one of them, or SIGTERM, and holds the :class:`Notice`; the client
acts on it on the training thread, at the next step it is told of (``SyncClient.progress``): it
hands in what it trained since its last sync as its update of the open round, waits for the
acknowledgement within the notice's time, leaves (the round closes without waiting for it) and
ends the program with :class:`Preempted`. If no step comes in time (a long evaluation), the watch
leaves the run itself just before the notice runs out, so the other peers never wait for a machine
that is gone.

Which notices (``preemption=``, or ``WEIGHTSYNC_PREEMPTION``: the machine's own setting, like the
cloud's ``AWS_*`` variables): ``auto`` (default) asks each provider's metadata server once, in the
background, and watches the one that answers (none answers: SIGTERM alone, quietly); ``aws``,
``gcp``, ``azure``: that one (said once if it does not answer); ``sigterm``: SIGTERM alone;
``off``: nothing, and SIGTERM ends the process at once as it would without weightsync.
``metadata_url`` (``WEIGHTSYNC_METADATA_URL``): where the metadata server is,
``http://169.254.169.254`` on all three clouds.

SIGTERM is heard only where the program left it at its default (a program, or a launcher such as
Lightning's on SLURM, with a handler of its own keeps it), and a second SIGTERM ends the process at
once. One process per peer: a process group's leader keeps leaving at exit (syncclient.group).
"""

from __future__ import annotations

import datetime
import email.utils
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import httpx  # imported when a watch starts polling: the hooks' settings read MODES from here

__all__ = ["MODES", "Notice", "Preempted", "Watch", "metadata_base", "preemption_mode"]

log = logging.getLogger(__name__)

MODES = ("auto", "aws", "gcp", "azure", "sigterm", "off")
METADATA_URL = "http://169.254.169.254"
POLL_SECONDS = 2.0  # AWS asks for every 5 s; Azure and GCP notices come 30 s ahead
PROBE_SECONDS = 1.0  # a metadata server answers in milliseconds; none on a laptop
SIGTERM_SECONDS = 30.0  # GCP's shutdown and Kubernetes' default grace before SIGKILL
LEAVE_MARGIN = 3.0  # seconds before a notice runs out that the watch leaves for a peer that never stepped
EXIT_CODE = 128 + signal.SIGTERM  # what the shell says of a process ended by SIGTERM


@dataclass(frozen=True)
class Notice:
    """The machine goes at ``deadline`` (``time.monotonic()``); ``source``: aws, gcp, azure or sigterm."""

    source: str
    deadline: float
    detail: str

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Preempted(SystemExit):
    """The machine is being taken: this peer handed in its work and left. Exits 143, as SIGTERM
    would; catch it to save a checkpoint first. ``handed_in``: the samples acknowledged (0: none
    were trained since the last sync, or they did not reach the hub in time)."""

    def __init__(self, notice: Notice, handed_in: int, round_: int) -> None:
        super().__init__(EXIT_CODE)
        self.notice, self.handed_in, self.round = notice, handed_in, round_

    def __str__(self) -> str:
        said = f"handed in {self.handed_in} samples to round {self.round}" if self.handed_in else "nothing to hand in"
        return f"preempted ({self.notice.source}: {self.notice.detail}): {said}, left the run"


def preemption_mode(mode: str | None) -> str:
    """``mode``, or the machine's ``WEIGHTSYNC_PREEMPTION``, or ``auto``; ValueError if unknown."""
    mode = mode or os.environ.get("WEIGHTSYNC_PREEMPTION") or "auto"
    if mode not in MODES:
        raise ValueError(f"preemption must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def metadata_base(url: str | None) -> str:
    """``url``, or the machine's ``WEIGHTSYNC_METADATA_URL``, or :data:`METADATA_URL`, without a
    trailing slash; ValueError if it is not an http:// URL."""
    url = url or os.environ.get("WEIGHTSYNC_METADATA_URL") or METADATA_URL
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the metadata server must be an http:// URL, got {url!r}")
    return url.rstrip("/")


# ---- the providers ------------------------------------------------------------------------------


class Provider(Protocol):
    name: str

    def probe(self, http: httpx.Client, base: str) -> bool: ...

    def check(self, http: httpx.Client, base: str) -> Notice | None: ...


class Aws:
    """IMDSv2: a session token (PUT), then ``spot/instance-action``: 404 until the notice."""

    name = "aws"
    TOKEN = "/latest/api/token"
    ACTION = "/latest/meta-data/spot/instance-action"

    def __init__(self) -> None:
        self._token = ""

    def probe(self, http: httpx.Client, base: str) -> bool:
        answer = http.put(base + self.TOKEN, headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
        self._token = answer.text if answer.status_code == 200 else ""
        return bool(self._token)

    def check(self, http: httpx.Client, base: str) -> Notice | None:
        answer = http.get(base + self.ACTION, headers={"X-aws-ec2-metadata-token": self._token})
        if answer.status_code == 401:  # the token expired: a new one for the next look
            self.probe(http, base)
            return None
        if answer.status_code == 404:
            return None
        answer.raise_for_status()
        body = answer.json()
        when = datetime.datetime.fromisoformat(body["time"].replace("Z", "+00:00"))
        return _notice(self.name, when, f"spot instance-action {body['action']} at {body['time']}", 120.0)


class Gcp:
    """``instance/preempted``: ``FALSE`` until the notice (the header proves it is Google's)."""

    name = "gcp"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata-Flavor": "Google"}

    def probe(self, http: httpx.Client, base: str) -> bool:
        answer = http.get(base + self.PATH, headers=self.HEADERS)
        return answer.status_code == 200 and answer.headers.get("Metadata-Flavor") == "Google"

    def check(self, http: httpx.Client, base: str) -> Notice | None:
        answer = http.get(base + self.PATH, headers=self.HEADERS)
        answer.raise_for_status()
        return _notice(self.name, None, "instance/preempted is TRUE", 30.0) if answer.text.strip() == "TRUE" else None


class Azure:
    """Scheduled events: a ``Preempt`` event with its ``NotBefore`` (an HTTP date, or empty)."""

    name = "azure"
    PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata": "true"}

    def probe(self, http: httpx.Client, base: str) -> bool:
        answer = http.get(base + self.PATH, headers=self.HEADERS)
        return answer.status_code == 200 and "Events" in answer.json()

    def check(self, http: httpx.Client, base: str) -> Notice | None:
        answer = http.get(base + self.PATH, headers=self.HEADERS)
        answer.raise_for_status()
        for event in answer.json()["Events"]:
            if event.get("EventType") == "Preempt":
                when = email.utils.parsedate_to_datetime(event["NotBefore"]) if event.get("NotBefore") else None
                return _notice(self.name, when, f"Preempt event {event.get('EventId', '?')}", 30.0)
        return None


PROVIDERS: dict[str, Callable[[], Provider]] = {"aws": Aws, "gcp": Gcp, "azure": Azure}


def _notice(source: str, when: datetime.datetime | None, detail: str, default: float) -> Notice:
    """A notice for ``when`` (wall clock, as the provider says it), or ``default`` seconds from now."""
    left = default if when is None else (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    return Notice(source, time.monotonic() + max(0.0, left), detail)


# ---- SIGTERM: one handler per process, for every watch ------------------------------------------


class _Sigterm:
    """The process's SIGTERM handler while a watch wants it: each live watch hears a notice; with
    none (all stopped), or at a second SIGTERM, the signal does what it did before: end the process."""

    def __init__(self) -> None:
        self.watches: weakref.WeakSet[Watch] = weakref.WeakSet()
        self.installed = False
        self.pid = 0  # the process that installed it (a forked DataLoader worker inherits the handler)

    def add(self, watch: Watch) -> None:
        if not self.installed:
            if threading.current_thread() is not threading.main_thread():
                return  # only the main thread may set a handler: SIGTERM keeps its default
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # the program's own handler stays
            signal.signal(signal.SIGTERM, self._heard)
            self.installed, self.pid = True, os.getpid()
        self.watches.add(watch)

    def discard(self, watch: Watch) -> None:
        self.watches.discard(watch)

    def _heard(self, signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        self.installed = False
        watches = [w for w in self.watches if not w.stopped] if os.getpid() == self.pid else []
        if not watches:
            os.kill(os.getpid(), signal.SIGTERM)  # nobody to hand in: end as without weightsync
            return
        for watch in watches:
            watch.heard(Notice("sigterm", time.monotonic() + SIGTERM_SECONDS, "SIGTERM"))


_SIGTERM = _Sigterm()


class Watch:
    """Listens for this peer's end (see the module docstring) from join to leave.

    ``leave``: called on the watch's thread if a notice is about to run out and the training thread
    has not claimed it (:meth:`claim`: it hands in); :attr:`abandoned` then says so."""

    def __init__(self, mode: str, leave: Callable[[], None], metadata_url: str | None = None) -> None:
        self.mode = preemption_mode(mode)
        self.base = metadata_base(metadata_url)
        self.notice: Notice | None = None
        self.stopped = False
        self.watching: str | None = None  # the provider found (None: SIGTERM alone, or not yet)
        self.abandoned = False  # the notice ran out unclaimed: the watch left the run for the peer
        self._leave, self._claimed = leave, False
        self._lock = threading.RLock()  # RLock: SIGTERM's handler runs on the main thread, maybe inside claim()
        self._stop = threading.Event()
        if self.mode == "off":
            return
        _SIGTERM.add(self)
        names = list(PROVIDERS) if self.mode == "auto" else [self.mode] if self.mode in PROVIDERS else []
        if names:
            threading.Thread(target=self._poll, args=(names,), name="weightsync-preemption", daemon=True).start()

    def heard(self, notice: Notice) -> None:
        """A notice: the first one stands; the watch leaves for the peer if nobody claims it in time."""
        with self._lock:
            if self.notice is not None or self.stopped:
                return
            self.notice = notice
        log.warning("preemption notice (%s: %s): %.0f s left", notice.source, notice.detail, notice.left())
        timer = threading.Timer(max(0.0, notice.left() - LEAVE_MARGIN), self._too_late)
        timer.daemon = True
        timer.start()

    def claim(self) -> Notice | None:
        """The training thread takes the notice to hand in (None: no notice, or the watch left already)."""
        with self._lock:
            if self.notice is None or self._claimed:
                return None
            self._claimed = True
            return self.notice

    def stop(self) -> None:
        self.stopped = True
        self._stop.set()
        _SIGTERM.discard(self)

    def _too_late(self) -> None:
        with self._lock:
            if self._claimed or self.stopped:
                return
            self._claimed = self.abandoned = True
        log.warning("the training thread did not step before the notice ran out: leaving the run without a hand-in")
        self._leave()
        held = self.notice is not None and self.notice.source == "sigterm"
        if held and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGTERM)  # the SIGTERM we held: it ends the process, as without weightsync

    def _poll(self, names: list[str]) -> None:
        """Find the provider (once), then ask it every :data:`POLL_SECONDS` until a notice or :meth:`stop`."""
        import httpx

        with httpx.Client(timeout=PROBE_SECONDS, trust_env=False) as http:
            provider = next((p for p in (PROVIDERS[n]() for n in names) if _answers(p, http, self.base)), None)
            if provider is None:
                if self.mode != "auto":
                    log.warning("no %s metadata server answers at %s: watching SIGTERM alone", self.mode, self.base)
                return
            self.watching = provider.name
            log.info("watching %s's preemption notices at %s", provider.name, self.base)
            failing = False
            while not self._stop.is_set():
                try:
                    notice = provider.check(http, self.base)
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                    if not failing:
                        log.warning("the %s metadata server failed (%s); asking again", provider.name, exc)
                    notice, failing = None, True
                else:
                    failing = False
                if notice is not None:
                    self.heard(notice)
                    return
                self._stop.wait(POLL_SECONDS)


def _answers(provider: Provider, http: httpx.Client, base: str) -> bool:
    import httpx

    try:
        return provider.probe(http, base)
    except (httpx.HTTPError, ValueError):
        return False
