"""AWS Signature Version 4 for S3, query-string form (presigned URLs): the standard library only.

Every request to the store, the hub's own too, is a presigned URL: one signing path to get
right, sent with httpx. Why not botocore or obstore: docs/object-store.md, "Why our own signer".
The algorithm is AWS's "Authenticating Requests: Using Query Parameters"; tests/test_objectstore.py
checks it against AWS's published example and botocore's presigner, and SeaweedFS enforces it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

__all__ = ["MAX_EXPIRES", "Credentials", "presign"]

MAX_EXPIRES = 7 * 24 * 3600  # S3 refuses a presigned URL valid for longer than 7 days
_ALGORITHM = "AWS4-HMAC-SHA256"
_UNSIGNED = "UNSIGNED-PAYLOAD"  # the body is not part of the signature: a peer streams it


@dataclass(frozen=True)
class Credentials:
    """An access key pair (and the session token of temporary credentials). ``repr`` hides the secret."""

    access_key: str
    secret_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


def presign(
    method: str,
    url: str,
    *,
    credentials: Credentials,
    region: str,
    expires: int,
    query: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
    now: datetime.datetime | None = None,
) -> str:
    """``url`` (scheme, host[:port], path: not yet percent-encoded) signed for ``method`` for ``expires`` seconds.

    ``query``: the operation's parameters (``uploadId``, ``partNumber``...), signed with it: a URL
    for part 3 of one upload is no URL for part 4. ``headers``: what the signature must cover
    besides ``host`` (``content-md5``).
    """
    if not 1 <= expires <= MAX_EXPIRES:
        raise ValueError(f"expires must be 1..{MAX_EXPIRES} seconds, not {expires}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise ValueError(f"presign needs http(s)://host/path without a query, not {url!r}")
    when = (now or datetime.datetime.now(datetime.timezone.utc)).astimezone(datetime.timezone.utc)
    stamp, day = when.strftime("%Y%m%dT%H%M%SZ"), when.strftime("%Y%m%d")
    scope = f"{day}/{region}/s3/aws4_request"
    signed = {"host": _host(parts.scheme, parts.netloc)}
    signed.update({k.lower(): " ".join(v.strip().split()) for k, v in (headers or {}).items()})
    names = ";".join(sorted(signed))
    params = {
        **(query or {}),
        "X-Amz-Algorithm": _ALGORITHM,
        "X-Amz-Credential": f"{credentials.access_key}/{scope}",
        "X-Amz-Date": stamp,
        "X-Amz-Expires": str(expires),
        "X-Amz-SignedHeaders": names,
    }
    if credentials.session_token:
        params["X-Amz-Security-Token"] = credentials.session_token
    path = quote(parts.path or "/", safe="/~")  # S3: each segment encoded once, never normalised
    # RFC 3986, as SigV4 wants a query: only A-Z a-z 0-9 - _ . ~ stay
    canonical_query = "&".join(f"{quote(k, safe='~')}={quote(v, safe='~')}" for k, v in sorted(params.items()))
    canonical_headers = "".join(f"{k}:{signed[k]}\n" for k in sorted(signed))
    canonical = "\n".join([method.upper(), path, canonical_query, canonical_headers, names, _UNSIGNED])
    to_sign = "\n".join([_ALGORITHM, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + credentials.secret_key).encode()
    for part in (day, region, "s3", "aws4_request"):  # the signing key
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"{parts.scheme}://{parts.netloc}{path}?{canonical_query}&X-Amz-Signature={signature}"


def _host(scheme: str, netloc: str) -> str:
    """The Host header an HTTP client sends: the port only when it is not the scheme's default."""
    return netloc.rsplit("@", 1)[-1].lower().removesuffix({"http": ":80", "https": ":443"}[scheme])
