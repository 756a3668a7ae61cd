"""The limit: a trivial relay on uvicorn (uvloop + httptools) that does no work at all.

``PUT /up?round=R`` reads the body and throws it away; ``GET /down?round=R&n=N&size=B`` waits
until ``N`` uploads of round ``R`` are complete, then sends ``B`` bytes from one preallocated
buffer in 1 MiB chunks. That is the shape of a round (N peers upload, then each downloads
one copy) with nothing in between: no parsing, hashing, disk, folding or merging. Whatever
our hub costs above this is overhead.

python bench/baselines/limit_server.py --port 8123    # or --port 0 --ready-file F
"""

from __future__ import annotations

import argparse
import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from syncserver.process import run_uvicorn

CHUNK = 1 << 20


class LimitApp:
    """A raw ASGI app (no framework: the cheapest thing uvicorn can serve)."""

    def __init__(self) -> None:
        self.done: dict[str, int] = defaultdict(int)
        self.changed = asyncio.Event()
        self.buffer = bytearray()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        path, method = scope["path"], scope["method"]
        if path == "/healthz":
            await self._reply(send, 200, b"ok")
        elif path == "/up" and method == "PUT":
            received = 0
            more = True
            while more:
                message = await receive()
                received += len(message.get("body", b""))
                more = message.get("more_body", False)
            self.done[query["round"]] += 1
            self.changed.set()
            self.changed = asyncio.Event()
            await self._reply(send, 200, str(received).encode())
        elif path == "/down" and method == "GET":
            round_, n, size = query["round"], int(query["n"]), int(query["size"])
            while self.done[round_] < n:
                await self.changed.wait()
            if len(self.buffer) < size:
                self.buffer = bytearray(size)
            view = memoryview(self.buffer)[:size]
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", str(size).encode())],
                }
            )
            for i in range(0, size, CHUNK):
                await send({"type": "http.response.body", "body": view[i : i + CHUNK], "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await self._reply(send, 404, b"no")

    @staticmethod
    async def _reply(send: Any, status: int, body: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: the OS picks one")
    parser.add_argument("--ready-file", type=Path, help="once listening, write the URL here")
    args = parser.parse_args()
    # loop/http "auto" pick uvloop and httptools when installed (uvicorn[standard]), as for the hub
    config = uvicorn.Config(LimitApp(), host="127.0.0.1", port=args.port, log_level="warning")
    run_uvicorn(config, ready_file=args.ready_file)


if __name__ == "__main__":
    main()
