"""The hub's domain errors. Routes raise these; the app maps each to its status code in one
exception handler, so every failure is ``{"error": code, "detail": reason, ...}`` with a 4xx/5xx.

    HubError
    ├── BadRequest (400)          malformed input: bad body, truncated upload, bad digest
    │   ├── InvalidUpdate (422)   well-formed but wrong: schema mismatch, NaN/Inf, bad samples
    │   └── Incomplete (400)      the body stopped before its end (cut, stalled)
    ├── Unauthorized (401)
    ├── LimitReached (403)        a limit of the hub: runs per token, peers per run
    ├── NotFound (404)            unknown run or peer
    ├── Conflict (409)            config mismatch, a different update for an acknowledged round
    │   ├── RoundClosed (409)     the round is over: carries the current version to catch up to
    │   ├── StaleUpdate (409)     async: the update's base is more than max_staleness versions old
    │   ├── OffsetMismatch (409)  a resumed upload's Upload-Offset is past what the hub holds
    │   ├── Superseded (409)      a newer attempt at the same upload (a retry, a HEAD) took it over
    │   ├── UploadUnknown (409)   no upload into the object store is open under that key: presign again
    │   ├── NoStore (409)         this hub has no object store: PUT the update
    │   └── LeaseLost (409)       a reducer's lease expired (or its round ended): its work is not used
    ├── Gone (410)                a round result that was pruned: pull the model instead
    ├── PayloadTooLarge (413)
    └── Unavailable (503)         disk full or unwritable: nothing was changed
        └── StoreDown (503)       the object store failed: PUT the update to the hub instead
"""

from __future__ import annotations

from typing import Any


class HubError(Exception):
    status = 500
    code = "internal"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "detail": self.detail, **self.extra}


class BadRequest(HubError):
    status, code = 400, "bad_request"


class InvalidUpdate(BadRequest):
    status, code = 422, "invalid_update"


class Incomplete(BadRequest):
    """The body stopped arriving (link cut, client gone, stalled past the lease); an update
    keeps what arrived for its resume."""

    code = "incomplete"


class PoisonedUpdate(InvalidUpdate):
    """422: the update's norm is far above the round's usual (the run's ``norm_guard``); it
    carries ``norm``, ``median`` and ``factor``. It never touched the average."""

    code = "poisoned_update"


class Unauthorized(HubError):
    status, code = 401, "unauthorized"


class LimitReached(HubError):
    """A quota of the hub (``SYNC_MAX_RUNS_PER_TOKEN``, ``SYNC_MAX_PEERS_PER_RUN``) is used up;
    carries ``limit`` (the setting) and ``value``. Not retried: waiting does not free it."""

    status, code = 403, "limit_reached"


class NotFound(HubError):
    status, code = 404, "not_found"


class Conflict(HubError):
    status, code = 409, "conflict"


class RoundClosed(Conflict):
    code = "round_closed"


class StaleUpdate(Conflict):
    """Async runs: the update was computed from a version too old to apply; it carries
    ``current_version`` (pull it) and ``max_staleness``."""

    code = "stale_update"


class OffsetMismatch(Conflict):
    """Carries ``upload_offset``, what the hub holds; the client asks again (HEAD) and resumes."""

    code = "upload_offset"


class Superseded(Conflict):
    """A newer attempt at the same upload (the peer's retry, or its HEAD) took it over while
    this one streamed; what this one wrote is kept for the newer one. One writer at a time."""

    code = "superseded"


class LeaseLost(Conflict):
    """409: a reducer renews or reports a merge lease that is no longer its own (it expired and
    was offered again, or its round's merge ended): what it did is not used."""

    code = "lease_lost"


class UploadUnknown(Conflict):
    """``/uploaded`` names no upload the hub handed out (it restarted, or another one replaced
    it): the peer asks ``/presign`` again and uploads afresh."""

    code = "upload_unknown"


class NoStore(Conflict):
    """An update offered to an object store that this hub does not have (``SYNC_STORE`` unset)."""

    code = "no_store"


class Gone(HubError):
    status, code = 410, "gone"


class PayloadTooLarge(HubError):
    status, code = 413, "payload_too_large"


class Unavailable(HubError):
    status, code = 503, "unavailable"


class StoreDown(Unavailable):
    """The object store failed (down, refusing the hub's credentials...) while an update went
    there: nothing was recorded; the peer sends its update to the hub by PUT instead."""

    code = "store_unavailable"
