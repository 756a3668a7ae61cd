"""Fuzz the hub's HTTP API from its own OpenAPI schema with schemathesis.

Every operation gets generated requests, valid and invalid (paths, queries, headers, JSON and
raw bodies). Two checks: no 5xx ever, and every response matches the schema the hub publishes
(errors included: they are declared). The hub holds a started run named ``0`` with peers ``0``
and ``A``, the names a generator tries first, so many requests reach the round logic rather
than a 404. Bounded (a fixed seed, a few examples per operation, short long polls) for CI.

To explore further by hand: ``st run http://127.0.0.1:8000/openapi.json -H 'Authorization:
Bearer …' --checks not_a_server_error,response_schema_conformance --max-examples 500``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from syncwire import iter_chunks
from tests.conftest import Hub, shared_hub
from tests.harness import HTTP

TOKEN = "schemathesis-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# per operation and phase: ~1,600 requests, most of them the coverage phase's. 50 (~2,200 requests)
# ran the hub's lines and branches (syncserver, syncwire) that 20 and 10 ran, none more (coverage.py
# on the hub, 2026-12-02), in 53 s of schemathesis against 38 s
EXAMPLES = 20


def schemathesis_cli() -> list[str]:
    found = shutil.which("st", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    return [found]


@pytest.fixture(scope="module")
def seeded_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One hub for both tests (the schema test only reads it), seeded before the fuzzer's first request."""
    # short long polls: a generated ?wait=600 must not stall the run
    env = {"SYNC_TOKEN": TOKEN, "SYNC_LONG_POLL_SECONDS": "0.2", "SYNC_LEASE_SECONDS": "3600"}
    with shared_hub(tmp_path_factory, "seeded-hub", env=env) as hub:
        http = httpx.Client(base_url=hub.url, headers=AUTH, timeout=10)
        assert http.post("/v1/runs/0/peers", json={"peer": "0", "min_peers": 2}).json()["state"] == "initialise"
        weights = b"".join(
            iter_chunks([("w", np.ones((4, 4), np.float32), "F32"), ("b", np.zeros(4, np.float32), "F32")])
        )
        assert http.put("/v1/runs/0/versions/0", params={"peer": "0"}, content=weights).status_code == 200
        assert http.post("/v1/runs/0/peers", json={"peer": "A"}).json()["state"] == "ready"
        yield hub


def test_api_fuzz_no_server_error_and_schema_conformance(seeded_hub: Hub, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *schemathesis_cli(),
            "run",
            f"{seeded_hub.url}/openapi.json",
            "--header",
            f"Authorization: Bearer {TOKEN}",
            "--checks",
            "not_a_server_error,response_schema_conformance",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            str(EXAMPLES),
            "--seed",
            "20261122",
            "--workers",
            "1",  # 2 threads trip CPython 3.11's non-thread-safe ast.parse inside hypothesis (SystemError)
            "--request-timeout",
            "20",
            "--generation-database",
            "none",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # its report folder, if any, lands here
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert " passed" in out and "failures" not in out.lower().split("summary")[-1], out[-4000:]
    # the hub is alive and its run untouched by the fuzzer's refused uploads
    status = HTTP.get(f"{seeded_hub.url}/v1/runs/0", headers=AUTH).json()
    assert status["version"] >= 0
    assert "Traceback" not in seeded_hub.log(), seeded_hub.log()


def test_openapi_declares_the_error_shape(seeded_hub: Hub) -> None:
    """Each operation documents its errors as ``{"error", "detail"}``, not FastAPI's default."""
    schema = HTTP.get(f"{seeded_hub.url}/openapi.json").json()
    assert "ErrorBody" in schema["components"]["schemas"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            if "422" in responses:
                ref = responses["422"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorBody"), (method, path)
    upload = schema["paths"]["/v1/runs/{run}/rounds/{round}/updates/{peer}"]["put"]
    assert "application/octet-stream" in upload["requestBody"]["content"]
