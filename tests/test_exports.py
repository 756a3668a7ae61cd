"""The public surface is small and deliberate: these lists change only on purpose."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
            "StaleUpdate",
            "SyncCallback",
            "SyncClient",
            "Preempted",
            "SyncSchedule",
            "SyncError",
            "SyncResult",
        ]
    )
    for name in syncclient.__all__:
        assert getattr(syncclient, name).__module__.startswith("syncclient")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter: this one may have imported transformers already."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


def test_sync_client_does_not_import_transformers() -> None:
    """``pip install 'weightsync[client]'`` has no transformers: SyncCallback loads on first use."""
    done = _python(
        "import sys, syncclient\n"
        "heavy = [m for m in ('torch', 'httpx', 'transformers', 'lightning') if m in sys.modules]\n"
        "assert not heavy, f'import syncclient pulled {heavy}'\n"
        "syncclient.SyncClient\n"
        "assert 'torch' in sys.modules and 'transformers' not in sys.modules and 'lightning' not in sys.modules\n"
        "syncclient.SyncCallback\n"
        "assert 'transformers' in sys.modules and 'lightning' not in sys.modules"
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("sys.modules['transformers'] = None; syncclient.SyncCallback", "ImportError: SyncCallback needs transformers"),
        ("syncclient.SyncCallbak", "AttributeError: module 'syncclient' has no attribute 'SyncCallbak'"),
        (
            "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None; import syncclient.lightning",
            "ImportError: syncclient.lightning needs PyTorch Lightning: pip install lightning",
        ),
    ],
)
def test_lazy_attributes_fail_clearly(code: str, error: str) -> None:
    done = _python(f"import sys, syncclient; {code}")
    assert done.returncode == 1 and error in done.stderr, done.stderr


def test_lightning_exports() -> None:
    import syncclient.lightning

    assert syncclient.lightning.__all__ == ["SyncCallback", "callback_class"]


def test_syncserver_exports() -> None:
    assert sorted(syncserver.__all__) == ["HubSettings", "__version__", "create_app"]


def test_syncwire_exports() -> None:
    for name in syncwire.__all__:
        assert hasattr(syncwire, name)
