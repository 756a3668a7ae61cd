"""Connection deadlines, installed by the hub itself on the uvicorn server that runs it (what one
client can hold, and why: docs/SECURITY.md; the failures they end: docs/RELIABILITY.md, 7).

``GuardedHttpTools`` (uvicorn's httptools protocol, which has no cap on header bytes) gives every
request ``header_seconds`` for its line and headers, from the connection's start or the previous
answer's end, and at most ``max_header_bytes`` of them; past either it answers ``408``/``431`` in
the hub's JSON error shape (when any byte came) and closes. The rest of a body the hub answered
before reading it is not counted as headers, but must arrive before the deadline too.

The lifespan installs it (:func:`guard_uvicorn`), so it holds under ``syncserver serve`` and plain
``uvicorn syncserver.app:app`` alike (*was*: ``serve`` only). uvicorn offers no hook (``--http`` is
read before the app exists), but it runs the lifespan from the object that holds its ``Config`` and
makes each connection's protocol from that ``Config`` when it comes: the guard is put there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable
from http import HTTPStatus
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

__all__ = ["MAX_HEADER_BYTES", "end_polls_on_exit", "guard_uvicorn"]

log = logging.getLogger(__name__)

#: Request line + headers. The hub's own are under 1 KiB (a token, a digest, 4 KiB of metrics at most).
MAX_HEADER_BYTES = 64 * 1024
#: When the deadline finds nothing received, one more look after this long: a loop stalled past
#: the deadline runs its timers before it reads the sockets, and bytes that did come would be
#: taken for silence (a silent close instead of the 408; seen under a loaded test suite).
LAST_LOOK_SECONDS = 0.1


def end_polls_on_exit(end_polls: Callable[[], None]) -> Callable[[], None]:
    """Call ``end_polls`` (in the event loop) on SIGINT and SIGTERM, before the server's own
    handler; return the undo. On a signal uvicorn waits for every request in flight, and a hub's
    long polls are held up to ``long_poll_seconds`` (a hub with one reducer took 2.6 s to stop
    instead of 0.2, one with waiting peers up to 20 s). uvicorn has no "stopping" hook, but installs
    its handlers before the lifespan starts: the app chains its own in front. In a thread (a
    server run by a test) there are no signals to chain."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    chained: dict[signal.Signals, Callable[[int, FrameType | None], object]] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if not callable(handler):
            continue  # the default action or ignored: no server stops gracefully on this one

        def first_end_polls(signum: int, frame: FrameType | None, handler: Callable[..., object] = handler) -> None:
            loop.call_soon_threadsafe(end_polls)
            handler(signum, frame)

        chained[sig] = handler
        signal.signal(sig, first_end_polls)

    def undo() -> None:
        for sig, handler in chained.items():
            signal.signal(sig, handler)

    return undo


def guard_uvicorn(header_seconds: float, idle_seconds: float, max_header_bytes: int = MAX_HEADER_BYTES) -> str:
    """Put the deadlines on the uvicorn server whose lifespan calls this, before it listens
    (``idle_seconds`` replaces uvicorn's ``--timeout-keep-alive``). Returns what holds, for the
    startup log; what cannot hold is logged as a warning."""
    config = _running_config()
    if config is None:
        log.warning(
            "not run by uvicorn: the hub cannot bound how long a connection is held (no header or idle "
            "deadline); run it with `syncserver serve` or `uvicorn syncserver.app:app`"
        )
        return "no connection deadlines (not uvicorn)"
    config.timeout_keep_alive = idle_seconds  # type: ignore[assignment]  # a float works (call_later)
    config.h11_max_incomplete_event_size = max_header_bytes
    protocol = config.http_protocol_class
    httptools = sys.modules.get("uvicorn.protocols.http.httptools_impl")  # loaded if it is the one
    if httptools is not None and protocol is httptools.HttpToolsProtocol:
        config.http_protocol_class = _guarded(header_seconds, max_header_bytes)
        return f"headers within {header_seconds:g} s and {max_header_bytes} bytes, idle {idle_seconds:g} s"
    log.warning(
        "HTTP protocol %s: no deadline on request headers, only a cap on their size and the idle deadline; "
        "run uvicorn with httptools (its default with uvicorn[standard]; not --http h11)",
        protocol.__name__,
    )
    return f"idle {idle_seconds:g} s, headers up to {max_header_bytes} bytes, no header deadline"


def _running_config() -> uvicorn.Config | None:
    """The ``Config`` of the uvicorn server whose lifespan runs this call, or None: its
    ``LifespanOn`` awaits the app's lifespan, so it is on the chain of frames, whatever middleware
    sits between."""
    try:
        from uvicorn.lifespan.on import LifespanOn
    except ImportError:  # not served by uvicorn at all
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, LifespanOn):
            return owner.config
        frame = frame.f_back
    return None


def _guarded(header_seconds: float, max_header_bytes: int) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpTools(HttpToolsProtocol):
        """httptools with a deadline and a cap on each request's headers (see the module)."""

        _timer: asyncio.TimerHandle | None = None
        _header_bytes = 0  # bytes that came while the deadline ran, outside a request's body
        _in_body = False  # between a request's headers and the end of its body
        _last_look = False  # the deadline passed with nothing received; looking once more

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # The rest of a body the hub answered before reading it (a refusal) is body, not the next
            # request's headers: not counted (a chunk that ends a body and starts headers is not
            # counted either: the cap may be passed by one read, never reached by a body).
            counted = self._timer is not None and not self._in_body
            if counted:
                self._header_bytes += len(data)
            super().data_received(data)
            if (
                counted
                and self._timer is not None
                and self._header_bytes > max_header_bytes
                and not self.transport.is_closing()
            ):
                self._refuse(431, "headers_too_large", f"request headers are over {max_header_bytes} bytes")

        def on_headers_complete(self) -> None:
            self._stop_timer()
            self._in_body = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # the next request's headers are in already
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                # from here the client has the deadline to send the rest of an unread body (if the
                # answer came first) and the next request's headers
                self._await_headers()

        def _await_headers(self) -> None:
            self._stop_timer()
            self._header_bytes, self._last_look = 0, False
            self._timer = self.loop.call_later(header_seconds, self._too_slow)

        def _stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if self._header_bytes == 0 and not self._in_body and not self._last_look:
                self._last_look = True  # let the loop read what may have come meanwhile
                self._timer = self.loop.call_later(LAST_LOOK_SECONDS, self._too_slow)
                return
            if self._header_bytes == 0 or self._in_body:
                # nothing asked (closed as an idle keep-alive is), or the rest of a body already
                # answered: a 408 would be read as the answer to a request not yet sent
                self.transport.close()
            else:
                self._refuse(408, "request_timeout", f"request headers did not arrive within {header_seconds:g} s")

        def _refuse(self, status: int, code: str, detail: str) -> None:
            self._stop_timer()
            body = json.dumps({"error": code, "detail": detail}).encode()
            head = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    return GuardedHttpTools
