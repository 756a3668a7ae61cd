"""The public surface is small and deliberate: these lists change only on purpose."""

from __future__ import annotations

import syncclient
import syncserver
import syncwire


def test_syncclient_exports() -> None:
    assert sorted(syncclient.__all__) == sorted(
        [
            "AuthError",
            "ConflictError",
            "HubError",
            "HubUnreachable",
            "JoinInfo",
            "NotFound",
            "PendingSync",
            "RoundClosed",
            "SchemaMismatch",
            "SyncCallback",
            "SyncClient",
            "SyncError",
            "SyncResult",
        ]
    )
    for name in syncclient.__all__:
        assert getattr(syncclient, name).__module__.startswith("syncclient")


def test_syncserver_exports() -> None:
    assert sorted(syncserver.__all__) == ["HubSettings", "__version__", "create_app"]


def test_syncwire_exports() -> None:
    for name in syncwire.__all__:
        assert hasattr(syncwire, name)
