"""Uploads straight to an object store, through the presigned URLs a hub hands out.

A hub with an object store (``SYNC_STORE``) says ``uploads: store`` when a peer starts, and
the SDK then sends its updates there (:class:`~syncclient.protocol.RunProtocol`). A presigned
URL is plain HTTPS that carries its own short-lived signature for one key (and, for a multipart
upload, one part number of one upload), so a peer needs no S3 library and holds no bucket
credential.

A body goes up in parts (:class:`PartedUpload`: part ``n`` is bytes ``[(n-1)*part_size,
n*part_size)``), each PUT with its ``Content-Length`` (S3 takes no chunked body) and retried as
the SDK retries anything (:meth:`~syncclient.transport.Transport._retrying`: connect errors,
timeouts, 5xx, 429/503 with ``Retry-After``). The store answers each part with its ETag; they
are kept in the upload, so after a failure (a URL that expired, a store gone for longer than
the retry budget) calling :func:`upload_parts` again, with renewed URLs where the old ones
expired, sends only the parts not yet acknowledged. The hub completes the upload with the
ETags (the object appears whole, at once). One part whose URL is a presigned PUT is a plain
single-request upload: the same code.

Downloads are the SDK's own (:meth:`~syncclient.transport.Transport.download`: safetensors
into arrays, a cut transfer resumed with ``Range``), given the presigned URL by :func:`download`.
A hub's ``307`` to its object store is followed there too, by its own token-free client.

The transport must carry no bearer token: the hub's token must never reach a bucket (and S3
refuses a request signed twice): ``hub_transport.without_token(retry_seconds)``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import parse_qsl

import numpy as np

from syncclient.exceptions import HubError
from syncclient.transport import Download, Transport, _check

__all__ = ["PartedUpload", "download", "upload_parts"]

Content = Callable[[], Iterator[bytes | memoryview]]  # a fresh iterator over the whole body, per call


@dataclass
class PartedUpload:
    """A body of ``size`` bytes going up in parts of ``part_size`` (the last one shorter).

    ``urls``: part number (1-based) -> the presigned URL the hub gave for it (renewed ones
    replace expired ones). ``etags``: part number -> the ETag the store answered, for the parts
    it acknowledged: what the hub completes the upload with, and what a resume skips (a part
    with its ETag needs no URL).
    """

    size: int
    part_size: int
    urls: dict[int, str]
    etags: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.size < 0 or self.part_size <= 0:
            raise ValueError(f"bad sizes: size {self.size}, part_size {self.part_size}")
        expected = list(range(1, self.count + 1))
        if sorted(set(self.urls) | set(self.etags)) != expected:
            raise ValueError(
                f"a body of {self.size} bytes in parts of {self.part_size} needs URLs for parts {expected}"
            )

    @property
    def count(self) -> int:
        return max(1, -(-self.size // self.part_size))

    def span(self, number: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` of the body that part ``number`` carries."""
        start = (number - 1) * self.part_size
        return start, min(start + self.part_size, self.size)

    def missing(self) -> list[int]:
        """Parts the store has not acknowledged yet, in order."""
        return [n for n in range(1, self.count + 1) if n not in self.etags]


def upload_parts(transport: Transport, upload: PartedUpload, content: Content) -> dict[int, str]:
    """PUT every part of ``upload`` not yet acknowledged; return every part's ETag (for the hub).

    ``content()`` gives the whole body afresh (views of arrays, as for :meth:`Transport.upload`);
    each part's attempt takes its window of it. Raises as the SDK does: :class:`HubUnreachable`
    once the retry budget is spent, :class:`HubError` for a refusal (403: an expired or foreign
    URL); the ETags of the parts that went up stay in ``upload`` for the next call.
    """
    if "authorization" in transport.http.headers:
        raise ValueError("a transport with the hub's token must not talk to the object store: make one with token=None")
    for number in upload.missing():
        start, end = upload.span(number)
        url = upload.urls[number]
        where = url.split("?", 1)[0] + f" (part {number})"  # no signature in messages
        with _store_errors(), transport._errors(where):
            for attempt in transport._retrying():
                with attempt:
                    response = transport.http.put(
                        url,
                        content=cast("Iterator[bytes]", _window(content(), start, end)),
                        headers={"Content-Length": str(end - start)},
                    )
                    _check(response)
        etag = response.headers.get("etag", "").strip('"')
        if not etag:
            raise HubError(response.status_code, "no_etag", f"{where}: the store answered without an ETag")
        upload.etags[number] = etag
    return dict(upload.etags)


def download(
    transport: Transport,
    url: str,
    on_tensor: Callable[[str, np.ndarray, Mapping[str, str]], None] | None = None,
) -> Download:
    """A safetensors object through a presigned GET URL, as :meth:`Transport.download` reads a
    hub's (resumed with ``Range`` after a cut). The signature goes as the request's parameters:
    httpx replaces a URL's query with them, and the transport always passes some."""
    base, _, query = url.partition("?")
    with _store_errors():
        got = transport.download(base, dict(parse_qsl(query, keep_blank_values=True)), on_tensor)
    if got is None:  # 204: a hub's long poll, never a store's answer
        raise HubError(204, "no_content", f"{base}: the store answered 204 No Content")
    return got


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """Say an S3 error answer (XML) as the SDK says a hub's (JSON): with its code and message."""
    try:
        yield
    except HubError as exc:
        if exc.code != "error" or not exc.detail.lstrip().startswith("<"):
            raise
        code = _tag(exc.detail, "Code") or "error"
        raise HubError(exc.status, code, _tag(exc.detail, "Message") or code) from None


def _tag(xml: str, name: str) -> str:
    found = re.search(f"<{name}>([^<]{{0,500}})</{name}>", xml)
    return found.group(1) if found else ""


def _window(chunks: Iterator[bytes | memoryview], start: int, end: int) -> Iterator[memoryview]:
    """Bytes ``[start, end)`` of a body given as chunks, as views (no copies)."""
    position = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        following = position + len(view)
        if following > start and position < end:
            yield view[max(start - position, 0) : min(end, following) - position]
        if following >= end:
            return
        position = following
    if position < end:
        raise ValueError(f"the body ended at byte {position}, before its part's end {end}: not the size declared")
