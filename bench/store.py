"""Which S3 client for the hub? ``python bench/store.py [--quick] [--python OTHER_VENV/bin/python]``.

Starts SeaweedFS (tests/s3server.py) and measures each candidate against it, each in a fresh
process of ``--python`` (default: this one): ``ours`` (syncserver.storage: SigV4 presigned URLs
from the standard library, sent with httpx, which the hub has already), ``boto3`` (with
s3transfer for multipart) and ``obstore`` (Rust, object_store). A candidate that is not
installed there is reported as such: ``python3.11 -m venv /tmp/cand && /tmp/cand/bin/pip
install boto3 obstore -e '.[server]'``, then ``--python /tmp/cand/bin/python``.

Per candidate: import time and resident memory added by importing it and building a client
(over an interpreter that has imported the hub, ``syncserver``: FastAPI, httpx...); presigned URLs per second (an
UploadPart URL where the library can sign one); a 128 MB object PUT in one request and in 8 MB
parts, one at a time; GET of it whole; ranged GETs of 1 MiB at random offsets (ms each, what a
reducer pays per slice of an update). MB = 10^6 bytes; best of ``--repeat``. ``--quick``:
16 MB, one repeat, a smoke test. ``--bucket B``: a store that is running already (the
``AWS_*`` variables name it), instead of a SeaweedFS of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CANDIDATES = ("ours", "boto3", "obstore")
PART = 8 << 20
RANGE = 1 << 20


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def best(seconds: list[float], size: int) -> float:
    """MB/s of the fastest try."""
    return size / 1e6 / min(seconds)


# ---- the child: one candidate, in a fresh interpreter ---------------------------------------------
def child(name: str, size: int, repeat: int, seconds: float) -> dict[str, Any]:
    import importlib.util
    import random

    if name != "ours" and importlib.util.find_spec(name) is None:  # before the imports below (~1 CPU-s)
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    import httpx

    import syncserver  # noqa: F401  (the baseline is the hub itself: FastAPI, uvicorn, httpx... imported)

    env = os.environ
    bucket, endpoint = env["BENCH_BUCKET"], env["AWS_ENDPOINT_URL"]
    base = rss_mb()
    began = time.perf_counter()
    client: Any
    if name == "ours":
        from syncserver.storage.s3 import ObjectStore

        client = ObjectStore.from_url(f"s3://{bucket}/bench-ours")
    elif name == "boto3":
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))
    else:
        from obstore.store import S3Store

        client = S3Store(
            bucket,
            prefix="bench-obstore",
            endpoint=endpoint,
            region=env["AWS_REGION"],
            access_key_id=env["AWS_ACCESS_KEY_ID"],
            secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            client_options={"allow_http": True},
        )
    out: dict[str, Any] = {"import_s": time.perf_counter() - began, "rss_added_mb": rss_mb() - base}
    data = os.urandom(size)
    key = "object"
    full = f"bench-{name}/{key}"

    # presigned URLs per second, for ``seconds``
    n, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        if name == "ours":
            client.presign_part(key, "upload-id", 3, expires=600)
        elif name == "boto3":
            params = {"Bucket": bucket, "Key": full, "UploadId": "upload-id", "PartNumber": 3}
            client.generate_presigned_url("upload_part", Params=params, ExpiresIn=600)
        else:
            import obstore

            obstore.sign(client, "PUT", key, datetime.timedelta(seconds=600))  # no part: it cannot sign a query
        n += 1
    out["presign_per_s"] = n / (time.perf_counter() - began)
    out["presign_part"] = name != "obstore"

    def timed(fn: Any) -> float:
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    chunks = lambda view, lo, hi: (view[i : min(i + (1 << 20), hi)] for i in range(lo, hi, 1 << 20))  # noqa: E731
    view = memoryview(data)
    with httpx.Client(timeout=60) as http:

        def put_single() -> None:
            if name == "ours":  # a peer's path: a presigned URL, httpx, the body streamed
                url = client.presign_put(key)
                http.put(url, content=chunks(view, 0, size), headers={"Content-Length": str(size)}).raise_for_status()
            elif name == "boto3":
                client.put_object(Bucket=bucket, Key=full, Body=data)
            else:
                import obstore

                obstore.put(client, key, data, use_multipart=False)

        def put_parts() -> None:
            if name == "ours":
                upload = client.create_multipart(key)
                etags = {}
                for number, lo in enumerate(range(0, size, PART), 1):
                    hi = min(lo + PART, size)
                    url = client.presign_part(key, upload, number)
                    r = http.put(url, content=chunks(view, lo, hi), headers={"Content-Length": str(hi - lo)})
                    r.raise_for_status()
                    etags[number] = r.headers["etag"]
                client.complete_multipart(key, upload, etags)
            elif name == "boto3":
                import io

                from boto3.s3.transfer import TransferConfig

                config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, use_threads=False)
                client.upload_fileobj(io.BytesIO(data), bucket, full, Config=config)
            else:
                import obstore

                obstore.put(client, key, data, use_multipart=True, chunk_size=PART, max_concurrency=1)

        def get_whole() -> None:
            if name == "ours":
                got = client.read(key)
            elif name == "boto3":
                got = client.get_object(Bucket=bucket, Key=full)["Body"].read()
            else:
                import obstore

                got = obstore.get(client, key).bytes()
            assert len(got) == size

        out["put_mb_s"] = best([timed(put_single) for _ in range(repeat)], size)
        out["put_parts_mb_s"] = best([timed(put_parts) for _ in range(repeat)], size)
        out["get_mb_s"] = best([timed(get_whole) for _ in range(repeat)], size)
        rng = random.Random(0)
        offsets = [rng.randrange(0, size - RANGE) for _ in range(32)]

        def ranged() -> None:
            for lo in offsets:
                if name == "ours":
                    got = client.read(key, lo, lo + RANGE)
                elif name == "boto3":
                    span = f"bytes={lo}-{lo + RANGE - 1}"
                    got = client.get_object(Bucket=bucket, Key=full, Range=span)["Body"].read()
                else:
                    import obstore

                    got = obstore.get_range(client, key, start=lo, end=lo + RANGE)
                assert len(got) == RANGE

        out["range_ms"] = min(timed(ranged) for _ in range(repeat)) / len(offsets) * 1e3
    out["rss_after_mb"] = rss_mb()
    return out


# ---- the parent --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 MB, one try: a smoke test")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the candidates run in")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--bucket", help="use this bucket of the store the AWS_* variables name, instead of starting SeaweedFS"
    )
    parser.add_argument("--child", choices=CANDIDATES, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=128_000_000, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size, repeat = (16_000_000, 1) if args.quick else (args.size, args.repeat)
    if args.child:
        print(json.dumps(child(args.child, args.size, args.repeat, 0.2 if args.quick else 1.0)))
        return

    rows: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if args.bucket:
            env["BENCH_BUCKET"] = args.bucket
        else:
            sys.path.insert(0, str(REPO))
            from tests.s3server import SeaweedFS

            folder = stack.enter_context(tempfile.TemporaryDirectory())
            s3 = stack.enter_context(SeaweedFS(Path(folder), volumes=200).start())
            env |= {**s3.env(), "BENCH_BUCKET": s3.bucket}
            print(f"SeaweedFS up in {s3.started_in:.1f} s", flush=True)
        print(f"{size / 1e6:.0f} MB objects, best of {repeat}", flush=True)
        for name in CANDIDATES:
            command = [args.python, __file__, "--child", name, "--size", str(size), "--repeat", str(repeat)]
            command += ["--quick"] if args.quick else []
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                missing = "ModuleNotFoundError" in done.stderr
                print(f"{name}: {'not installed in ' + args.python if missing else done.stderr[-2000:]}")
                continue
            rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    if not rows:
        sys.exit("no candidate ran")
    head = "| | " + " | ".join(rows) + " |"
    print(head, "\n|---|" + "---|" * len(rows))
    metrics = [
        ("import + client (s)", "import_s", "{:.3f}"),
        ("RSS added (MB)", "rss_added_mb", "{:.1f}"),
        ("RSS after the transfers (MB)", "rss_after_mb", "{:.0f}"),
        ("presigned URLs / s", "presign_per_s", "{:,.0f}"),
        ("PUT one request (MB/s)", "put_mb_s", "{:.0f}"),
        ("PUT 8 MB parts (MB/s)", "put_parts_mb_s", "{:.0f}"),
        ("GET whole (MB/s)", "get_mb_s", "{:.0f}"),
        ("ranged GET 1 MiB (ms)", "range_ms", "{:.1f}"),
    ]
    for label, key, fmt in metrics:
        print(f"| {label} | " + " | ".join(fmt.format(r[key]) for r in rows.values()) + " |")
    if any(not r["presign_part"] for r in rows.values()):
        print("obstore signs a method and a path only: no UploadPart URL (its figure is for a PUT URL)")


if __name__ == "__main__":
    main()
