"""Uploads straight to an object store, through the presigned URLs a hub hands out
(docs/object-store.md). A hub with a store says ``uploads: store`` when a peer starts; a presigned
URL carries its own short-lived signature for one key (and part), so a peer needs no S3 library
and holds no bucket credential. The transport must carry no bearer token (the hub's must never
reach a bucket, and S3 refuses a request signed twice): ``hub_transport.store()``.

A body goes up in parts (:class:`PartedUpload`), up to :data:`PART_STREAMS` at once on their own
connections, each PUT with its ``Content-Length`` (S3 takes no chunked body) and retried alone as
the SDK retries anything. The ETags the store answers are kept by part number, so calling
:func:`upload_parts` again after a failure, with renewed URLs where they expired, sends only the
parts not yet acknowledged; the hub completes the upload with them. One part on a presigned PUT
is a plain single-request upload: the same code.

Downloads stay one GET (:meth:`~syncclient.transport.Transport.download` follows the hub's
``307``), parsed and folded as it streams, in file order: ranges fetched at once would land out
of order, and the resume, the expiry and the fall-back to the hub would each count per range.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from syncclient.exceptions import HubError
from syncclient.transport import Transport

__all__ = ["PartedUpload", "upload_parts"]

#: parts in flight at once: one TCP stream's window rarely fills a far-apart link, so S3 clients
#: upload on several connections (boto3's s3transfer: 10); bench/RESULTS.md, "Parallel parts"
PART_STREAMS = 4

Content = Callable[[], Iterator[bytes | memoryview]]  # a fresh iterator over the whole body, per call


@dataclass
class PartedUpload:
    """A body of ``size`` bytes going up in parts of ``part_size`` (the last one shorter; part
    ``n`` is bytes ``[(n-1)*part_size, n*part_size)``). ``urls``: part number (from 1) -> its
    presigned URL; ``etags``: part number -> the store's ETag for the parts it acknowledged (what
    the hub completes the upload with, and what a resume skips: they need no URL).
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


def upload_parts(
    transport: Transport, upload: PartedUpload, content: Content, concurrency: int = PART_STREAMS
) -> dict[int, str]:
    """PUT every part of ``upload`` not yet acknowledged, up to ``concurrency`` at once; return
    every part's ETag (for the hub).

    ``content()`` gives the whole body afresh (views: a chunk must stay valid once yielded), read
    once, in order, in the calling thread; each part's views go to a worker thread. At most
    ``concurrency`` parts are in flight and one more is gathered: what the chunks pin. After a part
    fails for good no new part starts, those in flight finish, and the call raises as the SDK does
    (403: an expired or foreign URL); the ETags that came stay in ``upload`` for the next call.
    """
    if "authorization" in transport.http.headers:
        raise ValueError("a transport with the hub's token must not talk to the object store: make one with token=None")
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    wanted = upload.missing()
    if not wanted:
        return dict(sorted(upload.etags.items()))
    slots = threading.Semaphore(concurrency)
    failed = threading.Event()
    lock = threading.Lock()

    def send(number: int, views: list[memoryview]) -> None:
        try:
            etag = _put_part(transport, upload, number, views)
            with lock:
                upload.etags[number] = etag
        except BaseException:
            failed.set()
            raise
        finally:
            slots.release()

    sent: dict[int, Future[None]] = {}
    with ThreadPoolExecutor(min(concurrency, len(wanted)), thread_name_prefix="sync-part") as pool:
        try:
            for number, views in _parts(content(), upload, wanted):
                slots.acquire()  # this part's views are gathered; it waits for a free stream
                if failed.is_set():
                    slots.release()
                    break
                sent[number] = pool.submit(send, number, views)
        finally:
            wait(sent.values())  # (a body that ended short raises here, after the parts in flight)
    for number in sorted(sent):
        sent[number].result()  # the first part that failed, by number, says why
    return dict(sorted(upload.etags.items()))


def _put_part(transport: Transport, upload: PartedUpload, number: int, views: list[memoryview]) -> str:
    """One part's PUT, with the transport's retries; the store's ETag for it."""
    start, end = upload.span(number)
    url = upload.urls[number]
    where = url.split("?", 1)[0] + f" (part {number})"  # no signature in messages
    headers = {"Content-Length": str(end - start)}
    response = transport.call("PUT", url, content=lambda: iter(views), headers=headers, where=where)
    etag = response.headers.get("etag", "").strip('"')
    if not etag:
        raise HubError(response.status_code, "no_etag", f"{where}: the store answered without an ETag")
    return etag


def _parts(
    chunks: Iterator[bytes | memoryview], upload: PartedUpload, wanted: list[int]
) -> Iterator[tuple[int, list[memoryview]]]:
    """The ``wanted`` parts of a body given as chunks, in order, each as views of its bytes; parts
    not wanted are read past, and nothing after the last part wanted is read."""
    todo, last = set(wanted), max(wanted)
    if upload.size == 0:  # an empty body: its one part, of nothing
        yield 1, []
        return
    number, views, position = 1, list[memoryview](), 0
    start, end = upload.span(number)
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        following = position + len(view)
        while True:  # the parts this chunk has bytes of (parts are contiguous)
            if number in todo and following > start and position < end:
                views.append(view[max(start - position, 0) : min(end, following) - position])
            if following < end:
                break  # this part goes on in the next chunk
            if number in todo:
                yield number, views
            if number == last:
                return
            number, views = number + 1, []
            start, end = upload.span(number)
            if following <= start:
                break
        position = following
    raise ValueError(f"the body ended at byte {position}, before its part's end {end}: not the size declared")
