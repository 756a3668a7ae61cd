"""The norm guard: one broken peer's huge update is refused before it reaches the average.

A run created with ``norm_guard=F`` (or a hub with ``SYNC_NORM_GUARD=F``) refuses, with 422
``poisoned_update``, an update whose L2 norm is over ``F`` times the median norm of the updates
accepted in this round and the previous one (at least two needed for a verdict). The refused
peer is not waited for: the round closes with the others, and the average is theirs exactly.
"""

from __future__ import annotations

import base64
import hashlib
import math
import time
from collections.abc import Callable

import httpx
import numpy as np
import pytest
import safetensors.numpy
import torch

from syncclient import SyncClient
from syncclient.exceptions import HubError
from syncserver.reduce.aggregate import global_norm, norm_outlier
from syncwire import encode_model, get_codec, iter_chunks
from tests.conftest import Hub
from tests.harness import run_peers
from tests.models import tiny_gpt2


@pytest.fixture(scope="module")
def hub(module_hub: Hub) -> Hub:
    """One hub for the tests here that take ``hub``, each on runs of its own names (tests/conftest.py)."""
    return module_hub


SCHEMA = {"w": (16, 8), "b": (8,)}


# ---- the rule, as pure functions --------------------------------------------------------------
def test_global_norm_is_the_norm_of_everything_as_one_vector() -> None:
    assert global_norm([np.array([3.0], np.float32), np.array([[4.0]], np.float32)]) == 5.0
    assert global_norm([]) == 0.0
    big = np.full(10, 3e38, np.float32)  # squares overflow float32, not float64
    assert math.isclose(global_norm([big]), 3e38 * math.sqrt(10), rel_tol=1e-6)
    assert math.isnan(global_norm([np.array([1.0, np.nan], np.float32)]))
    assert math.isinf(global_norm([np.array([np.inf], np.float32)]))
    x = np.random.default_rng(0).standard_normal((3, 1_500_000)).astype(np.float32)  # crosses chunks
    assert math.isclose(global_norm([x]), float(np.linalg.norm(x.astype(np.float64))), rel_tol=1e-12)


@pytest.mark.parametrize(
    ("norm", "reference", "factor", "expected"),
    [
        (11.0, [1.0, 1.0], 10, 1.0),  # over 10 x the median
        (10.0, [1.0, 1.0], 10, None),  # exactly at the limit: accepted
        (5.0, [1.0, 1.0, 100.0], 10, None),  # the median ignores one outlier among the reference
        (50.0, [1.0, 2.0, 3.0, 1000.0], 10, 2.5),
        (1e6, [1.0], 10, None),  # one reference update: no verdict
        (1e6, [], 10, None),
        (1.0, [0.0, 0.0, 0.0], 10, None),  # peers that did not train: no verdict
        (float("nan"), [1.0, 1.0], 10, 1.0),  # a NaN norm is refused too
        (float("inf"), [1.0, 1.0], 3, 1.0),
    ],
)
def test_norm_outlier(norm: float, reference: list[float], factor: float, expected: float | None) -> None:
    assert norm_outlier(norm, reference, factor) == expected


def test_norm_outlier_needs_a_factor_above_one() -> None:
    with pytest.raises(ValueError, match="above 1"):
        norm_outlier(1.0, [1.0, 1.0], 1.0)


# ---- against a real hub -------------------------------------------------------------------------
def body(arrays: dict[str, np.ndarray], codec: str = "fp32") -> bytes:
    """Float32 arrays as they are, or encoded with ``codec`` (what a peer sends)."""
    if codec == "fp32":
        return b"".join(iter_chunks([(n, a, "F32") for n, a in arrays.items()]))
    encoded = encode_model(get_codec(codec), arrays)
    return b"".join(iter_chunks([(wire, part, dtype) for _, wire, part, dtype in encoded]))


def put(
    http: httpx.Client,
    run: str,
    round_: int,
    peer: str,
    delta: dict[str, np.ndarray],
    samples: int,
    codec: str = "fp32",
) -> httpx.Response:
    data = body(delta, codec)
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(data).digest()).decode() + ":"
    return http.put(
        f"/v1/runs/{run}/rounds/{round_}/updates/{peer}",
        content=data,
        headers={"Content-Digest": digest, "X-Sync-Samples": str(samples)},
    )


def start_run(
    http: httpx.Client, run: str, peers: list[str], schema: dict[str, tuple[int, ...]] = SCHEMA, **config: object
) -> dict[str, np.ndarray]:
    """``peers`` join, then the first uploads version 0; returns version 0.

    The merge floor is the default (``min_merge_peers`` 1): a round may close without a refused
    peer. (With ``min_merge_peers`` = world size it waits until that peer sends a sane update.)
    """
    rng = np.random.default_rng(1)
    model = {n: rng.standard_normal(s).astype(np.float32) for n, s in schema.items()}
    first = http.post(f"/v1/runs/{run}/peers", json={"peer": peers[0], "min_peers": 2, **config})
    assert first.json()["state"] == "initialise", first.text
    for peer in peers[1:]:
        http.post(f"/v1/runs/{run}/peers", json={"peer": peer})
    assert http.put(f"/v1/runs/{run}/versions/0", params={"peer": peers[0]}, content=body(model)).status_code == 200
    assert http.get(f"/v1/runs/{run}").json()["world_size"] == len(peers)
    return model


def model_of(http: httpx.Client, run: str) -> tuple[int, dict[str, np.ndarray]]:
    r = http.get(f"/v1/runs/{run}/model")
    return int(r.headers["x-sync-version"]), safetensors.numpy.load(r.content)


def mean(deltas: list[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    """The hub's fp32 fold, in acknowledgement order."""
    out = {}
    for name, shape in SCHEMA.items():
        acc = np.zeros(shape, np.float32)
        for d, n in deltas:
            acc += np.float32(n) * d[name]
        out[name] = acc / np.float32(sum(n for _, n in deltas))
    return out


def test_poisoned_update_is_refused_and_the_round_closes_without_it(hub: Hub) -> None:
    http = httpx.Client(base_url=hub.url, timeout=30)
    model = start_run(http, "guarded", ["a", "b", "c"], norm_guard=10, round_timeout=600)
    assert http.get("/v1/runs/guarded").json()["config"]["norm_guard"] == 10
    rng = np.random.default_rng(2)

    def honest() -> dict[str, np.ndarray]:
        return {n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in SCHEMA.items()}

    for round_ in range(2):
        d_a, d_b = honest(), honest()
        poisoned = {n: 1000 * v for n, v in honest().items()}
        if round_ == 0:  # round 0 has no reference yet: the honest ones come first
            order = [("a", d_a, 3), ("b", d_b, 5), ("c", poisoned, 4)]
        else:  # round 1: the poisoned one first, judged against round 0's accepted norms
            order = [("c", poisoned, 4), ("a", d_a, 3), ("b", d_b, 5)]
        for peer, delta, samples in order:
            r = put(http, "guarded", round_, peer, delta, samples)
            if peer == "c":
                assert r.status_code == 422, r.text
                refusal = r.json()
                assert refusal["error"] == "poisoned_update" and "not applied" in refusal["detail"]
                assert refusal["factor"] == 10 and refusal["norm"] > 10 * refusal["median"]
                status = http.get("/v1/runs/guarded").json()
                assert "c" not in status["open_round"]["submitted"]
                if round_ == 1:
                    assert status["open_round"]["rejected"] == ["c"]
            else:
                assert r.status_code == 200, r.text
        # the round closed with a and b, at once (not at the 600 s deadline), without c's update
        result = http.get(f"/v1/runs/guarded/rounds/{round_}/result", params={"wait": 10})
        assert result.status_code == 200
        version, got = model_of(http, "guarded")
        expected = mean([(d_a, 3), (d_b, 5)])
        assert version == round_ + 1
        for name in SCHEMA:
            model[name] = model[name] + expected[name]
            np.testing.assert_array_equal(got[name], model[name])
        record = http.get("/v1/runs/guarded").json()["rounds"][-1]
        assert record["participants"] == ["a", "b"] and record["dropped"] == []
    # a sane update from c is welcome again
    for peer in ("a", "b", "c"):
        assert put(http, "guarded", 2, peer, honest(), 1).status_code == 200
    assert http.get("/v1/runs/guarded/rounds/2/result", params={"wait": 10}).status_code == 200
    assert http.get("/v1/runs/guarded").json()["rounds"][-1]["participants"] == ["a", "b", "c"]


def test_without_the_guard_a_huge_update_is_accepted(hub: Hub) -> None:
    """The guard is opt-in: a run without it takes any finite update (and is wrecked by it)."""
    http = httpx.Client(base_url=hub.url, timeout=30)
    start_run(http, "unguarded", ["a", "b", "c"])
    assert http.get("/v1/runs/unguarded").json()["config"]["norm_guard"] is None
    small = {n: np.full(s, 0.01, np.float32) for n, s in SCHEMA.items()}
    for peer in ("a", "b"):
        assert put(http, "unguarded", 0, peer, small, 1).status_code == 200
    huge = {n: np.full(s, 1e4, np.float32) for n, s in SCHEMA.items()}
    assert put(http, "unguarded", 0, "c", huge, 1).status_code == 200


def test_hub_default_and_join_config(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory(env={"SYNC_NORM_GUARD": "10"})
    http = httpx.Client(base_url=hub.url, timeout=30)
    assert http.post("/v1/runs/r1/peers", json={"peer": "a"}).json()["config"]["norm_guard"] == 10
    assert http.post("/v1/runs/r2/peers", json={"peer": "a", "norm_guard": 3}).json()["config"]["norm_guard"] == 3
    r = http.post("/v1/runs/r1/peers", json={"peer": "b", "norm_guard": 5})
    assert r.status_code == 409 and "norm_guard" in r.json()["detail"]
    r = http.post("/v1/runs/r3/peers", json={"peer": "a", "norm_guard": 0.5})
    assert r.status_code == 422 and "norm_guard" in r.json()["detail"]


def test_sdk_peer_with_a_broken_update_gets_poisoned_update(hub: Hub) -> None:
    """Three SyncClients (min_peers = min_merge_peers = 3); one breaks its weights and is refused; it pulls the
    global model and sends a sane (here: empty) update, and the round closes with all three."""
    refused: list[HubError] = []
    http = httpx.Client(base_url=hub.url, timeout=30)

    def peer(i: int) -> dict[str, torch.Tensor]:
        model = tiny_gpt2(seed=i)
        client = SyncClient(
            hub.url, run="sdk-guard", peer=f"p{i}", min_peers=3, min_merge_peers=3, norm_guard=10, retry_seconds=30
        )
        info = client.join(model)
        assert info.config["norm_guard"] == 10
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * (10.0 if i == 2 else 0.01))
        if i == 2:  # wait until the two honest updates are in: they are the reference
            while len(http.get("/v1/runs/sdk-guard").json()["open_round"]["submitted"]) < 2:
                time.sleep(0.05)
            try:
                client.sync(model, samples=8)
            except HubError as exc:
                refused.append(exc)
            client.pull(model)  # back to the global model, as a peer that hit this would
        assert client.sync(model, samples=8).version == 1
        client.leave()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    finals = run_peers(3, peer, timeout=120)
    assert len(refused) == 1 and refused[0].status == 422 and refused[0].code == "poisoned_update"
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name]) and torch.equal(value, finals[2][name]), name


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_the_guard_measures_the_decoded_update(hub: Hub, codec: str) -> None:
    """The norm is that of what the hub would average (the codec's decoded values), summed a
    slice at a time over a tensor of several slices: the refusal reports exactly that norm."""
    schema = {"big": (3, 1 << 20), "b": (8,)}
    http = httpx.Client(base_url=hub.url, timeout=60)
    start_run(http, f"guard-{codec}", ["a", "b", "c"], schema=schema, norm_guard=10, codec=codec)
    rng = np.random.default_rng(5)
    for peer in ("a", "b"):
        delta = {n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in schema.items()}
        assert put(http, f"guard-{codec}", 0, peer, delta, 1, codec).status_code == 200
    poisoned = {n: (100 * rng.standard_normal(s)).astype(np.float32) for n, s in schema.items()}
    r = put(http, f"guard-{codec}", 0, "c", poisoned, 1, codec)
    assert r.status_code == 422 and r.json()["error"] == "poisoned_update"
    c = get_codec(codec)
    decoded = [c.decode(c.encode(x), x.shape) for x in poisoned.values()]
    assert math.isclose(r.json()["norm"], global_norm(decoded), rel_tol=1e-9)
