"""Peers and a real hub, end to end: identical weights, the exact weighted mean, ties kept."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from syncclient import SchemaMismatch, SyncClient
from syncclient.weights import ModelView
from syncserver.reduce.aggregate import diloco_step, warmup
from syncwire import get_codec
from tests.conftest import Hub
from tests.harness import HTTP, Peers, hub_model, run_peers, train_a_little, wait_for
from tests.models import perturb, tiny_bigram, tiny_gpt2


@pytest.fixture(scope="module")
def hub(module_hub: Hub) -> Hub:
    """One hub for the tests here that take ``hub``, each on runs of its own names (tests/conftest.py)."""
    return module_hub


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_three_peers_hold_the_exact_weighted_mean(hub: Hub, codec: str) -> None:
    rounds, n = 3, 3
    snapshots: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (round, peer) -> float64 delta
    bases: dict[int, dict[str, np.ndarray]] = {}
    after: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    samples = [5, 11, 17]

    def peer(i: int) -> bool:
        model = tiny_gpt2(seed=100 + i)  # different inits: everyone must still start from version 0
        client = SyncClient(hub.url, run=f"e2e-{codec}", peer=f"peer-{i}", min_peers=n, codec=codec, retry_seconds=20)
        client.join(model)
        view = ModelView(model)
        for r in range(rounds):
            base = {k: v.astype(np.float64) for k, v in view.export().items()}
            bases.setdefault(r, base)
            train_a_little(model, seed=1000 * r + i)
            snapshots[r, i] = {k: v.astype(np.float64) - base[k] for k, v in view.export().items()}
            result = client.sync(model, samples=samples[i], metrics={"loss": 1.0})
            assert result.version == r + 1 and not result.caught_up
            after[r, i] = {k: v.copy() for k, v in view.export().items()}
        tied = model.lm_head.weight is model.transformer.wte.weight
        client.leave()
        return tied

    assert all(run_peers(n, peer)), "GPT-2's lm_head must stay tied to wte"
    final = hub_model(hub, f"e2e-{codec}")
    assert "lm_head.weight" not in final and "transformer.wte.weight" in final  # the tie travels once
    for r in range(rounds):
        # every peer bit-identical to every other
        for i in range(1, n):
            for name, value in after[r, 0].items():
                assert np.array_equal(value, after[r, i][name]), (r, i, name)
        # equal to an independent float64 weighted mean (fp32 exactly up to rounding; bf16 up to its precision)
        total = sum(samples)
        for name, value in after[r, 0].items():
            mean = sum(samples[i] * snapshots[r, i][name] for i in range(n)) / total
            expected = bases[r][name] + mean
            # bf16: each peer's delta and the merged update are rounded (relative 2^-8 per value), and
            # error feedback moves what a round dropped into the next one: a few ulps of the largest delta
            largest = max(np.abs(snapshots[r, i][name]).max() for i in range(n))
            tol = 1e-6 if codec == "fp32" else 4 * 2**-8 * largest + 1e-6
            np.testing.assert_allclose(value, expected, rtol=0, atol=tol, err_msg=name)
    # and equal to the hub's own version, bit for bit
    for name, value in after[rounds - 1, 0].items():
        assert np.array_equal(value, final[name]), name


Deltas = dict[tuple[int, int], dict[str, np.ndarray]]


def diloco_run(
    hub: Hub, run: str, *, rounds: int, lr: float, mu: float, warmup: int, final: bool
) -> tuple[dict[str, np.ndarray], Deltas, list[dict[str, np.ndarray]]]:
    """Two peers of a DiLoCo run each train a little and sync, ``rounds`` times (``final``: the
    last sync is marked final). Returns the start (float64), each (round, peer)'s delta from
    the version it trained from (float64) and each peer's weights at the end."""
    n = 2
    deltas: Deltas = {}
    start: dict[str, np.ndarray] = {}
    finals: list[dict[str, np.ndarray]] = []

    def peer(i: int) -> None:
        model = tiny_gpt2(seed=i)
        client = SyncClient(
            hub.url,
            run=run,
            peer=f"p{i}",
            min_peers=n,
            outer="diloco",
            outer_lr=lr,
            outer_momentum=mu,
            outer_warmup=warmup,
        )
        info = client.join(model)
        assert info.outer == "diloco" and info.config["outer_warmup"] == warmup
        view = ModelView(model)
        if i == 0:
            start.update({k: v.astype(np.float64) for k, v in view.export().items()})
        for r in range(rounds):
            base = {k: v.astype(np.float64) for k, v in view.export().items()}
            train_a_little(model, seed=10 * r + i)
            deltas[r, i] = {k: v - base[k] for k, v in view.export().items()}
            client.sync(model, samples=1, final=final and r == rounds - 1)
        finals.append({k: v.copy() for k, v in view.export().items()})
        client.leave()

    run_peers(n, peer)
    return start, deltas, finals


def test_diloco_outer_optimizer_end_to_end(hub: Hub) -> None:
    rounds, lr, mu = 2, 0.5, 0.8
    # outer_warmup=0: DiLoCo as published, from the first round
    start, deltas, finals = diloco_run(hub, "diloco", rounds=rounds, lr=lr, mu=mu, warmup=0, final=False)
    for name, x0 in start.items():
        x, m = x0.copy(), np.zeros_like(x0)
        for r in range(rounds):
            mean = (deltas[r, 0][name] + deltas[r, 1][name]) / 2
            update, m = diloco_step(mean, m, lr=lr, mu=mu)
            x = x + update
        np.testing.assert_allclose(finals[0][name], x, atol=1e-5, err_msg=name)
        assert np.array_equal(finals[0][name], finals[1][name])


def test_diloco_warms_up_and_its_final_round_is_plain_averaging(hub: Hub) -> None:
    """The default DiLoCo: momentum ramps up over ``outer_warmup`` outer steps with lr 1/(1+mu_t)
    (the first step is averaging), and a round of last updates (``final=True``) is plain
    averaging that passes the momentum on: nothing trains after it to undo an overshoot."""
    rounds, lr, mu, warm = 4, 0.5, 0.8, 2
    start, deltas, finals = diloco_run(hub, "warm", rounds=rounds, lr=lr, mu=mu, warmup=warm, final=True)
    for name, x0 in start.items():
        x, m = x0.copy(), np.zeros_like(x0)
        for r in range(rounds):
            mean = (deltas[r, 0][name] + deltas[r, 1][name]) / 2
            if r == rounds - 1:
                x = x + mean  # the final round: averaging
                continue
            lr_t, mu_t = warmup(lr, mu, r, warm)
            assert (lr_t, mu_t) == ((1.0, 0.0) if r == 0 else (1 / 1.4, 0.4) if r == 1 else (lr, mu))
            update, m = diloco_step(mean, m, lr=lr_t, mu=mu_t)
            x = x + update
        np.testing.assert_allclose(finals[0][name], x, atol=1e-5, err_msg=name)
        assert np.array_equal(finals[0][name], finals[1][name])


def test_a_lossy_run_flushes_its_residual_at_the_end(hub: Hub) -> None:
    """int4 with ``final=True``: the final round's result is fp32, and one more round sends the
    residual, so the model ends within the residual's own quantisation error of the exact mean."""
    n = 2
    deltas: dict[int, dict[str, np.ndarray]] = {}
    start: dict[str, np.ndarray] = {}
    ends: list[tuple[int, dict[str, np.ndarray]]] = []

    def peer(i: int) -> None:
        model = tiny_gpt2(seed=i)
        client = SyncClient(hub.url, run="flush", peer=f"p{i}", min_peers=n, codec="int4")
        client.join(model)
        view = ModelView(model)
        # every peer holds the run's version 0 after join: each takes its delta from its own copy
        # (reading peer 0's raced it: a KeyError, then a round that waited 180 s for the other)
        mine = {k: v.astype(np.float64) for k, v in view.export().items()}
        if i == 0:
            start.update(mine)
        train_a_little(model, seed=7 + i)
        deltas[i] = {k: v.astype(np.float64) - mine[k] for k, v in view.export().items()}
        result = client.sync(model, samples=3, final=True)
        ends.append((result.version, {k: v.copy() for k, v in view.export().items()}))
        client.leave()

    run_peers(n, peer)
    assert [v for v, _ in ends] == [2, 2], "the final round, then the residual's round"
    final = hub_model(hub, "flush")
    codec = get_codec("int4")
    for name, x0 in start.items():
        assert np.array_equal(ends[0][1][name], ends[1][1][name]) and np.array_equal(ends[0][1][name], final[name])
        mean = (deltas[0][name] + deltas[1][name]) / 2
        if not np.any(mean):
            continue
        exact = x0 + mean
        once = (
            sum(  # what one int4 encoding of each delta loses, as the final model would carry it
                deltas[i][name].astype(np.float32)
                - codec.decode(codec.encode(deltas[i][name].astype(np.float32)), mean.shape)
                for i in range(n)
            )
            / n
        )
        error = np.linalg.norm(final[name] - exact)
        assert error < 0.3 * np.linalg.norm(once) + 1e-6, (name, error, np.linalg.norm(once))


def test_a_last_sync_not_marked_final_is_flushed_in_the_same_round(hub: Hub) -> None:
    """``SyncClient.flush``: a peer whose last sync was an ordinary one (weightsync-run's plain
    loop syncs right after step N, before the program says it stops there) sends its residual
    alone, in the round where a peer whose last sync was final flushes its own: both end on the
    hub's last version. An fp32 run has nothing to flush: no round."""
    ends: dict[int, tuple[int, dict[str, np.ndarray]]] = {}

    def peer(i: int) -> None:
        model = tiny_bigram(seed=i)
        client = SyncClient(hub.url, run="flush-later", peer=f"p{i}", min_peers=2, codec="int8")
        client.join(model)
        perturb(model, seed=i, round_=0)
        if i == 0:
            result = client.sync(model, samples=3, final=True)
        else:
            client.sync(model, samples=3)
            assert client.flushes
            flushed = client.flush(model, samples=3)
            assert flushed is not None
            result = flushed
        ends[i] = (result.version, {k: v.copy() for k, v in ModelView(model).export().items()})
        client.leave()

    run_peers(2, peer)
    final = hub_model(hub, "flush-later")
    for version, weights in ends.values():
        assert version == 2 and weights.keys() == final.keys()
        assert all(np.array_equal(weights[k], final[k]) for k in final)
    model = tiny_bigram()
    lossless = SyncClient(hub.url, run="nothing-to-flush", peer="solo", codec="fp32")
    lossless.join(model)
    perturb(model, seed=0, round_=0)
    lossless.sync(model, samples=1)
    assert not lossless.flushes and lossless.flush(model) is None and lossless.version == 1
    lossless.leave()
    lossless.close()


def test_files_written_over_pruned_ones_change_no_bit(hub_factory: Callable[..., Hub]) -> None:
    """A hub that prunes every round writes its results, versions, uploads, DiLoCo momentum and
    topk residual over the files it pruned (spares.Spares); with ``--spare-files 0`` it writes
    every file new. The same peers' run ends bit for bit the same on both."""
    rounds, ends = 6, []
    for spare_files in ("6", "0"):
        hub = hub_factory("--keep-versions", "1", "--spare-files", spare_files)
        peers = Peers(hub.url, "spares", ["a", "b"], min_peers=2, codec="topk", outer="diloco", outer_warmup=0)
        peers.join()
        for _ in range(rounds):
            peers.parallel(["a", "b"], lambda n, p=peers: p.sync(n, samples=3 if n == "a" else 5, seed=ord(n)))
        final = hub_model(hub, "spares")
        for model in peers.models.values():
            got = ModelView(model).export()
            assert all(np.array_equal(got[name], final[name]) for name in final)
        ends.append(final)
        # the pruned files were kept to be written over (tests/test_store.py shows they are); each
        # round takes what the one before kept, and the last round's pruning, after its version
        # file, keeps some again
        spares = lambda h=hub: list((h.data_dir / "tmp" / "spares").glob("*.spare"))  # noqa: E731
        if spare_files == "0":
            assert not spares()
        else:
            wait_for(spares, "the last round's pruned files kept")
    assert all(np.array_equal(ends[0][name], ends[1][name]) for name in ends[0])


def test_concurrent_joiners_elect_one_initialiser(hub_factory: Callable[..., Hub]) -> None:
    """Eight peers join at the same instant: exactly one uploads version 0, all end identical."""
    hub = hub_factory()  # of its own: it reads the hub's whole log
    n = 8
    barrier = threading.Barrier(n)

    def peer(i: int) -> dict[str, np.ndarray]:
        model = tiny_gpt2(seed=i)
        client = SyncClient(hub.url, run="race", peer=f"racer-{i}", min_peers=n)
        barrier.wait()
        info = client.join(model)
        assert info.world_size == n and info.rank == sorted(f"racer-{j}" for j in range(n)).index(f"racer-{i}")
        client.leave()
        return {k: v.copy() for k, v in ModelView(model).export().items()}

    weights = run_peers(n, peer)
    for w in weights[1:]:
        assert all(np.array_equal(w[k], weights[0][k]) for k in w)
    assert hub.log().count("version 0 from") <= 1  # logged once (warnings only at this log level)
    status = HTTP.get(f"{hub.url}/v1/runs/race").json()
    assert status["version"] == 0 and status["world_size"] == n


def test_schema_mismatch_is_a_clear_error(hub: Hub) -> None:
    first = SyncClient(hub.url, run="mismatch", peer="p0")
    first.join(tiny_gpt2(seed=0))
    other = SyncClient(hub.url, run="mismatch", peer="p1")
    with pytest.raises(SchemaMismatch, match="shape differs"):
        other.join(tiny_gpt2(seed=0, n_embd=64))
    first.leave()
