"""The hub's domain errors. Routes raise these; the app maps each to its status code in one
exception handler, so every failure is ``{"error": code, "detail": reason, ...}`` with a 4xx/5xx,
``...`` being the fields named below (``current_version``, ...).

    HubError
    ├── BadRequest (400)          malformed input: bad body, truncated upload, bad digest
    │   ├── InvalidUpdate (422)   well-formed but wrong: schema mismatch, NaN/Inf, bad samples
    │   │   └── PoisonedUpdate    its norm is far above the round's usual (norm_guard): norm, median, factor;
    │   │                         it never touched the average
    │   └── Incomplete (400)      the body stopped before its end (cut, client gone, stalled past the lease);
    │                             an update keeps what arrived for its resume
    ├── Unauthorized (401)
    ├── LimitReached (403)        a quota (SYNC_MAX_RUNS_PER_TOKEN, _PEERS_PER_RUN) is used up: limit, value;
    │                             not retried: waiting does not free it
    ├── NotFound (404)            unknown run or peer
    ├── Conflict (409)            config mismatch, a different update for an acknowledged round
    │   ├── RoundClosed (409)     the round is over: current_version, to catch up to
    │   ├── StaleUpdate (409)     async: the update's base is over max_staleness versions old:
    │   │                         current_version (pull it), max_staleness
    │   ├── OffsetMismatch (409)  a resumed upload's Upload-Offset is past what the hub holds: upload_offset
    │   ├── Superseded (409)      a newer attempt at the same upload (a retry, a HEAD) took it over; what
    │   │                         this one wrote is kept for it: one writer at a time
    │   ├── UploadUnknown (409)   no upload into the object store is open under that key (the hub restarted,
    │   │                         another replaced it): presign again
    │   ├── NoStore (409)         this hub has no object store (SYNC_STORE unset): PUT the update
    │   └── LeaseLost (409)       a reducer's lease expired and was offered again, or its round's merge
    │                             ended: its work is not used
    ├── Gone (410)                a round result that was pruned: pull the model instead
    ├── PayloadTooLarge (413)
    └── Unavailable (503)         disk full or unwritable: nothing was changed
        └── StoreDown (503)       the object store failed while an update went there: nothing was
                                  recorded; PUT the update to the hub instead
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
    code = "incomplete"


class PoisonedUpdate(InvalidUpdate):
    code = "poisoned_update"


class Unauthorized(HubError):
    status, code = 401, "unauthorized"


class LimitReached(HubError):
    status, code = 403, "limit_reached"


class NotFound(HubError):
    status, code = 404, "not_found"


class Conflict(HubError):
    status, code = 409, "conflict"


class RoundClosed(Conflict):
    code = "round_closed"


class StaleUpdate(Conflict):
    code = "stale_update"


class OffsetMismatch(Conflict):
    code = "upload_offset"


class Superseded(Conflict):
    code = "superseded"


class LeaseLost(Conflict):
    code = "lease_lost"


class UploadUnknown(Conflict):
    code = "upload_unknown"


class NoStore(Conflict):
    code = "no_store"


class Gone(HubError):
    status, code = 410, "gone"


class PayloadTooLarge(HubError):
    status, code = 413, "payload_too_large"


class Unavailable(HubError):
    status, code = 503, "unavailable"


class StoreDown(Unavailable):
    code = "store_unavailable"
