"""How the SDK talks to a hub: one httpx client, retries, resumable transfers, one error map.

Retries: connect errors, timeouts, 5xx, 429 and 503, with capped exponential backoff and jitter
(:func:`syncwire.retry.retrying`), honouring ``Retry-After``, for ``retry_seconds`` in all, then
:class:`~syncclient.exceptions.HubUnreachable`; the hub takes an upload once per (peer, round), so
a retry never applies one twice. A TLS setup error (an untrusted certificate, https:// to a
plain-HTTP hub) fails at once, saying what to do.

Uploads resume from the byte the hub holds (``HEAD``, then ``Upload-Offset``), downloads with
``Range`` and ``If-Range``. An update goes out while it encodes, so its digest follows the body:
the body with ``Upload-Key`` and ``Upload-Complete: ?0`` (held: 202), then an empty ``PUT`` from
its end with ``Content-Digest`` (docs/RELIABILITY.md, "Resumable uploads: the protocol"). One
round trip more, against the encode (0.6-1.3 s for GPT-2 on bench/RESULTS.md's VM) no longer
standing before the first byte.

Errors are translated in one place, :meth:`Transport._errors`, as httpx translates httpcore's
(``map_httpcore_exceptions``).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import logging
import os
import re
import secrets
import socket
import ssl
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import httpcore
import httpx
import numpy as np
from tenacity import Retrying
from tqdm.auto import tqdm

from syncclient.exceptions import (
    AuthError,
    ConflictError,
    HubError,
    HubUnreachable,
    NotFound,
    RoundClosed,
    StaleUpdate,
    SyncError,
)
from syncwire import StreamReader, iter_chunks
from syncwire.retry import retrying

__all__ = ["STORE_RETRY_SECONDS", "Digest", "Download", "OnTensor", "Parts", "Transport", "body_size"]

log = logging.getLogger(__name__)

_RETRY_STATUS = {429, 500, 502, 503, 504}
_PROGRESS_BYTES = 32 << 20  # transfers at least this big get a progress bar (at log level INFO)
_READ_BYTES = 1 << 20  # socket reads of a plain-HTTP connection (1 MiB beat 64 KiB, 256 KiB, 2 and 4 MiB)
#: How long a request to the object store is retried before the SDK turns to the hub instead (a
#: download falls back at once): a store that is down, or that only the hub reaches, should cost
#: a round seconds, not the whole budget.
STORE_RETRY_SECONDS = 10.0

Parts = list[tuple[str, np.ndarray, str]]  # (wire name, numpy array, safetensors dtype), see syncwire.iter_chunks
OnTensor = Callable[[str, np.ndarray, Mapping[str, str]], None]  # each tensor of a body as it arrives
Chunk = TypeVar("Chunk", bytes, bytes | memoryview)


@dataclass
class Download:
    """A safetensors body, read into arrays."""

    reader: StreamReader
    version: int = -1  # X-Sync-Version: the model version the body is (or leads to)
    run_samples: int = -1  # X-Sync-Run-Samples: samples the run had trained by that version
    store_seconds: float | None = None  # from the hub's 307 to the last byte, when it came from the object store
    next_every: int | None = None  # X-Sync-Next-Every: steps to the next sync, in a run that picks them


@dataclass
class _Fetch:
    """A download on its way: the body so far, the hub's headers, and the object store's URL once
    the hub sent it there (``fresh``: in this attempt, so a 403 is no expiry)."""

    reader: StreamReader
    on_tensor: OnTensor | None
    version: int = -1
    run_samples: int = -1
    next_every: int | None = None
    hub_etag: str | None = None
    url: str | None = None
    store_etag: str | None = None
    fresh: bool = False
    since: float | None = None  # the first 307 (monotonic)
    direct: bool = False  # the store failed: the hub serves its own copy

    def resume(self, etag: str | None) -> dict[str, str]:
        """The headers that ask for the rest of the body (none at 0); ``If-Range`` when the source's
        ETag is known (a store's objects never change under a key: its first ranged GET may go without)."""
        if not self.reader.received:
            return {}
        return {"Range": f"bytes={self.reader.received}-", **({"If-Range": etag} if etag else {})}


class _StoreFailed(Exception):
    """The object store answered a presigned GET with an error that asking again cannot fix."""


class _Refused(Exception):
    """An error response (retrying cannot fix it unless it is a :class:`_Retry`); :meth:`Transport._errors`
    translates it."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"{response.status_code} from {response.request.url.path}")
        self.response = response
        retry_after = response.headers.get("retry-after", "")
        self.retry_after = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None


class _Retry(_Refused):
    """A response worth retrying (5xx, 429, 503), with its Retry-After."""


@functools.cache
def _default_tls() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CA bundle, or SSL_CERT_FILE / SSL_CERT_DIR), built
    once per process: building one loads the bundle, ~21 ms of CPU (a SyncClient's whole setup
    was ~21 ms), and every transport built its own. A context is shared safely between sockets."""
    return httpx.create_ssl_context()


class Transport:
    """An httpx client to one run on one hub, with the SDK's retries and resumption. ``run`` only
    names the run in log lines; ``verify`` as :class:`~syncclient.SyncClient` takes it."""

    def __init__(
        self,
        hub: str,
        *,
        run: str,
        token: str | None,
        verify: bool | str | ssl.SSLContext,
        timeout: float,
        retry_seconds: float,
    ) -> None:
        self.hub, self.run, self.retry_seconds, self._token = hub, run, retry_seconds, token
        if verify is True:
            verify = _default_tls()
        elif isinstance(verify, str):  # httpx wants a context for a CA bundle
            folder = os.path.isdir(verify)
            verify = ssl.create_default_context(capath=verify if folder else None, cafile=None if folder else verify)
        transport = httpx.HTTPTransport(
            verify=verify, limits=httpx.Limits(max_connections=8, max_keepalive_connections=4)
        )
        # httpx's transport takes no network backend: set its pool's (httpcore's public backend
        # API, httpx's private attribute; tests/test_resume.py fails if either moves)
        pool = transport._pool
        self._backend = _LargeReads(pool._network_backend)
        pool._network_backend = self._backend
        # a transport with connections of its own and this one's TLS settings and timeouts
        self._twin = functools.partial(Transport, run=run, verify=verify, timeout=timeout)
        self._store: Transport | None = None  # presigned URLs of the hub's object store
        self.http = httpx.Client(
            base_url=hub,
            # bodies are read, and resumed, by the byte: never compressed
            headers={"Accept-Encoding": "identity", **({"Authorization": f"Bearer {token}"} if token else {})},
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
        )
        self.max_download: int | None = None  # data bytes a body may declare (the client sets it at join)

    def close(self) -> None:
        self.http.close()
        if self._store is not None:
            self._store.close()

    def sibling(self) -> Transport:
        """A transport to the same hub with connections of its own (the heartbeat's, which :meth:`abort` ends)."""
        return self._twin(self.hub, token=self._token, retry_seconds=self.retry_seconds)

    def abort(self) -> None:
        """Shut this transport's sockets down now: a request another thread is waiting on ends
        at once with an error (closing a socket would not wake it), and the hub sees the
        connection close, as it would if this process died."""
        self._backend.shutdown()

    def store(self) -> Transport:
        """The transport for the object store's presigned URLs: this one's TLS settings and timeouts,
        no token (a bucket must never see the hub's; S3 refuses a request signed twice),
        :data:`STORE_RETRY_SECONDS` of retries."""
        if self._store is None:
            self._store = self._twin("", token=None, retry_seconds=min(self.retry_seconds, STORE_RETRY_SECONDS))
        return self._store

    def call(
        self,
        method: str,
        path: str,
        *,
        retry: bool = True,
        content: Callable[[], Iterator[bytes | memoryview]] | None = None,
        resume: bool = False,
        offset: int = 0,
        where: str | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request, retried unless ``retry=False``; an error answer raises the SDK's exception
        (naming the request ``where``, or its path: a presigned URL's signature stays out).
        ``content`` makes a fresh body iterator per attempt. ``resume``: before each retry, ask the
        hub how many bytes it holds and send only the rest, with ``Upload-Offset``; ``offset``:
        where the first attempt starts.
        """
        headers = kwargs.pop("headers", None) or {}
        with self._errors(where or path):
            for attempt in self._retrying(retry):
                with attempt:
                    if resume and attempt.retry_state.attempt_number > 1:
                        offset = self._upload_offset(path, headers)
                        log.info("run %s: resuming %s at byte %d", self.run, path, offset)
                    body = content() if content else None
                    if offset and body is not None:
                        body = _skip(body, offset)
                    response = self.http.request(
                        method,
                        path,
                        content=cast("Iterator[bytes] | None", body),
                        headers={**headers, "Upload-Offset": str(offset)} if offset else headers,
                        **kwargs,
                    )
                    if resume and response.status_code == 409 and _hub_error(response).code == "upload_offset":
                        raise _Retry(response)  # the hub lost the bytes we resumed after (it restarted): ask again
                    _check(response)
        return response

    def put(self, path: str, parts: Parts, *, what: str, params: dict[str, Any]) -> None:
        """PUT ``parts`` as one safetensors body, whole (version 0)."""
        size = body_size(parts)
        self.call("PUT", path, params=params, content=lambda: self._progress(iter_chunks(parts), size, what))

    def upload(
        self,
        path: str,
        parts: Parts,
        *,
        what: str,
        headers: dict[str, str],
        ready: Callable[[int], None],
        completing: Callable[[], dict[str, str]],
    ) -> tuple[int, dict[str, Any]]:
        """PUT ``parts`` as one safetensors body while they fill (``ready(i)`` waits for part ``i``):
        held, then completed with its digest and the headers ``completing()`` gives (see the module
        docstring); after a cut only what the hub lacks is sent. Its size and the hub's answer."""
        size, digest = body_size(parts), Digest()

        def hashed() -> Iterator[memoryview | bytes]:
            return digest.watch(iter_chunks(parts, ready=ready))

        held = {**headers, "Upload-Key": secrets.token_urlsafe(24), "Upload-Complete": "?0"}
        self.call("PUT", path, headers=held, content=lambda: self._progress(hashed(), size, what), resume=True)
        done = {**held, **completing(), "Content-Digest": digest.value(size)}
        del done["Upload-Complete"]
        response = self.call("PUT", path, headers=done, content=hashed, resume=True, offset=size)
        return size, response.json()

    def download(
        self,
        path: str,
        params: dict[str, Any] | None,
        on_tensor: OnTensor | None = None,
    ) -> Download | None:
        """GET a safetensors body into arrays, resuming with Range after a cut; None on 204 (a long
        poll still open). A body declaring more than ``max_download`` bytes of data is refused.
        ``on_tensor`` takes each tensor as it arrives (what it took cannot be taken back: a body
        that changed under a resumed download is then an error, not a restart).

        A hub's ``307`` sends it to the object store's copy (through :meth:`store`); an expired URL
        (403) back to the hub for a fresh one, at the byte it reached; a store that gives nothing
        makes it ask the hub for its own copy (``direct=1``). :meth:`_fetch` picks the source;
        :meth:`_from_hub` and :meth:`_from_store` make one request each."""
        got = _Fetch(StreamReader(self.max_download, on_tensor), on_tensor)
        with self._errors(path.split("?", 1)[0]):
            for attempt in self._retrying():
                with attempt:
                    if not self._fetch(path, params, got):
                        return None
                    if not got.reader.done:
                        raise httpx.RemoteProtocolError("body ended early")
        seconds = time.monotonic() - got.since if got.since is not None else None
        return Download(got.reader, got.version, got.run_samples, seconds, got.next_every)

    def _fetch(self, path: str, params: dict[str, Any] | None, got: _Fetch) -> bool:
        """One attempt: requests until a body came (True) or the long poll ended without one
        (False). A cut after some bytes is raised, to resume; a store that gave nothing is left."""
        got.fresh = False  # a URL from an earlier attempt may have expired since
        while True:
            before, store = got.reader.received, got.url is not None
            try:
                went = self._from_store(got) if store else self._from_hub(path, params, got)
            except (httpx.TransportError, _StoreFailed) as exc:
                if not store or (isinstance(exc, httpx.TransportError) and got.reader.received > before):
                    raise
                said = "run %s: the object store failed (%s: %s); downloading from the hub"
                log.warning(said, self.run, type(exc).__name__, exc)
                got.url, got.since, got.direct = None, None, True  # (the hub sees that download end itself)
                continue
            if went != "again":
                return went == "body"

    def _from_hub(self, path: str, params: dict[str, Any] | None, got: _Fetch) -> str:
        """One GET of the hub's copy: ``"body"``, ``"none"`` (204) or ``"again"`` (a 307: the URL is in ``got``)."""
        if got.direct:
            params = {**(params or {}), "direct": 1}
        with self.http.stream("GET", path, params=params, headers=got.resume(got.hub_etag)) as r:
            if r.status_code >= 400:
                r.read()
                _check(r)
            if r.status_code == 204:
                return "none"
            got.version = int(r.headers.get("x-sync-version", -1))
            got.run_samples = int(r.headers.get("x-sync-run-samples", -1))
            every = r.headers.get("x-sync-next-every")
            got.next_every = int(every) if every is not None else None
            got.hub_etag = r.headers.get("etag")
            if r.status_code == 307 and r.headers.get("location"):
                got.url, got.fresh = r.headers["location"], True
                got.since = time.monotonic() if got.since is None else got.since
                return "again"
            self._take(r, got, path)
        return "body"

    def _from_store(self, got: _Fetch) -> str:
        """One GET of the store's copy (the URL whole: httpx would replace its query with params):
        ``"body"``, or ``"again"`` when it expired (ask the hub)."""
        assert got.url is not None
        with self.store().http.stream("GET", got.url, headers=got.resume(got.store_etag)) as r:
            if r.status_code == 403 and not got.fresh:
                r.read()
                got.url = None
                return "again"
            if r.status_code not in (200, 206):
                r.read()
                raise _StoreFailed(f"{r.status_code} {_s3_error(r.text)[0]}".rstrip())
            got.store_etag = r.headers.get("etag")
            self._take(r, got, got.url.split("?", 1)[0])
        return "body"

    def _take(self, r: httpx.Response, got: _Fetch, path: str) -> None:
        """Feed a 200/206 answer's body to the reader (a fresh one if a resume got the whole body)."""
        if r.status_code == 200 and got.reader.received:  # the file changed: start over
            if got.on_tensor is not None:
                raise SyncError(f"{path} changed while it downloaded")
            got.reader = StreamReader(self.max_download)
        for chunk in self._progress(r.iter_bytes(1 << 20), int(r.headers.get("content-length", 0)), "download"):
            got.reader.feed(chunk)

    # ---- internals -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _errors(self, path: str) -> Iterator[None]:
        """The one place where httpx errors and hub error responses become the SDK's exceptions."""
        try:
            yield
        except _Retry as exc:
            raise HubUnreachable(f"{self.hub}{path}: still {exc} after {self.retry_seconds:.0f}s of retries") from exc
        except _Refused as exc:
            raise _hub_error(exc.response) from None
        except httpx.TransportError as exc:
            why = _tls_problem(exc) or f"after {self.retry_seconds:.0f}s of retries"
            raise HubUnreachable(f"{self.hub}{path}: {type(exc).__name__}: {exc} ({why})") from exc

    def _retrying(self, retry: bool = True) -> Retrying:
        """Tries of one request: waits from 0.5 s doubling to 20 s, plus up to 1 s of jitter, or
        what ``Retry-After`` asks (up to 60 s), for ``retry_seconds`` in all; not a TLS setup error."""

        def said(exc: BaseException, attempt: int) -> None:
            log.warning("run %s: hub trouble (%s: %s); retry %d", self.run, type(exc).__name__, exc, attempt)

        return retrying(
            _retryable,
            seconds=self.retry_seconds if retry else 0,
            first=0.5,
            jitter=1.0,
            hint=lambda exc: exc.retry_after if isinstance(exc, _Retry) else None,
            before_sleep=said,
        )

    def _upload_offset(self, path: str, headers: dict[str, str]) -> int:
        """Bytes of this update (named by its headers) the hub holds; 0 if it cannot say (the PUT
        from 0 then reports the real trouble). Transport errors count as a failed try."""
        response = self.http.head(path, headers=headers)
        if response.status_code in _RETRY_STATUS:
            raise _Retry(response)
        offset = response.headers.get("upload-offset", "")
        return int(offset) if response.is_success and offset.isdigit() else 0

    def _progress(self, chunks: Iterator[Chunk], total: int, what: str) -> Iterator[Chunk]:
        """``chunks`` as they are, with a progress bar (at log level INFO) when ``total`` is big."""
        if total < _PROGRESS_BYTES or not log.isEnabledFor(logging.INFO):
            yield from chunks
            return
        with tqdm(total=total, unit="B", unit_scale=True, desc=what, leave=False) as bar:
            for chunk in chunks:
                yield chunk
                bar.update(len(chunk))


class _LargeReads(httpcore.NetworkBackend):
    """httpcore's sync backend, reading plain-TCP sockets ``_READ_BYTES`` at a time, not 64 KiB:
    each read costs h11 and httpcore some Python, and a 500 MB result then costs the peer 0.5 s of
    CPU instead of 0.9-1.8 s (bench/RESULTS.md, Wire). A TLS socket returns one 16 KiB record per
    read whatever is asked, so TLS streams keep httpcore's size. It knows its open streams (weakly:
    httpcore holds them while their connection lives), for :meth:`shutdown` from another thread.
    """

    def __init__(self, backend: httpcore.NetworkBackend) -> None:
        self._backend = backend
        self._streams: weakref.WeakSet[_LargeReadStream] = weakref.WeakSet()
        self.shut = False  # shutdown() was called: a stream opened since is shut down at once

    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        return _LargeReadStream(self._backend.connect_tcp(*args, **kwargs), self)

    def shutdown(self) -> None:
        """Shut down every open stream's socket, and any opened from now on. (A stream registers
        itself, then looks at ``shut``; this sets ``shut``, then looks at the streams: one
        connecting meanwhile is seen by either.)"""
        self.shut = True
        for stream in list(self._streams):
            stream.shutdown()


class _LargeReadStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, backend: _LargeReads, large: bool = True) -> None:
        streams = backend._streams
        self._stream, self._backend, self._streams, self._large = stream, backend, streams, large
        streams.add(self)
        if backend.shut:
            self.shutdown()

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max(max_bytes, _READ_BYTES) if self._large else max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, timeout)

    def shutdown(self) -> None:
        sock = self._stream.get_extra_info("socket")
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._streams.discard(self)
        self._stream.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        self._streams.discard(self)  # the TLS stream replaces this one (its socket detached)
        tls = self._stream.start_tls(*args, **kwargs)
        return _LargeReadStream(tls, self._backend, large=False)  # TLS: httpcore's read size (see above)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


def _s3_error(text: str) -> tuple[str, str]:
    """An object store's error answer (S3's XML), as its ``Code`` and ``Message`` ("" if none)."""
    found = [re.search(f"<{tag}>([^<]{{0,500}})</{tag}>", text) for tag in ("Code", "Message")]
    return (found[0].group(1) if found[0] else "", found[1].group(1) if found[1] else "")


def body_size(parts: Parts) -> int:
    """Bytes of the safetensors body :meth:`Transport.upload` sends for ``parts``."""
    return sum(len(c) for c in iter_chunks(parts))


def _check(response: httpx.Response) -> None:
    """Sort an answer: retry it (5xx, 429, 503), refuse it (other errors), or let it through."""
    if response.status_code in _RETRY_STATUS:
        raise _Retry(response)
    if response.status_code >= 400:
        raise _Refused(response)


def _retryable(exc: BaseException) -> bool:
    # a TLS setup error is not transport trouble: retrying it for retry_seconds only hides it
    return isinstance(exc, _Retry) or (isinstance(exc, httpx.TransportError) and _tls_problem(exc) is None)


def _tls_problem(exc: BaseException) -> str | None:
    """What to do about a TLS failure that no retry fixes (an untrusted certificate, https:// to
    a plain-HTTP hub); None for anything else (a TLS connection cut midway is retried)."""
    cause: BaseException | None = exc
    for _ in range(16):  # the __cause__/__context__ chain: httpx -> httpcore -> ssl
        if cause is None:
            break
        if isinstance(cause, ssl.SSLCertVerificationError):
            return "the hub's TLS certificate is not trusted: pass verify=<the CA bundle that signed it>"
        if isinstance(cause, ssl.SSLError) and cause.reason == "WRONG_VERSION_NUMBER":
            return "the hub does not speak TLS there: use http://, or start it with --ssl-certfile"
        cause = cause.__cause__ or cause.__context__
    return None


def _hub_error(response: httpx.Response) -> HubError:
    """The SDK's exception for an error response, by status and the hub's error code."""
    try:
        body = response.json()
        code, detail = str(body.get("error", "error")), str(body.get("detail", response.text))
    except (ValueError, AttributeError):  # not JSON: an object store's XML, or plain text
        xml_code, message = _s3_error(response.text)
        body, code, detail = {}, xml_code or "error", message or xml_code or response.text[:500]
    status = response.status_code
    cls = {401: AuthError, 404: NotFound, 409: ConflictError}.get(status, HubError)
    if status == 409:
        cls = {"round_closed": RoundClosed, "stale_update": StaleUpdate}.get(code, ConflictError)
    return cls(status, code, detail, body)


class Digest:
    """The sha-256 of a body, taken as its bytes first go out: attempts after a cut see the
    same chunks again (same parts, same cut), and only those past what was hashed are added."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._hashed = 0

    def watch(self, chunks: Iterator[memoryview | bytes]) -> Iterator[memoryview | bytes]:
        position = 0
        for chunk in chunks:
            if position == self._hashed:
                self._hash.update(chunk)
                self._hashed += len(chunk)
            position += len(chunk)
            yield chunk

    def value(self, size: int) -> str:
        """``Content-Digest`` of the body, whose ``size`` bytes must all have gone out."""
        assert self._hashed == size, (self._hashed, size)
        return "sha-256=:" + base64.b64encode(self._hash.digest()).decode() + ":"

    def hexdigest(self, content: Callable[[], Iterator[memoryview | bytes]], size: int) -> str:
        """The body's sha-256 in hex: what went out was hashed on the way, the rest (parts a
        resumed upload skipped) is read from ``content()`` now."""
        if self._hashed < size:
            for _ in self.watch(content()):
                pass
        assert self._hashed == size, (self._hashed, size)
        return self._hash.hexdigest()


def _skip(chunks: Iterator[bytes | memoryview], n: int) -> Iterator[bytes | memoryview]:
    """The body from byte ``n`` on (views, no copies)."""
    for chunk in chunks:
        if n >= len(chunk):
            n -= len(chunk)
            continue
        yield memoryview(chunk)[n:] if n else chunk
        n = 0
