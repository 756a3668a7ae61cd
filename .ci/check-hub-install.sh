#!/usr/bin/env bash
# docs/deploying.md's install path, end to end: build the wheel (`python -m build`), install it with the
# `server` extra alone in a clean venv, prove torch did not come along, start the hub from the
# installed package and ask /healthz, the dashboard page with its static files, and /docs with
# its vendored Swagger UI (both are package data: a wheel without them serves 404s).
# Everything after the build runs outside the checkout, so nothing imports its sources instead.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
pid=""
# stop the hub (when started), then remove the venvs, the wheel and the hub's data
trap 'if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi; rm -rf "$work"' EXIT
python3.11 -m venv "$work/build-venv"
"$work/build-venv/bin/pip" install --quiet --no-cache-dir build
# sdist first, then the wheel from the unpacked sdist (build's default): a stale build/ in the
# checkout cannot leak into the wheel, and a file missing from the sdist fails here
"$work/build-venv/bin/python" -m build --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; echo "FAIL: python -m build" >&2; exit 1; }
wheel=$(ls "$work"/dist/weightsync-*.whl)
echo "built $(basename "$wheel")"

venv="$work/hub-venv"
python3.11 -m venv "$venv"
"$venv/bin/pip" install --quiet --no-cache-dir "$wheel[server]"
cd "$work"  # uvicorn and `python -c` put the working directory on sys.path: not the checkout
if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "FAIL: the server extra pulled torch" >&2; exit 1
fi
port=$("$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
SYNC_DATA_DIR="$work/data" "$venv/bin/uvicorn" syncserver.app:app --host 127.0.0.1 --port "$port" &
pid=$!
"$venv/bin/python" - "$port" "$wheel" <<'EOF'
import sys
import time

import httpx

port, wheel = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 30
while True:  # until the hub answers, or the deadline
    try:
        if httpx.get(f"{base}/healthz").status_code == 200:
            break
    except httpx.TransportError:
        pass
    if time.monotonic() > deadline:
        sys.exit("FAIL: the hub from the wheel did not become healthy")
    time.sleep(0.2)
checks = {
    "/": "text/html",  # the dashboard page
    "/static/app.js": "text/javascript",
    "/static/app.css": "text/css",
    "/docs": "text/html",
    "/docs/assets/swagger-ui-bundle.js": "text/javascript",
    "/docs/assets/swagger-ui.css": "text/css",
}
for path, kind in checks.items():
    response = httpx.get(base + path)
    if response.status_code != 200 or not response.headers["content-type"].startswith(kind):
        sys.exit(f"FAIL: GET {path} -> {response.status_code} {response.headers.get('content-type')}")
import syncserver.app

if "torch" in sys.modules:
    sys.exit("FAIL: importing the hub imported torch")
if not syncserver.app.__file__.startswith(sys.prefix):
    sys.exit(f"FAIL: syncserver imported from {syncserver.app.__file__}, not from the wheel")
print(f"hub from {wheel.rsplit('/', 1)[-1]} without torch: /healthz, the dashboard and /docs answer on port {port}")
EOF
