"""Serving a stored blob (a round's result, a model version) with HTTP ranges. The store hands out
an open file (:class:`~syncserver.storage.store.Blob`), which stays readable if pruning removes its
name meanwhile. A single ``Range: bytes=a-b`` (the SDK's resume: ``bytes=<received>-`` with
``If-Range: <etag>``) gets a 206; what cannot be honoured (a multi-range, a stale ``If-Range``)
the whole body, as RFC 9110 allows.
"""

from __future__ import annotations

from collections.abc import Mapping

from anyio import to_thread
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from syncserver.storage.store import Blob

__all__ = ["BlobResponse", "requested_range"]

CHUNK = 4 << 20  # uvicorn cannot sendfile: 4 MiB per thread hop, not 64 KiB (7,600 hops for 500 MB)


def requested_range(headers: Headers, size: int, etag: str | None) -> tuple[int, int] | None:
    """The one byte range ``[start, end)`` asked for, or None for the whole body. Raises
    :class:`ValueError` for a range past the end (416)."""
    value = headers.get("range")
    if not value or (headers.get("if-range") not in (None, etag)):
        return None
    unit, _, spec = value.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash or not (_digits(first) or (not first and _digits(last))):
        return None
    if not first:  # a suffix: the last N bytes
        n = _position(last)
        return (max(0, size - n), size) if n else None
    start = _position(first)
    end = min(size, _position(last) + 1) if _digits(last) else size
    if start >= size:
        raise ValueError(f"range starts at {start}, the body has {size} bytes")
    return (start, end) if start < end else None


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()  # "²".isdigit() is true too


def _position(digits: str) -> int:
    """A byte position of a Range header. Past 18 digits it is past the end of any blob: no
    need to parse thousands of them to know that."""
    return int(digits) if len(digits) <= 18 else 10**18


class BlobResponse(Response):
    """The bytes of a blob, whole or one range; the blob is closed when the response ends."""

    media_type = "application/octet-stream"

    def __init__(
        self, blob: Blob, *, headers: Mapping[str, str] | None = None, background: BackgroundTask | None = None
    ) -> None:
        self.blob, self.status_code, self.background = blob, 200, background
        self.init_headers(headers)
        self.headers["accept-ranges"] = "bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            size = self.blob.size
            try:
                span = requested_range(Headers(scope=scope), size, self.headers.get("etag"))
            except ValueError:  # nothing is served: no background task either
                answer = Response(status_code=416, headers={"Content-Range": f"bytes */{size}"})
                return await answer(scope, receive, send)
            start, end = span or (0, size)
            if span is not None:
                self.status_code = 206
                self.headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
            self.headers["content-length"] = str(end - start)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            # No task listens for http.disconnect beside the stream (as in Starlette's FileResponse):
            # with one, this response raised the hub's peak RSS with 4 fp32 peers from 0.74-0.84 GB
            # to 1.07-1.22 GB (bench/round.py; bench/RESULTS.md; why was not pinned down). A peer
            # that goes away mid-body costs the rest of the file's reads, which uvicorn drops.
            position = end if scope["method"].upper() == "HEAD" else start
            if position == end:  # HEAD, or an empty body
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            while position < end:
                chunk = await to_thread.run_sync(self.blob.read, position, min(CHUNK, end - position))
                if not chunk:
                    raise RuntimeError(f"the blob ends at {position} of {end} bytes")
                position += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": position < end})
        finally:
            self.blob.close()
        if self.background is not None:
            await self.background()
