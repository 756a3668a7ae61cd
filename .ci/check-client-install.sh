#!/usr/bin/env bash
# The SDK installs as README says: torch first, then `.[client]`. Run that very install in a
# clean venv and prove that `from syncclient import SyncClient` works without transformers
# (only SyncCallback needs it, and it says so when asked for).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
venv=$tmp/client-venv
python3.11 -m venv "$venv"
# only this exact spec: pip then takes the CPU wheel on disk, never a multi-GB CUDA build
"$venv/bin/pip" install --quiet --no-cache-dir torch==2.13.0
"$venv/bin/pip" install --quiet --no-cache-dir '.[client]'
if "$venv/bin/python" -c 'import transformers' 2>/dev/null; then
  echo "FAIL: the client extra pulled transformers" >&2; exit 1
fi
cd "$tmp"  # import the installed package, not the checkout
"$venv/bin/python" - <<'PY'
import sys

from syncclient import SyncClient

assert "transformers" not in sys.modules, "import syncclient imported transformers"
SyncClient("http://127.0.0.1:9", run="check").close()
try:
    from syncclient import SyncCallback  # noqa: F401
except ImportError as exc:
    assert "needs transformers" in str(exc), exc
else:
    raise SystemExit("FAIL: SyncCallback imported without transformers installed")
print("SDK without transformers: SyncClient imports and builds; SyncCallback asks for transformers")
PY
"$venv/bin/weightsync-run" --help >/dev/null  # the zero-code command installs with the client
echo "weightsync-run is installed with the client"
