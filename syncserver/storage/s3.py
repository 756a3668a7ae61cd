"""An S3-compatible object store (AWS S3, R2, GCS's S3 interop, MinIO, SeaweedFS): the hub's data
plane, ``SYNC_STORE`` (docs/object-store.md). Every request, the hub's own too, is a presigned URL
(:mod:`~syncserver.storage.sigv4`) sent with httpx: no S3 SDK in the hub.

Blocking: ``presign_*`` do no I/O (tens of microseconds: fine on the event loop), the rest belongs
in a worker thread; an instance is safe to share between threads. Timeouts: :class:`ObjectStore`;
retries: :meth:`ObjectStore._request`.

Errors, translated here once:

    StoreError
    ├── StoreUnavailable   the store cannot serve us: down, slow past the timeouts, 5xx, the
    │                      bucket missing, credentials refused. ``reason`` is one line; the hub
    │                      prints it at start and answers 503 with it mid-run
    ├── KeyRefused         a name that would leave the prefix (also a ValueError): no request made
    ├── ObjectMissing      no such object or multipart upload (404)
    └── StoreRefused       the store refused this request (a part that was never uploaded, a
                           range past the end...): ``code`` and ``message`` are the store's
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import re
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httpx

from syncserver.storage.sigv4 import MAX_EXPIRES, Credentials, presign
from syncwire.retry import retrying

__all__ = [
    "CONTROL_SECONDS",
    "KeyRefused",
    "ObjectInfo",
    "ObjectMissing",
    "ObjectStore",
    "StoreError",
    "StoreRefused",
    "StoreUnavailable",
    "Upload",
]

URL_SECONDS = 600
"""Default life of a URL handed to a peer: long enough to start a part on a slow link (S3 checks
the expiry when a request starts, so a transfer begun in time finishes), short enough that a
leaked URL is soon worthless."""
CONTROL_SECONDS = 5.0
"""Default deadline of one control call, to connect and to the first byte: a hung store costs a
peer's /presign seconds before its 503 and the PUT through the hub, not the 30 s read timeout. On
loopback SeaweedFS (2-core VM, shared) a complete of 512 MB in 64 parts took 28 ms, its HEAD 13 ms."""
_OWN_SECONDS = 60  # the hub's own requests are signed the moment they are sent
_PART_MIN, _PART_MAX, _PARTS_MAX = 5 << 20, 5 << 30, 10_000  # S3's multipart limits
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
_KEY_BYTES = 1024  # S3's longest key
_READ_BYTES = 1 << 20
_SINGLE_MAX = 64 << 20  # put_from: bigger bodies go up in parts of this size (or more: part_size)
_TRIES = 3  # attempts of an idempotent request on transport trouble or a 5xx (syncwire.retry's backoff)
_RETRY_STATUS = frozenset({500, 502, 503, 504})
_PROBE = ".weightsync-check"  # what check() writes and deletes
_Params = Mapping[str, str] | None  # a request's query or headers


class StoreError(Exception):
    """Base of the object store's errors."""


class StoreUnavailable(StoreError):
    """The store cannot serve the hub; ``reason`` says why in one line (no secret in it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KeyRefused(StoreError, ValueError):
    """A name that is not a plain relative path under the prefix; no request was made."""


class ObjectMissing(StoreError):
    """No such object (or multipart upload)."""


class StoreRefused(StoreError):
    """The store refused the request itself (``code``: the store's error code, e.g. ``InvalidPart``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its name (relative to the prefix), size in bytes and ETag (without quotes)."""

    name: str
    size: int
    etag: str


@dataclass(frozen=True)
class Upload:
    """A multipart upload in progress (for garbage collection of uncommitted rounds)."""

    name: str
    upload_id: str


class ObjectStore:
    """A bucket (and a prefix in it) on an S3-compatible endpoint: ``http(s)://host[:port][/path]``
    of anything but AWS (path-style: ``endpoint/bucket/key``), None for AWS (virtual-hosted).
    ``timeout``: seconds to connect, and between two reads or writes of one request (a dead
    endpoint fails in bounded time; a slow transfer that keeps moving does not).
    ``control_seconds``: the same for a control call. ``url_seconds``: the life of URLs handed out.
    """

    def __init__(
        self,
        bucket: str,
        *,
        credentials: Credentials,
        prefix: str = "",
        endpoint: str | None = None,
        region: str = "us-east-1",
        timeout: float = 30.0,
        control_seconds: float = CONTROL_SECONDS,
        url_seconds: int = URL_SECONDS,
    ) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"{bucket!r} is no bucket name: 3-63 lowercase letters, digits, '.', '-'")
        self.bucket, self.region, self.credentials = bucket, region, credentials
        self.prefix = _name(prefix.strip("/"), "prefix") + "/" if prefix.strip("/") else ""
        if endpoint is None:
            host = f"s3.{region}.amazonaws.com"
            # a dotted bucket breaks the wildcard TLS certificate of virtual-hosted names
            self._base = f"https://{host}/{bucket}" if "." in bucket else f"https://{bucket}.{host}"
            self.endpoint = f"https://{host}"
        else:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
                raise ValueError(f"AWS_ENDPOINT_URL must be http(s)://host[:port][/path], not {endpoint!r}")
            self.endpoint = endpoint.rstrip("/")
            self._base = f"{self.endpoint}/{bucket}"
        if not 1 <= url_seconds <= MAX_EXPIRES:
            raise ValueError(f"url_seconds must be 1..{MAX_EXPIRES}")
        self.url_seconds = url_seconds
        if not control_seconds > 0:
            raise ValueError(f"control_seconds must be over 0, not {control_seconds}")
        self._control = httpx.Timeout(min(control_seconds, timeout))  # never longer than a data call's
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=8),
            headers={"Accept-Encoding": "identity"},  # objects are read as stored
        )
        self.bytes_read = 0  # object bytes the hub's own GETs brought in (its /metrics)
        self._counting = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        env: Mapping[str, str] | None = None,
        *,
        timeout: float = 30.0,
        control_seconds: float = CONTROL_SECONDS,
        url_seconds: int = URL_SECONDS,
    ) -> ObjectStore:
        """The store ``s3://bucket[/prefix]`` names, with endpoint, credentials and region from
        the AWS variables in ``env`` (default: os.environ). ValueError for a malformed URL or
        missing credentials (a setup mistake, said before anything starts)."""
        env = os.environ if env is None else env
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"an object store is named s3://bucket[/prefix], not {url!r}")
        access, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        if not access or not secret:
            raise ValueError(f"{url} needs credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        return cls(
            parts.netloc,
            credentials=Credentials(access, secret, env.get("AWS_SESSION_TOKEN") or None),
            prefix=parts.path,
            endpoint=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            timeout=timeout,
            control_seconds=control_seconds,
            url_seconds=url_seconds,
        )

    @property
    def url(self) -> str:
        """``s3://bucket/prefix``: where this store is, for messages (no secret in it)."""
        return f"s3://{self.bucket}/{self.prefix}"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def key(self, name: str) -> str:
        """The object key of ``name``: under the prefix, always. :class:`KeyRefused` otherwise."""
        key = self.prefix + _name(name, "object name")
        if len(key.encode()) > _KEY_BYTES:
            raise KeyRefused(f"object key longer than {_KEY_BYTES} bytes: {key[:64]}...")
        return key

    # ---- presigned URLs for peers (``expires``: seconds, default ``url_seconds``) ---------------
    def presign_put(self, name: str, *, expires: int | None = None) -> str:
        """A URL that PUTs one body at ``name`` (up to 5 GB), and nothing else."""
        return self._sign("PUT", self.key(name), expires=expires or self.url_seconds)

    def presign_get(self, name: str, *, expires: int | None = None) -> str:
        """A URL that GETs ``name`` (with ``Range`` as the reader likes)."""
        return self._sign("GET", self.key(name), expires=expires or self.url_seconds)

    def presign_part(self, name: str, upload_id: str, number: int, *, expires: int | None = None) -> str:
        """A URL that PUTs part ``number`` (1-based) of multipart upload ``upload_id`` of ``name``."""
        if not 1 <= number <= _PARTS_MAX:
            raise ValueError(f"part numbers are 1..{_PARTS_MAX}, not {number}")
        query = {"partNumber": str(number), "uploadId": upload_id}
        return self._sign("PUT", self.key(name), query, expires=expires or self.url_seconds)

    # ---- multipart uploads ------------------------------------------------------------------
    @staticmethod
    def part_size(size: int, wanted: int = 8 << 20) -> int:
        """The part size for a body of ``size`` bytes: ``wanted`` unless S3's limits (parts of
        5 MiB to 5 GiB, at most 10,000 of them) need a bigger one."""
        least = -(-size // _PARTS_MAX)
        return min(max(wanted, _PART_MIN, least), _PART_MAX)

    def create_multipart(self, name: str) -> str:
        """Open a multipart upload of ``name`` (nothing visible there until it completes); its id."""
        xml = self._request("POST", self.key(name), {"uploads": ""}, control=True).content
        return _text(_xml(xml), "UploadId")

    def complete_multipart(self, name: str, upload_id: str, parts: Mapping[int, str]) -> ObjectInfo:
        """Publish ``name`` from the parts (number -> ETag), whole, at once. :class:`StoreRefused`
        (``InvalidPart``) for a part the store does not hold with that ETag: a peer that says it
        uploaded what it did not changes nothing."""
        if not parts:
            raise ValueError("a multipart upload needs at least one part")
        body = "<CompleteMultipartUpload>"
        for number in sorted(parts):
            etag = parts[number].strip('"')
            if not re.fullmatch(r"[A-Za-z0-9-]{1,128}", etag):
                raise StoreRefused("InvalidPart", f"part {number}: {etag[:40]!r} is no ETag")
            body += f'<Part><PartNumber>{int(number)}</PartNumber><ETag>"{etag}"</ETag></Part>'
        body += "</CompleteMultipartUpload>"
        response = self._request("POST", self.key(name), {"uploadId": upload_id}, content=body.encode(), control=True)
        root = _xml(response.content)
        if _local(root.tag) == "Error":  # S3 may answer 200 and then an error, for a slow complete
            _raise(self, response, root)
        info = self.head(name)
        if info is None:
            raise StoreUnavailable(f"{self.url}{name}: completed, then missing")
        return info

    def abort_multipart(self, name: str, upload_id: str) -> None:
        """Drop a multipart upload and its parts, if it is still there."""
        with contextlib.suppress(ObjectMissing):
            self._request("DELETE", self.key(name), {"uploadId": upload_id}, control=True)

    def uploads(self, prefix: str = "") -> list[Upload]:
        """Multipart uploads open under ``prefix`` (a name, or a name ending in ``/``)."""
        query = {"uploads": "", "prefix": self._prefix(prefix)}
        pages = self._pages("", query, {"key-marker": "NextKeyMarker", "upload-id-marker": "NextUploadIdMarker"})
        return [
            Upload(_text(i, "Key")[len(self.prefix) :], _text(i, "UploadId")) for p in pages for i in _all(p, "Upload")
        ]

    def list_parts(self, name: str, upload_id: str) -> dict[int, ObjectInfo]:
        """The parts the store holds of an upload, by number (a peer resuming sends the others).
        :class:`ObjectMissing` when the upload is gone (completed, aborted, or cleaned up)."""
        pages = self._pages(self.key(name), {"uploadId": upload_id}, {"part-number-marker": "NextPartNumberMarker"})
        return {
            int(_text(i, "PartNumber")): ObjectInfo(name, int(_text(i, "Size")), _text(i, "ETag", "").strip('"'))
            for page in pages
            for i in _all(page, "Part")
        }

    # ---- objects, as the hub and reducers see them --------------------------------------------
    def head(self, name: str) -> ObjectInfo | None:
        """Size and ETag of ``name``; None when there is no such object."""
        try:
            response = self._request("HEAD", self.key(name), control=True)
        except ObjectMissing:
            return None
        return ObjectInfo(name, int(response.headers["content-length"]), response.headers.get("etag", "").strip('"'))

    def put(self, name: str, data: bytes | memoryview) -> ObjectInfo:
        """Write ``data`` at ``name`` (the hub's own small objects), as :meth:`put_from` does."""
        view = memoryview(data).cast("B")
        return self.put_from(name, len(view), lambda offset, n: view[offset : offset + n])

    def put_from(
        self, name: str, size: int, read: Callable[[int, int], bytes | memoryview], *, single_max: int = _SINGLE_MAX
    ) -> ObjectInfo:
        """Write ``size`` bytes at ``name``, 1 MiB at a time from ``read(offset, n)`` (httpx re-copies
        a big ``bytes`` body's rest after every partial write: DESIGN.md, pitfalls). Over
        ``single_max``, a multipart upload, aborted if it fails, each part retried alone (a
        transfer cut at 90% of a 28 GB version re-sends one part; one PUT takes at most 5 GB)."""

        def chunks(start: int, end: int) -> Iterator[bytes | memoryview]:
            for offset in range(start, end, _READ_BYTES):
                chunk = read(offset, min(_READ_BYTES, end - offset))
                if not chunk:
                    raise StoreUnavailable(f"{self.url}{name}: the source ended at {offset} of {size} bytes")
                yield chunk

        def put(query: _Params, start: int, end: int) -> str:
            """One PUT of bytes ``[start, end)`` (retried as a whole); the store's ETag."""
            headers = {"Content-Length": str(end - start)}
            response = self._request("PUT", key, query, content=functools.partial(chunks, start, end), headers=headers)
            return response.headers.get("etag", "")

        key = self.key(name)
        if size <= single_max:
            return ObjectInfo(name, size, put(None, 0, size).strip('"'))
        upload_id = self.create_multipart(name)
        try:
            step = self.part_size(size, single_max)
            etags = {
                number: put({"partNumber": str(number), "uploadId": upload_id}, start, min(start + step, size))
                for number, start in enumerate(range(0, size, step), 1)
            }
            return self.complete_multipart(name, upload_id, etags)
        except BaseException:
            with contextlib.suppress(StoreError):
                self.abort_multipart(name, upload_id)
            raise

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytearray:
        """Bytes ``[start, end)`` of ``name`` (``end`` None: to its end; past it: cut there; a start
        past it: :class:`StoreRefused`), 1 MiB at a time into one buffer that ``numpy.frombuffer``
        takes without a copy (httpx's ``.content`` joins 64 KiB pieces: 0.6-0.8x the speed on
        bench/store.py's 64 MB, noisy shared VM)."""
        if start < 0 or (end is not None and end < start):
            raise ValueError(f"bad range [{start}, {end})")
        if end == start:
            return bytearray()
        with self._get(name, start, end) as (chunks, size):
            buffer, filled = bytearray(size), 0
            for chunk in chunks:
                buffer[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
            return buffer

    def stream(self, name: str, start: int = 0, end: int | None = None) -> Generator[bytes, None, None]:
        """Bytes ``[start, end)`` of ``name``, 1 MiB at a time, from one GET requested at the first
        ``next`` (closing the iterator closes the answer). A body shorter than announced, or a
        link that fails on the way, is a :class:`StoreUnavailable`."""
        if start < 0 or (end is not None and end <= start):
            raise ValueError(f"bad range [{start}, {end})")
        with self._get(name, start, end) as (chunks, _):
            yield from chunks

    @contextlib.contextmanager
    def _get(self, name: str, start: int, end: int | None) -> Iterator[tuple[Iterator[bytes], int]]:
        """One GET of bytes ``[start, end)``: its chunks (counted in ``bytes_read``) and the size
        the store announced."""
        ranged = start > 0 or end is not None
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if ranged else {}
        response = self._request("GET", self.key(name), headers=headers, stream=True)

        def chunks(announced: int) -> Iterator[bytes]:
            filled = 0
            for chunk in response.iter_raw(_READ_BYTES):
                filled += len(chunk)
                with self._counting:
                    self.bytes_read += len(chunk)
                yield chunk
            if filled != announced:
                raise StoreUnavailable(f"{self.url}{name}: the body ended at {filled} of {announced} bytes")

        try:
            if ranged and response.status_code != 206:
                raise StoreUnavailable(f"{self.endpoint} ignored a Range request ({response.status_code})")
            announced = int(response.headers["content-length"])
            yield chunks(announced), announced
        except httpx.TransportError as exc:
            raise StoreUnavailable(f"{self.url}{name}: {type(exc).__name__} while reading: {exc}") from exc
        finally:
            response.close()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (a name, or a name ending in ``/``), in key order."""
        query = {"list-type": "2", "prefix": self._prefix(prefix)}
        for page in self._pages("", query, {"continuation-token": "NextContinuationToken"}):
            for item in _all(page, "Contents"):
                key = _text(item, "Key")
                yield ObjectInfo(key[len(self.prefix) :], int(_text(item, "Size")), _text(item, "ETag", "").strip('"'))

    def delete(self, name: str) -> None:
        """Remove ``name`` (S3 answers the same whether it was there or not)."""
        self._request("DELETE", self.key(name), control=True)

    def delete_prefix(self, folder: str) -> int:
        """Remove every object under ``folder/`` (``rounds/3`` never takes ``rounds/30``) and abort
        the multipart uploads open there; return how many objects went."""
        if not folder.strip("/"):
            raise KeyRefused("delete_prefix needs a folder: it does not empty the whole store")
        folder = folder.strip("/") + "/"
        names = [info.name for info in self.list(folder)]
        self.delete_names(names)
        for upload in self.uploads(folder):
            self.abort_multipart(upload.name, upload.upload_id)
        return len(names)

    def delete_names(self, names: Iterable[str]) -> None:
        """Remove the objects ``names``, 1,000 per request (a name not there is no error)."""
        names = list(names)
        for i in range(0, len(names), 1000):
            body = "<Delete><Quiet>true</Quiet>"
            body += "".join(f"<Object><Key>{self.key(n)}</Key></Object>" for n in names[i : i + 1000])
            data = (body + "</Delete>").encode()
            md5 = base64.b64encode(hashlib.md5(data).digest()).decode()  # S3 wants it; not for security
            answer = self._request("POST", "", {"delete": ""}, content=data, headers={"Content-MD5": md5}, control=True)
            failed = _all(_xml(answer.content), "Error")
            if failed:
                code, key, message = (_text(failed[0], tag) for tag in ("Code", "Key", "Message"))
                raise StoreRefused(code, f"{key}: {message}")

    def check(self) -> None:
        """:class:`StoreUnavailable` unless the hub may list, write and delete here (peers' URLs
        carry its rights: a read-only key would otherwise fail at the first peer's upload, with a
        403 the peer cannot explain)."""
        self._request("GET", "", {"list-type": "2", "max-keys": "1", "prefix": self.prefix}, control=True)
        self.put(_PROBE, b"weightsync: the hub checks that it may write here\n")
        self.delete(_PROBE)

    # ---- internals --------------------------------------------------------------------------
    def _pages(self, key: str, query: Mapping[str, str], marks: Mapping[str, str]) -> Iterator[ET.Element]:
        """Each page of a listing; ``marks``: the next page's query parameters, by the element of
        this page that gives each."""
        while True:
            page = _xml(self._request("GET", key, query, control=True).content)
            yield page
            if _text(page, "IsTruncated", "false") != "true":
                return
            query = {**query, **{param: _text(page, tag) for param, tag in marks.items()}}

    def _prefix(self, prefix: str) -> str:
        stripped = prefix.strip("/")
        return self.key(stripped) + ("/" if prefix.endswith("/") else "") if stripped else self.prefix

    def _sign(self, method: str, key: str, query: _Params = None, *, expires: int, headers: _Params = None) -> str:
        """A presigned URL for ``key`` (the bucket itself when empty)."""
        url = f"{self._base}/{key}"
        return presign(
            method, url, credentials=self.credentials, region=self.region, expires=expires, query=query, headers=headers
        )

    def _request(
        self,
        method: str,
        key: str,
        query: _Params = None,
        *,
        content: bytes | Callable[[], Iterable[bytes | memoryview]] | None = None,
        headers: _Params = None,
        stream: bool = False,
        control: bool = False,
    ) -> httpx.Response:
        """One request of the hub's own, signed now, retried on transport trouble and 5xx unless
        POST; a failure leaves as a :class:`StoreError`. ``stream``: the answer's body is left to
        read. ``control``: ``control_seconds`` to connect and to the first byte, and not tried
        again once timed out (a hung store is not waited on thrice)."""
        signed = {k: v for k, v in (headers or {}).items() if k.lower() == "content-md5"}

        def again(exc: BaseException) -> bool:  # a 5xx, or trouble on the way but a control call's timeout
            timeout = control and isinstance(exc, httpx.TimeoutException)
            return isinstance(exc, _Failed) or (isinstance(exc, httpx.TransportError) and not timeout)

        try:
            for attempt in retrying(again, attempts=1 if method == "POST" else _TRIES):
                with attempt:
                    url = self._sign(method, key, query, expires=_OWN_SECONDS, headers=signed)
                    body: Any = content() if callable(content) else content  # httpx streams any iterable
                    timeout = self._control if control else httpx.USE_CLIENT_DEFAULT
                    request = self._http.build_request(method, url, content=body, headers=headers, timeout=timeout)
                    response = self._http.send(request, stream=stream or control)
                    if control:
                        # the first byte came in time: the rest of the answer (a long listing, the
                        # whitespace S3 sends while a big complete runs) gets the data timeout;
                        # httpcore reads the read timeout from this dict when the body starts
                        request.extensions["timeout"] = self._http.timeout.as_dict()
                        if not stream:
                            response.read()
                    if response.status_code >= 300 and stream:
                        response.read()  # an error: a few hundred bytes of XML
                        response.close()
                    if response.status_code in _RETRY_STATUS:
                        raise _Failed(response)
                    if response.status_code >= 300:
                        _raise(self, response, None)
                    return response
        except httpx.TransportError as exc:
            raise StoreUnavailable(f"object store {self.endpoint} unreachable: {type(exc).__name__}: {exc}") from exc
        except _Failed as exc:
            _raise(self, exc.args[0], None)
        raise AssertionError("unreachable")


class _Failed(Exception):
    """A 5xx answer (``args[0]``): the store may serve the next try."""


def _name(name: str, what: str) -> str:
    """``name`` if it is a plain relative path of ``[A-Za-z0-9._-]`` segments; else KeyRefused."""
    segments = name.split("/")
    if not name or any(s in ("", ".", "..") or not _SEGMENT.fullmatch(s) for s in segments):
        raise KeyRefused(f"{what} {name[:80]!r} is not a relative path of letters, digits, '.', '_', '-' segments")
    return name


def _raise(store: ObjectStore, response: httpx.Response, root: ET.Element | None) -> NoReturn:
    """The :class:`StoreError` for an error answer: one line that says what to do."""
    status = response.status_code
    if root is None and response.content:
        with contextlib.suppress(StoreUnavailable):
            root = _xml(response.content)
    code, message = (_text(root, "Code", ""), _text(root, "Message", "")) if root is not None else ("", "")
    where = f"{store.endpoint} ({store.url})"
    if code == "NoSuchBucket":
        raise StoreUnavailable(f"bucket {store.bucket!r} does not exist at {store.endpoint}")
    if status == 404 or code in ("NoSuchKey", "NoSuchUpload"):
        raise ObjectMissing(f"{response.request.url.path}: {code or 'not found'}")
    if code == "InvalidAccessKeyId":
        raise StoreUnavailable(
            f"{where} does not know access key {store.credentials.access_key!r}: check AWS_ACCESS_KEY_ID"
        )
    if code == "SignatureDoesNotMatch":
        raise StoreUnavailable(f"{where} refused the signature: check AWS_SECRET_ACCESS_KEY and AWS_REGION")
    if code == "RequestTimeTooSkewed":
        raise StoreUnavailable(f"{where}: this machine's clock is off from the store's: {message}")
    if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "AuthorizationQueryParametersError"):
        raise StoreUnavailable(
            f"{where}: wrong region or endpoint ({code}: {message}): check AWS_REGION and AWS_ENDPOINT_URL"
        )
    if status in (401, 403):
        raise StoreUnavailable(
            f"{where} denied access ({code or status}): no such bucket, or the key may not read, write, list and"
            " delete there"
        )
    if status >= 500 or status < 400:
        raise StoreUnavailable(f"{where} answered {status} {code}".rstrip())
    raise StoreRefused(code or str(status), message or response.reason_phrase)


def _xml(data: bytes) -> ET.Element:
    """An S3 XML answer (the endpoint is the operator's, not a peer's)."""
    try:
        return ET.fromstring(data)
    except ET.ParseError as exc:
        raise StoreUnavailable(f"the object store answered something that is not S3 XML: {data[:80]!r}") from exc


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]  # S3 answers in its 2006-03-01 namespace, errors in none


def _all(root: ET.Element, tag: str) -> list[ET.Element]:
    return [e for e in root if _local(e.tag) == tag]


def _text(root: ET.Element, tag: str, default: str | None = None) -> str:
    for element in root:
        if _local(element.tag) == tag:
            return element.text or ""
    if default is None:
        raise StoreUnavailable(f"the object store's answer has no <{tag}>")
    return default
