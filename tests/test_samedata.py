"""Two peers that trained on the same data (issue 48): the rule, pure, then a real hub saying so.

Two updates of one round from different peers that are equal (the same sha-256; the same norm to
1e-6 where the hub took norms; the same training loss with the same samples) mean the peers drew
the same batches. The hub says so once per run: a WARNING, ``same_data`` in the run's state,
a line in ``syncserver status`` (test_status_cli.py) and a notice on the dashboard (test_dashboard.py).
"""

from __future__ import annotations

import base64
import hashlib
import json

import httpx
import numpy as np
import pytest

from syncserver.core.samedata import SameData, same_data
from syncserver.records import UpdateRecord
from syncwire import iter_chunks
from tests.conftest import Hub
from tests.harness import wait_for

SCHEMA = {"w": (16, 8), "b": (8,)}


def record(peer: str, digest: str = "a", samples: int = 8, round_: int = 3, **metrics: float) -> UpdateRecord:
    return UpdateRecord(peer, round_, 0, digest * 64, samples, metrics, 1000, 0.0, 0.0, round_)


# ---- the rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mine", "others", "norms", "expected"),
    [
        # the same body, whatever else: peer-0 first, then the new one
        (record("p1"), [record("p0")], {}, SameData(3, ("p0", "p1"), "digest")),
        (record("p1", loss=1.0), [record("p0", loss=2.0)], {"p0": 1.0, "p1": 2.0}, SameData(3, ("p0", "p1"), "digest")),
        # the peer's own earlier update (async: the previous one waits), another round: not a pair
        (record("p1"), [record("p1")], {}, None),
        (record("p1"), [record("p0", round_=2)], {}, None),
        (record("p1", "b"), [record("p0")], {}, None),
        # norms where the hub took both: within 1e-6 relative
        (record("p1", "b"), [record("p0")], {"p0": 2.0, "p1": 2.0 * (1 + 5e-7)}, SameData(3, ("p0", "p1"), "norm")),
        (record("p1", "b"), [record("p0")], {"p0": 2.0, "p1": 2.0 * (1 + 5e-6)}, None),
        (record("p1", "b"), [record("p0")], {"p1": 2.0}, None),  # one norm alone says nothing
        # both norms 0: neither trained anything, even with one body
        (record("p1"), [record("p0")], {"p0": 0.0, "p1": 0.0}, None),
        # the same training loss with the same samples; not with other samples, values or keys
        (
            record("p1", "b", loss=2.5, step=4),
            [record("p0", loss=2.5, step=4)],
            {},
            SameData(3, ("p0", "p1"), "metrics"),
        ),
        (record("p1", "b", train_loss=2.5), [record("p0", train_loss=2.5)], {}, SameData(3, ("p0", "p1"), "metrics")),
        (record("p1", "b", 9, loss=2.5), [record("p0", loss=2.5)], {}, None),
        (record("p1", "b", loss=2.5, step=4), [record("p0", loss=2.5, step=5)], {}, None),
        (record("p1", "b", loss=2.5), [record("p0", loss=2.5, eval_loss=1.0)], {}, None),
        # a step counter alone (weightsync-run's plain hook), or nothing: every peer at pace sends it
        (record("p1", "b", step=4), [record("p0", step=4)], {}, None),
        (record("p1", "b"), [record("p0", "c")], {}, None),
        # the first equal one among several
        (record("p2", "b"), [record("p0", "c"), record("p1", "b")], {}, SameData(3, ("p1", "p2"), "digest")),
    ],
)
def test_same_data(
    mine: UpdateRecord, others: list[UpdateRecord], norms: dict[str, float], expected: SameData | None
) -> None:
    assert same_data(mine, others, norms) == expected


def test_the_message_names_both_peers_the_round_and_the_way_out() -> None:
    message = SameData(3, ("peer-0", "peer-1"), "digest").message
    assert message.startswith(
        "peers peer-0 and peer-1 sent identical updates in round 3: they trained on the same data"
    )
    assert "give each peer its own seed or data shard" in message
    assert "norm (to 1e-06)" in SameData(3, ("a", "b"), "norm").message


# ---- a real hub ----------------------------------------------------------------------------------
def body(arrays: dict[str, np.ndarray]) -> bytes:
    return b"".join(iter_chunks([(n, a, "F32") for n, a in arrays.items()]))


def put(http: httpx.Client, run: str, round_: int, peer: str, delta: dict[str, np.ndarray], **metrics: float) -> None:
    data = body(delta)
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"
    headers = {"Content-Digest": digest, "X-Sync-Samples": "8", "X-Sync-Metrics": json.dumps(metrics)}
    answer = http.put(f"/v1/runs/{run}/rounds/{round_}/updates/{peer}", content=data, headers=headers)
    assert answer.status_code == 200, answer.text


def start_run(http: httpx.Client, run: str, **config: object) -> None:
    """peer-0 and peer-1 join (a barrier of both), peer-0 uploads version 0."""
    assert http.post(f"/v1/runs/{run}/peers", json={"peer": "peer-0", "min_peers": 2, **config}).status_code == 200
    assert http.post(f"/v1/runs/{run}/peers", json={"peer": "peer-1"}).status_code == 200
    rng = np.random.default_rng(1)
    version0 = {n: rng.standard_normal(s).astype(np.float32) for n, s in SCHEMA.items()}
    assert http.put(f"/v1/runs/{run}/versions/0", params={"peer": "peer-0"}, content=body(version0)).status_code == 200


def delta(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in SCHEMA.items()}


def round_(
    http: httpx.Client, run: str, number: int, first: dict[str, np.ndarray], second: dict[str, np.ndarray]
) -> None:
    """Both peers send their update of round ``number``: the round closes."""
    put(http, run, number, "peer-0", first, loss=3.0 - number, step=2.0 * (number + 1))
    put(http, run, number, "peer-1", second, loss=3.5 - number, step=2.0 * (number + 1))
    wait_for(lambda: http.get(f"/v1/runs/{run}").json()["version"] == number + 1, f"round {number}'s close")


def test_identical_updates_are_said_once_per_run(hub: Hub) -> None:
    http = httpx.Client(base_url=hub.url, timeout=30)
    start_run(http, "dup")
    assert http.get("/v1/runs/dup").json()["same_data"] is None
    round_(http, "dup", 0, delta(2), delta(2))  # one seed on both peers: the same body
    said = http.get("/v1/runs/dup").json()["same_data"]
    assert said["round"] == 0 and said["peers"] == ["peer-0", "peer-1"] and said["by"] == "digest"
    assert said["message"].startswith("peers peer-0 and peer-1 sent identical updates in round 0")
    assert "give each peer its own seed or data shard" in said["message"]
    warnings = [line for line in hub.log().splitlines() if "same_data run=dup" in line]
    assert len(warnings) == 1 and " WARNING " in f" {warnings[0]}", hub.log()
    assert "round=0 peers=peer-0,peer-1 equal=digest: peers peer-0 and peer-1" in warnings[0]

    round_(http, "dup", 1, delta(3), delta(3))  # again: no second warning, the notice stays round 0's
    assert http.get("/v1/runs/dup").json()["same_data"] == said
    assert hub.log().count("same_data run=dup") == 1


def test_equal_norms_are_the_same_data_where_the_hub_takes_norms(hub: Hub) -> None:
    """Bits apart (two weights swapped here; GPUs are not bit-deterministic), the norm tells."""
    http = httpx.Client(base_url=hub.url, timeout=30)
    start_run(http, "near", norm_guard=10)  # the norm guard: the hub takes every update's norm
    first = delta(2)
    second = {n: a.copy() for n, a in first.items()}
    second["b"][[0, 1]] = second["b"][[1, 0]]
    round_(http, "near", 0, first, second)
    said = http.get("/v1/runs/near").json()["same_data"]
    assert said["peers"] == ["peer-0", "peer-1"] and said["by"] == "norm"


def test_different_updates_raise_no_notice(hub: Hub) -> None:
    """Peers at one pace send the same step and samples: that alone is no notice."""
    http = httpx.Client(base_url=hub.url, timeout=30)
    start_run(http, "apart", norm_guard=10)
    for number in range(2):
        round_(http, "apart", number, delta(10 + number), delta(20 + number))
    assert http.get("/v1/runs/apart").json()["same_data"] is None
    assert "same_data" not in hub.log()
