#!/usr/bin/env bash
# The hub image installs `.[server]` alone (see Dockerfile, target `hub`). Run the very same
# install in a clean venv, prove torch did not come along, start the hub and ask /healthz.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/hub-venv
python3.11 -m venv "$venv"
"$venv/bin/pip" install --quiet --no-cache-dir '.[server]'
if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "FAIL: the server extra pulled torch" >&2; exit 1
fi
port=$("$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
data=$(mktemp -d)
SYNC_DATA_DIR="$data" "$venv/bin/uvicorn" syncserver.app:app --host 127.0.0.1 --port "$port" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  if "$venv/bin/python" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/healthz').status_code != 200)" 2>/dev/null; then
    echo "hub without torch: healthy on port $port"
    "$venv/bin/python" -c "import sys, syncserver.app; assert 'torch' not in sys.modules; print('no torch imported')"
    exit 0
  fi
  sleep 0.2
done
echo "FAIL: the torch-free hub did not become healthy" >&2
exit 1
