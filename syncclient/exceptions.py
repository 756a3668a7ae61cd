"""Everything the SDK raises. Catch :class:`SyncError` to catch them all.

SyncError
├── HubUnreachable        no answer within the retry budget (connect errors, timeouts,
│                         5xx, 429/503): transport trouble, not the request's fault
├── HubError              the hub answered with an error that retrying cannot fix
│   ├── AuthError         401: missing or wrong token
│   ├── ConflictError     409: e.g. the run was created with another codec
│   │   ├── RoundClosed   409: the round closed without us (the SDK catches up itself)
│   │   └── StaleUpdate   409: async: our base is too many versions old (the SDK catches up)
│   └── NotFound          404: unknown run or peer
└── SchemaMismatch        the model's tensors are not the run's
"""

from __future__ import annotations

from typing import Any


class SyncError(Exception):
    """Base of every weightsync SDK error."""


class HubUnreachable(SyncError):
    """The hub could not be reached (or kept failing) for the whole retry budget."""


class HubError(SyncError):
    """The hub refused a request; ``status``, ``code`` and ``detail`` say why."""

    def __init__(self, status: int, code: str, detail: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail
        self.body = body or {}


class AuthError(HubError):
    """401: the hub wants a (different) bearer token."""


class NotFound(HubError):
    """404: the run or the peer is unknown to the hub."""


class ConflictError(HubError):
    """409: the request contradicts the run's state or config."""

    @property
    def current_version(self) -> int:
        """Where to go after a :class:`RoundClosed` or :class:`StaleUpdate` (-1: not said)."""
        return int(self.body.get("current_version", -1))


class RoundClosed(ConflictError):
    """409: the round closed before our update arrived."""


class StaleUpdate(ConflictError):
    """409, async runs: our update's base is more than the run's ``max_staleness`` behind."""


class SchemaMismatch(SyncError):
    """The model's tensor names or shapes differ from the run's."""
