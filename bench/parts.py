"""One update's upload to the object store, one part at a time against several at once.

    python bench/parts.py                          # loopback, unshaped: 1 and 4 streams
    sudo python bench/parts.py --link 1gbit        # the uploader in a namespace behind a tbf-capped veth

The SDK sends an update's parts through presigned URLs (``syncclient.objects.upload_parts``);
``--streams`` says how many at once. SeaweedFS (tests/s3server.py) is the store, started here.
Each try: create a multipart upload, presign its parts (what the hub does), upload the body
(``--size`` MB of random bytes, 8 MiB parts as the hub plans them) with the SDK's transport,
complete it (nothing is deleted: SeaweedFS frees deleted space only on vacuum, so the
volumes are sized for every try). MB/s = 10^6 bytes over the upload alone; best of ``--repeat``.

``--bucket B``: a store running already (the ``AWS_*`` variables name it), instead of a SeaweedFS of
its own (loopback only). ``--link RATE`` (root): the uploader runs in a network namespace of its own whose veth to the
store's side is capped both ways with ``tc ... tbf`` (bench/wire.py's bucket and queue). This
kernel has tbf but not netem: a bandwidth cap without delay, so one TCP stream's window is
never what limits it; over far-apart links (tens of ms) it is, and that is where parallel
parts pay. On loopback the store's CPU sets the pace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NS = f"wsparts-{os.getpid()}"
HOST_IP, NS_IP = "10.213.0.1", "10.213.0.2"
PART = 8 << 20


def sh(*command: str, check: bool = True) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def child(size: int, streams: list[int], repeat: int) -> dict[str, float]:
    """In the uploader's namespace (or this process): MB/s per stream count, best of ``repeat``."""
    import numpy as np

    from syncclient.objects import PartedUpload, upload_parts
    from syncclient.transport import Transport
    from syncserver.storage.s3 import ObjectStore

    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    view = memoryview(data).cast("B")
    best: dict[str, float] = {}
    with (
        ObjectStore.from_url(os.environ["BENCH_STORE"], os.environ) as store,
        contextlib.closing(Transport("", run="bench", token=None, verify=True, timeout=60, retry_seconds=10)) as t,
    ):
        for n in streams:
            for attempt in range(repeat):
                name = f"parts/{n}-{attempt}"
                upload_id = store.create_multipart(name)
                count = -(-size // PART)
                urls = {k: store.presign_part(name, upload_id, k) for k in range(1, count + 1)}
                upload = PartedUpload(size, PART, urls)
                began = time.perf_counter()
                etags = upload_parts(t, upload, lambda: (view[i : i + (1 << 20)] for i in range(0, size, 1 << 20)), n)
                seconds = time.perf_counter() - began
                store.complete_multipart(name, upload_id, etags)
                best[str(n)] = max(best.get(str(n), 0.0), size / 1e6 / seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=256, help="MB uploaded per try")
    parser.add_argument("--streams", default="1,4", help="stream counts to compare")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--link", help="tc rate of the uploader's link (needs root), e.g. 1gbit")
    parser.add_argument("--bucket", help="a store running already (the AWS_* variables name it), on loopback")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size, streams = args.size * 1_000_000, [int(s) for s in args.streams.split(",")]
    if args.child:
        print(json.dumps(child(size, streams, args.repeat)))
        return
    if args.bucket:
        if args.link:
            parser.error("--bucket runs on loopback: leave out --link")
        os.environ["BENCH_STORE"] = f"s3://{args.bucket}/bench-parts"
        table(args, streams, child(size, streams, args.repeat))
        return

    from tests.s3server import SeaweedFS

    host = HOST_IP if args.link else "127.0.0.1"
    try:
        if args.link:
            sh("ip", "netns", "add", NS)
            sh("ip", "link", "add", "wsp0", "type", "veth", "peer", "eth0", "netns", NS)
            sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", "wsp0")
            sh("ip", "link", "set", "wsp0", "up")
            sh("ip", "-n", NS, "addr", "add", f"{NS_IP}/24", "dev", "eth0")
            sh("ip", "-n", NS, "link", "set", "eth0", "up")
            sh("ip", "-n", NS, "link", "set", "lo", "up")
            bits = float(args.link.lower().removesuffix("bit").replace("g", "e9").replace("m", "e6"))
            burst = str(max(65536 + 1514, int(bits / 8 * 0.004)))
            for where in (["ip", "netns", "exec", NS], []):
                dev = "eth0" if where else "wsp0"
                sh(*where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", args.link,
                   "burst", burst, "latency", "20ms")  # fmt: skip
        volumes = 8 + args.size * args.repeat * len(streams) // 64  # 64 MB volumes; deletes free none
        with tempfile.TemporaryDirectory() as folder, SeaweedFS(Path(folder), host=host, volumes=volumes).start() as s3:
            env = {**os.environ, **s3.env(), "BENCH_STORE": f"s3://{s3.bucket}/bench", "PYTHONPATH": str(REPO)}
            command = [sys.executable, __file__, "--child", "--size", str(args.size), "--streams", args.streams,
                       "--repeat", str(args.repeat)]  # fmt: skip
            if args.link:
                command = ["ip", "netns", "exec", NS, *command]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    finally:
        if args.link:
            sh("ip", "link", "del", "wsp0", check=False)
            sh("ip", "netns", "del", NS, check=False)
    table(args, streams, result)


def table(args: argparse.Namespace, streams: list[int], result: dict[str, float]) -> None:
    link = f"tbf {args.link}" if args.link else "loopback, unshaped"
    print(f"| link | {' | '.join(f'{n} stream(s) MB/s' for n in streams)} |")
    print(f"|---|{'---|' * len(streams)}")
    print(f"| {link}, {args.size} MB, 8 MiB parts | {' | '.join(f'{result[str(n)]:.0f}' for n in streams)} |")


if __name__ == "__main__":
    main()
