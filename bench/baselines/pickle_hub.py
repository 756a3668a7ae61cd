"""The origin design, rebuilt small and faithfully, as a baseline to beat. BENCHMARK ONLY.

!!! pickle.loads on bytes from the network runs arbitrary code. This file exists only to
!!! measure the design weightsync replaces, on 127.0.0.1, with our own peers. Nothing in the
!!! product may ever do this (see DESIGN.md, "Safety"); never import this module elsewhere.

What the origin did (a report that used Django, ``requests`` and ``pickle``):

- each peer pickles its whole state dict (torch's ``state_dict()`` turned into arrays, so the
  GPT-2 tie ``lm_head.weight`` = ``transformer.wte.weight`` is broken and sent twice: 652 MB
  instead of 498 MB) and POSTs it as one ``bytes`` body with ``requests``;
- the hub (a synchronous, threaded WSGI-style server) reads each whole body into memory,
  unpickles it and keeps every peer's state dict; each download pickles it again;
- every peer polls until all peers have uploaded (the origin's busy-wait loop), downloads
  every other peer's weights (``requests`` ``.content``, whole bodies) and averages locally.

The server here is the standard library's ``ThreadingHTTPServer`` (one thread per request,
like Django's ``runserver``). Peers are :func:`sync_round`, called from the benchmark.

python bench/baselines/pickle_hub.py --port 8124
"""

from __future__ import annotations

import argparse
import json
import pickle  # BENCHMARK BASELINE ONLY: see the module docstring
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from syncserver.process import write_ready

_STATE: dict[int, dict[str, np.ndarray]] = {}
_LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    """POST /upload/<rank>, GET /count, GET /weights/<rank>, POST /reset."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, body: bytes, content_type: str = "application/octet-stream") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(length)  # the whole body in memory, as Django's request.body
        if self.path.startswith("/upload/"):
            state = pickle.loads(body)  # the origin's flaw (remote code execution), on loopback only
            with _LOCK:
                _STATE[int(self.path.rsplit("/", 1)[1])] = state
            self._send(b"{}", "application/json")
        elif self.path == "/reset":
            with _LOCK:
                _STATE.clear()
            self._send(b"{}", "application/json")
        else:
            self.send_error(404)

    def do_GET(self) -> None:
        if self.path == "/count":
            with _LOCK:
                count = len(_STATE)
            self._send(json.dumps({"count": count}).encode(), "application/json")
        elif self.path.startswith("/weights/"):
            with _LOCK:
                state = _STATE[int(self.path.rsplit("/", 1)[1])]
            self._send(pickle.dumps(state))  # pickled again for every download
        elif self.path == "/healthz":
            self._send(b"ok", "text/plain")
        else:
            self.send_error(404)


def sync_round(url: str, rank: int, world: int, state: dict[str, np.ndarray]) -> dict[str, Any]:
    """One origin-style round for one peer; returns timings, bytes and the averaged arrays.

    ``state`` maps names to float32 arrays as the origin's state dict did (tie broken).
    """
    import requests  # the origin's client; only this baseline uses it

    started = time.monotonic()
    body = pickle.dumps(state)
    up = len(body)
    t_put = time.monotonic()
    with requests.Session() as http:
        http.post(f"{url}/upload/{rank}", data=body).raise_for_status()
        del body
        uploaded = time.monotonic()
        while http.get(f"{url}/count").json()["count"] < world:  # the origin's busy-wait loop
            time.sleep(0.05)
        total = {name: np.array(a, dtype=np.float32) for name, a in state.items()}
        down = 0
        for other in range(world):
            if other == rank:
                continue
            r = http.get(f"{url}/weights/{other}")
            r.raise_for_status()
            content = r.content  # requests reads the whole body (10 KiB at a time)
            down += len(content)
            theirs = pickle.loads(content)  # baseline only, loopback only
            del content, r
            for name, a in theirs.items():
                total[name] += a
            del theirs
    for a in total.values():
        a /= np.float32(world)
    return {
        "t_start": started,
        "t_put": t_put,
        "t_uploaded": uploaded,
        "t_done": time.monotonic(),
        "bytes_up": up,
        "bytes_down": down,
        "averaged": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="the origin's pickle hub (benchmark baseline only)")
    parser.add_argument("--port", type=int, default=0, help="0: the OS picks one")
    parser.add_argument("--ready-file", type=Path, help="once listening, write the URL here")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)  # loopback only, on purpose
    server.daemon_threads = True
    if args.ready_file is not None:
        write_ready(args.ready_file, f"http://127.0.0.1:{server.server_address[1]}")
    server.serve_forever()


if __name__ == "__main__":
    main()
