"""A small TCP proxy on 127.0.0.1 with switchable network faults, for tests.

    proxy = FaultProxy(hub.port).start()          # an asyncio loop in a daemon thread
    client = SyncClient(proxy.url, ...)            # the SDK talks to the hub through it
    proxy.cut(after=45_000_000, match="/updates/") # the next matching request dies mid-body
    proxy.cut_response(after=1_000_000, match="/model")  # ... or mid-response (a download)
    proxy.stall(seconds=5, match="/updates/")      # its response is held, then the link drops
    proxy.throttle(200_000, match="/updates/")     # bytes/s, both ways, matching requests only
    proxy.reset_on_connect(times=3)                # the next 3 connections get a TCP reset
    proxy.drop_connections()                       # reset every open one (a NAT forgetting flows)
    proxy.requests                                 # what went through: method, path, body bytes

It speaks just enough HTTP/1.1 to frame requests (Content-Length or chunked bodies, keep-alive),
so a fault hits one request even when httpx reuses a connection, and so it can count the body
bytes each request really delivered to the hub: the tests' measure of what was re-sent.
A request is matched by a substring of ``"METHOD /path?query"``. Each one-shot fault applies to
the next ``times`` matching requests (or connections) and then disarms itself. Responses are
passed through unparsed (requests on one connection are sequential: httpx does not pipeline).

A cut closes the hub side with a FIN, so the hub reads every byte that was forwarded and then
sees the client gone, and resets the client side, as a dropped link looks to the SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

__all__ = ["FaultProxy", "ProxiedRequest"]

_PIECE = 64 * 1024  # forwarding granularity: keeps throttling smooth and cuts exact


@dataclass
class ProxiedRequest:
    """One request seen by the proxy."""

    method: str
    target: str  # path and query
    head: str = ""  # request line and headers, lower-cased
    body_bytes: int = 0  # body (payload, without chunk framing) forwarded to the hub
    response_bytes: int = 0  # bytes of the response forwarded to the client
    status: int | None = None  # the hub's answer, if it gave one
    fault: str = ""  # the fault that hit it, if any
    started: float = field(default_factory=time.monotonic)
    done: bool = False  # its whole body reached the hub

    def matches(self, pattern: str) -> bool:
        return pattern in f"{self.method} {self.target}"


@dataclass
class _Rule:
    kind: str  # cut | cut_response | stall | reset
    match: str
    times: int
    after: int = 0  # cut: body bytes to forward first
    seconds: float = 0.0  # stall: how long to hold the response
    header: str = ""  # only requests whose lower-cased head holds this


class _Closed(Exception):
    """The connection is over (a fault ended it, or a side closed it)."""


class FaultProxy:
    """``127.0.0.1:<port>`` -> ``upstream``; faults are switched on from any thread."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.requests: list[ProxiedRequest] = []
        self.connections = 0
        self._rules: list[_Rule] = []
        self._throttle: tuple[float, str] | None = None
        self._lock = threading.RLock()  # _take may _consume under it
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # ---- life --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._run(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, coro: Awaitable[object]) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    # ---- faults ------------------------------------------------------------------------
    def cut(self, after: int, match: str = "", times: int = 1) -> None:
        """Forward ``after`` body bytes of the next matching request, then drop the link."""
        self._add(_Rule("cut", match, times, after=after))

    def cut_response(self, after: int, match: str = "", times: int = 1) -> None:
        """Pass ``after`` bytes of the next matching response (headers included), then drop
        the link: a download cut part way. Shorter answers (a 204 to a long poll) pass, and
        leave the fault armed."""
        self._add(_Rule("cut_response", match, times, after=after))

    def stall(self, seconds: float, match: str = "", times: int = 1, header: str = "") -> None:
        """Let the next matching request through, hold its response ``seconds``, then drop
        the link: the hub did the work, the client never hears of it (set ``seconds`` above
        the client's timeout). ``header``: only a request whose lower-cased head holds it."""
        self._add(_Rule("stall", match, times, seconds=seconds, header=header))

    def reset_on_connect(self, times: int = 1) -> None:
        """Answer the next ``times`` connections with a TCP reset."""
        self._add(_Rule("reset", "", times))

    def drop_connections(self) -> None:
        """Reset every open connection now, both sides (a router or NAT that forgot its flows)."""

        async def drop() -> None:
            for writer in list(self._writers):
                _reset(writer)

        self._run(drop())

    def throttle(self, bytes_per_second: float | None, match: str = "") -> None:
        """Slow the bodies and responses of matching requests (None: full speed)."""
        with self._lock:
            self._throttle = None if bytes_per_second is None else (bytes_per_second, match)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._throttle = None

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _take(self, kind: str, request: ProxiedRequest | None, consume: bool = True) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.kind == kind and (
                    request is None or (request.matches(rule.match) and rule.header in request.head)
                ):
                    if consume:
                        self._consume(rule)
                    return rule
        return None

    def _consume(self, rule: _Rule) -> bool:
        """Use one shot of ``rule``; False if it is already spent."""
        with self._lock:
            if rule not in self._rules:
                return False
            rule.times -= 1
            if rule.times <= 0:
                self._rules.remove(rule)
            return True

    def _rate(self, request: ProxiedRequest | None) -> float | None:
        with self._lock:
            if self._throttle is None or request is None or not request.matches(self._throttle[1]):
                return None
            return self._throttle[0]

    # ---- observations ------------------------------------------------------------------
    def matching(self, match: str) -> list[ProxiedRequest]:
        with self._lock:
            return [r for r in self.requests if r.matches(match)]

    def body_bytes(self, match: str) -> int:
        """Body bytes that matching requests delivered to the hub, all attempts together."""
        return sum(r.body_bytes for r in self.matching(match))

    # ---- the proxy ---------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self._take("reset", None):
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:  # the hub is down: the client sees its connection reset, as it would
            _reset(writer)
            return
        self._writers |= {writer, up_writer}
        conn = _Connection(self, reader, writer, up_reader, up_writer)
        try:
            await conn.run()
        finally:
            self._writers -= {writer, up_writer}


class _Connection:
    """One client connection and its hub connection."""

    def __init__(
        self,
        proxy: FaultProxy,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        self.proxy = proxy
        self.reader, self.writer = reader, writer
        self.up_reader, self.up_writer = up_reader, up_writer
        self.current: ProxiedRequest | None = None  # the request whose response is due
        self.hold: float = 0.0  # stall: seconds to hold the next response
        self.cut_response: _Rule | None = None  # armed for the current request's response

    async def run(self) -> None:
        upstream = asyncio.ensure_future(self._requests())
        downstream = asyncio.ensure_future(self._responses())
        _, pending = await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(upstream, downstream, return_exceptions=True)
        for w in (self.writer, self.up_writer):
            w.transport.abort()

    # client -> hub: framed request by request
    async def _requests(self) -> None:
        try:
            while True:
                try:
                    head = await self.reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.up_writer.close()
                    return
                request = _parse_head(head)
                with self.proxy._lock:
                    self.proxy.requests.append(request)
                self.current = request
                stall = self.proxy._take("stall", request)
                if stall:
                    request.fault, self.hold = "stall", stall.seconds
                cut = self.proxy._take("cut", request)
                if cut:
                    request.fault = "cut"
                self.cut_response = self.proxy._take("cut_response", request, consume=False)
                self.up_writer.write(head)
                await self._body(request, head, cut.after if cut else None)
                request.done = True
        except _Closed:
            return

    async def _body(self, request: ProxiedRequest, head: bytes, cut_after: int | None) -> None:
        headers = head.decode("latin-1").lower()
        if "transfer-encoding: chunked" in headers:
            while True:
                line = await self._read_line()
                size = int(line.split(b";")[0], 16)
                self.up_writer.write(line)
                if size == 0:
                    while (trailer := await self._read_line()) != b"\r\n":
                        self.up_writer.write(trailer)
                    self.up_writer.write(b"\r\n")
                    await self.up_writer.drain()
                    return
                await self._forward_payload(request, size, cut_after)
                self.up_writer.write(await self._read_exactly(2))
        else:
            length = 0
            for line in headers.split("\r\n"):
                if line.startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            await self._forward_payload(request, length, cut_after)

    async def _forward_payload(self, request: ProxiedRequest, size: int, cut_after: int | None) -> None:
        while size:
            piece = min(size, _PIECE)
            if cut_after is not None:
                piece = min(piece, cut_after - request.body_bytes)
                if piece <= 0:
                    await self._cut()
            data = await self._read_exactly(piece)
            self.up_writer.write(data)
            await self.up_writer.drain()
            request.body_bytes += len(data)
            size -= len(data)
            await self._pace(request, len(data))
        if cut_after is not None and request.body_bytes >= cut_after:
            await self._cut()

    async def _cut(self) -> None:
        """FIN to the hub (it keeps what arrived), RST to the client."""
        with contextlib.suppress(OSError):
            await self.up_writer.drain()
        self.up_writer.close()
        _reset(self.writer)
        raise _Closed

    async def _read_line(self) -> bytes:
        try:
            return await self.reader.readuntil(b"\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.up_writer.close()
            raise _Closed from None

    async def _read_exactly(self, n: int) -> bytes:
        try:
            return await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.up_writer.close()  # the client died mid-body: the hub sees it go away
            raise _Closed from None

    async def _pace(self, request: ProxiedRequest | None, nbytes: int) -> None:
        rate = self.proxy._rate(request)
        if rate:
            await asyncio.sleep(nbytes / rate)

    # hub -> client: passed through, paced and held as the current request asks
    async def _responses(self) -> None:
        while True:
            try:
                data = await self.up_reader.read(_PIECE)
            except ConnectionError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    await self.writer.drain()
                self.writer.close()
                return
            request = self.current
            if request is not None and request.status is None and data.startswith(b"HTTP/1.1 "):
                request.status = int(data[9:12])
            if self.hold:
                await asyncio.sleep(self.hold)
                _reset(self.writer)
                self.up_writer.close()
                return
            rule = self.cut_response
            if (
                rule is not None
                and request is not None
                and request.response_bytes + len(data) >= rule.after
                and self.proxy._consume(rule)
            ):
                request.fault = "cut_response"
                data = data[: rule.after - request.response_bytes]
                self.writer.write(data)
                request.response_bytes += len(data)
                with contextlib.suppress(OSError):
                    await self.writer.drain()
                self.writer.close()  # a FIN, so that the bytes sent do arrive, then nothing
                self.up_writer.close()
                return
            self.writer.write(data)
            if request is not None:
                request.response_bytes += len(data)
            try:
                await self.writer.drain()
            except ConnectionError:
                self.up_writer.close()
                return
            await self._pace(request, len(data))


def _parse_head(head: bytes) -> ProxiedRequest:
    text = head.decode("latin-1")
    method, target, *_ = text.split("\r\n", 1)[0].split(" ")
    return ProxiedRequest(method, target, text.lower())


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped link or a refusing box does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
