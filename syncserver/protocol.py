"""uvicorn's HTTP protocol (httptools) with a deadline and a size cap on request headers.

uvicorn closes a keep-alive connection that idles after an answer (``timeout_keep_alive``),
but one that never finishes its headers, or never sends a byte, is held forever: a few
hundred of them took the hub's file descriptors and ``/healthz`` failed. httptools, unlike
h11, has no cap on header bytes either. :class:`GuardedHttpTools` gives every request
``header_seconds`` for its request line and headers, counted from the connection's start or
the previous answer's end, and at most ``max_header_bytes`` of them; past either it answers
``408``/``431`` with the hub's JSON error shape (when any byte came) and closes the connection.
The rest of a body that the hub answered before reading it (a refusal) is not counted as
headers, but it too must arrive before the deadline. Once the headers are in, the hub's own
limits take over (body idle: a lease; long polls: ``long_poll_seconds``).

Used by ``syncserver serve`` (and so ``syncserver local``) through :func:`http_protocol`.
``uvicorn syncserver.app:app`` cannot load it (its ``--http`` takes a name); there,
``--timeout-keep-alive`` and ``--h11-max-incomplete-event-size`` with ``--http h11`` are what
uvicorn offers, and a reverse proxy should bound header reads (docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
import json
import logging

__all__ = ["MAX_HEADER_BYTES", "http_protocol"]

log = logging.getLogger(__name__)

#: Request line + headers. The hub's own are under 1 KiB (a token, a digest, 4 KiB of metrics at most).
MAX_HEADER_BYTES = 64 * 1024
#: When the deadline finds nothing received, one more look after this long: a loop stalled past
#: the deadline runs its timers before it reads the sockets, and bytes that did come would be
#: taken for silence (a silent close instead of the 408; seen under a loaded test suite).
LAST_LOOK_SECONDS = 0.1


def http_protocol(header_seconds: float, max_header_bytes: int = MAX_HEADER_BYTES) -> type[asyncio.Protocol] | str:
    """The protocol class for ``uvicorn.Config(http=...)``; ``"h11"`` if httptools is missing
    (then only uvicorn's ``h11_max_incomplete_event_size`` bounds the headers)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # uvicorn without [standard]
        log.warning("httptools is not installed: no deadline on request headers (pip install 'uvicorn[standard]')")
        return "h11"

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
            reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
            head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
            ]
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    return GuardedHttpTools
