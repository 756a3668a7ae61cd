"""Overlapped syncs against a real hub: the documented formula, the Trainer callback, late peers.

The formula (``SyncClient.sync_async`` / ``PendingSync.apply``): a peer snapshots ``x_t`` and
sends ``x_t - base``; when the round's merged update ``U`` lands it holds
``base' = base + decode(U)`` (equal on every peer and the hub) and its model becomes
``base' + (x_now - x_t)``, the steps taken meanwhile counting in the next round.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from syncclient import PendingSync, SyncClient, SyncError, SyncResult
from syncclient.callbacks import SyncCallback
from syncclient.weights import ModelView
from tests.conftest import Hub
from tests.harness import HTTP, hub_model, run_peers
from tests.models import Blocks, tiny_gpt2

BATCH = 4


def weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in ModelView(model).export().items()}


def local_step(model: torch.nn.Module, seed: int) -> None:
    """A deterministic stand-in for an optimizer step: add a known random tensor to every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in ModelView(model).tensors.values():
            t.add_(torch.randn(t.shape, generator=gen), alpha=1e-2)


def join_all(clients: list[SyncClient], models: list[torch.nn.Module]) -> None:
    run_peers(len(clients), lambda i: clients[i].join(models[i]))  # min_peers: they wait for each other


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_apply_is_the_merged_version_plus_the_steps_taken_meanwhile(hub: Hub, codec: str) -> None:
    run, samples, k = f"overlap-{codec}", [1, 3], 3
    models = [tiny_gpt2(seed=i) for i in range(2)]
    clients = [SyncClient(hub.url, run=run, peer=f"p{i}", min_peers=2, codec=codec, retry_seconds=20) for i in range(2)]
    join_all(clients, models)
    v0 = hub_model(hub, run)

    for i in range(2):
        local_step(models[i], seed=10 + i)  # the work of round 0
    x_t = [weights(m) for m in models]
    # one thread is enough: sync_async returns at once, both updates travel in the background
    pending = [clients[i].sync_async(models[i], samples=samples[i], metrics={"loss": 1.0}) for i in range(2)]
    assert all(isinstance(p, PendingSync) and p.round == 0 for p in pending)
    for step in range(k):  # training goes on while the round closes
        for i in range(2):
            local_step(models[i], seed=100 * step + i)
    x_k = [weights(m) for m in models]

    # one sync at a time: a second one, or a pull, before apply is a clear error
    with pytest.raises(SyncError, match="in flight"):
        clients[0].sync_async(models[0], samples=1)
    with pytest.raises(SyncError, match="in flight"):
        clients[0].sync(models[0], samples=1)
    with pytest.raises(SyncError, match="in flight"):
        clients[0].pull(models[0])

    results = [pending[i].apply(models[i]) for i in range(2)]
    assert all(p.done() for p in pending)
    with pytest.raises(SyncError, match="applied already"):
        pending[0].apply(models[0])
    v1 = hub_model(hub, run)
    for i, result in enumerate(results):
        assert result.version == 1 and clients[i].version == 1 and not result.caught_up
        assert 0 <= result.stall_seconds <= result.seconds
        for name, value in weights(models[i]).items():
            # base' is the hub's version bit for bit, on both peers
            assert np.array_equal(clients[i]._state.base[name], v1[name]), (i, name)  # type: ignore[union-attr]
            # and the model is base' + (x_now - x_t), computed the same way: bit for bit
            expected = v1[name] + (x_k[i][name] - x_t[i][name])
            assert np.array_equal(value, expected), (i, name)
    # v1 is the weighted mean of what the snapshots held (the in-flight steps are not in it)
    total = sum(samples)
    for name, base in v0.items():
        deltas = [x_t[i][name].astype(np.float64) - base for i in range(2)]
        mean = sum(samples[i] * deltas[i] for i in range(2)) / total
        largest = max(np.abs(d).max() for d in deltas)
        tol = 1e-6 if codec == "fp32" else 2 * 2**-8 * largest + 1e-6
        np.testing.assert_allclose(v1[name], base + mean, rtol=0, atol=tol, err_msg=name)

    # The next (blocking) sync carries the steps taken meanwhile, and makes the peers identical.
    results = run_peers(2, lambda i: clients[i].sync(models[i], samples=samples[i]))
    v2 = hub_model(hub, run)
    assert [r.version for r in results] == [2, 2]
    for i in range(2):
        for name, value in weights(models[i]).items():
            assert np.array_equal(value, v2[name]), (i, name)
    if codec == "fp32":  # bf16's error feedback moves round 0's rounding into this round
        for name, base in v1.items():
            mean = sum(samples[i] * (x_k[i][name].astype(np.float64) - x_t[i][name]) for i in range(2)) / total
            np.testing.assert_allclose(v2[name], base + mean, rtol=0, atol=1e-6, err_msg=name)
    for client in clients:
        client.leave()


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_overlapped_syncs_snapshot_into_the_same_memory_each_time(hub: Hub, codec: str) -> None:
    """The snapshot's float32 copy is kept from sync to sync (allocating it each time cost GPT-2
    more than copying into it): the same arrays every sync, and the formula each time."""
    model, run = tiny_gpt2(seed=3), f"kept-{codec}"
    client = SyncClient(hub.url, run=run, peer="p", min_peers=1, codec=codec, retry_seconds=20)
    client.join(model)
    kept: dict[str, int] = {}
    for sync in range(3):
        local_step(model, seed=sync)
        x_t = weights(model)
        pending = client.sync_async(model, samples=1)
        local_step(model, seed=10 + sync)  # meanwhile
        x_now = weights(model)
        assert {name: np.array_equal(a, x_t[name]) for name, a in client._kept.items()} == dict.fromkeys(x_t, True)
        kept = kept or {name: id(a) for name, a in client._kept.items()}
        assert {name: id(a) for name, a in client._kept.items()} == kept
        pending.apply(model)
        version = hub_model(hub, run)
        for name, value in weights(model).items():
            assert np.array_equal(value, version[name] + (x_now[name] - x_t[name])), (sync, name)
    client.leave()


def test_a_late_peer_catches_up_when_its_overlapped_sync_is_applied(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory("--round-timeout", "1", "--lease-seconds", "30")
    names = ["a", "b", "c"]
    models = [tiny_gpt2(seed=i) for i in range(3)]
    clients = [SyncClient(hub.url, run="late", peer=n, min_peers=2, retry_seconds=20) for n in names]
    join_all(clients, models)
    for i in range(3):
        local_step(models[i], seed=i)
    # a and b sync; c trains on: the deadline closes round 0 without it
    run_peers(2, lambda i: clients[i].sync(models[i], samples=1))
    v1 = hub_model(hub, "late")

    pending = clients[2].sync_async(models[2], samples=1)  # refused (409) in the background
    local_step(models[2], seed=42)  # steps taken meanwhile: dropped with the rest
    result = pending.apply(models[2])
    assert result.caught_up and result.version == 1 and clients[2].version == 1
    for name, value in weights(models[2]).items():
        assert np.array_equal(value, v1[name]), name

    # c takes part in the next round again, overlapped, and is not late this time
    for i in range(3):
        local_step(models[i], seed=50 + i)
    pending = clients[2].sync_async(models[2], samples=1)
    others = run_peers(2, lambda i: clients[i].sync(models[i], samples=1))
    result = pending.apply(models[2])
    assert not result.caught_up and result.version == 2 and {r.version for r in others} == {2}
    rounds = HTTP.get(f"{hub.url}/v1/runs/late").json()["rounds"]
    assert rounds[0]["dropped"] == ["c"] and set(rounds[-1]["participants"]) == set(names)
    v2 = hub_model(hub, "late")
    for model in models:  # no local steps since the snapshot: everyone holds version 2
        for name, value in weights(model).items():
            assert np.array_equal(value, v2[name]), name
    for client in clients:
        client.leave()


# ---- the Trainer callback ------------------------------------------------------------------------


class RecordingClient(SyncClient):
    """A real SyncClient that notes, in the Trainer's event list, when it syncs and applies."""

    def __init__(self, *args: Any, events: list[tuple[Any, ...]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events = events
        self.finals: list[bool] = []  # the final= of each blocking sync

    def sync(self, model: torch.nn.Module, *, samples: int, metrics: Any = None, final: bool = False) -> SyncResult:
        self.events.append(("sync", samples, dict(metrics or {})))
        self.finals.append(final)
        return super().sync(model, samples=samples, metrics=metrics, final=final)

    def sync_async(self, model: torch.nn.Module, *, samples: int, metrics: Any = None) -> PendingSync:
        self.events.append(("sync_async", samples, dict(metrics or {})))
        pending = super().sync_async(model, samples=samples, metrics=metrics)
        apply = pending.apply

        def recorded(model: torch.nn.Module) -> SyncResult:
            self.events.append(("apply",))
            return apply(model)

        pending.apply = recorded  # type: ignore[method-assign]
        return pending


class Steps(TrainerCallback):
    """Notes each step end; stops training at ``stop_at`` (an early stop: train end mid-round)."""

    def __init__(self, events: list[tuple[Any, ...]], stop_at: int | None) -> None:
        self.events, self.stop_at = events, stop_at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.events.append(("step", state.global_step))
        if state.global_step == self.stop_at:
            control.should_training_stop = True
        return control


@pytest.mark.parametrize(
    ("max_steps", "stop_at", "expected"),
    [
        # steps 2, 4: overlapped; 6 too; 7 is the last step: blocking
        (7, None, ["sync_async", "apply", "sync_async", "apply", "sync_async", "apply", "sync"]),
        # stopped at step 5: train end applies step 4's sync, then a blocking one for step 5
        (10, 5, ["sync_async", "apply", "sync_async", "apply", "sync"]),
    ],
)
def test_callback_overlaps_and_ends_identical(
    hub: Hub, tmp_path: Path, max_steps: int, stop_at: int | None, expected: list[str]
) -> None:
    run, k = f"cb-overlap-{max_steps}", 2
    events: list[list[tuple[Any, ...]]] = [[], []]
    results: list[list[SyncResult]] = [[], []]
    models = [tiny_gpt2(seed=10), tiny_gpt2(seed=11)]
    clients = [RecordingClient(hub.url, run=run, peer=f"peer-{i}", min_peers=2, events=events[i]) for i in range(2)]
    callbacks = [
        SyncCallback(client=clients[i], sync_every=k, overlap=True, on_sync=results[i].append) for i in range(2)
    ]
    args = [
        TrainingArguments(
            output_dir=str(tmp_path / f"peer-{i}"),
            per_device_train_batch_size=BATCH,
            max_steps=max_steps,
            learning_rate=1e-3,
            logging_steps=1000,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        for i in range(2)
    ]
    # built one after the other: building a Trainer resets accelerate's process-wide state
    trainers = [
        Trainer(
            model=models[i],
            args=args[i],
            train_dataset=Blocks(64, seed=i),
            # Steps first: a step's end is noted before the sync callback may apply a result in it
            callbacks=[Steps(events[i], stop_at), callbacks[i]],
        )
        for i in range(2)
    ]
    run_peers(2, lambda i: trainers[i].train())

    last = stop_at or max_steps
    for i in range(2):
        calls = [e for e in events[i] if e[0] != "step"]
        assert [e[0] for e in calls] == expected, events[i]
        # each overlapped sync is applied at a later step end than the one it was sent at
        # (or at the next sync, or at train end), with at least one step trained meanwhile
        position = {id(e): n for n, e in enumerate(events[i])}
        for sent, applied in zip(calls[0::2], calls[1::2], strict=False):
            if sent[0] == "sync_async":
                between = events[i][position[id(sent)] : position[id(applied)]]
                assert any(e[0] == "step" for e in between), events[i]
        # every update says its step; samples count the steps since the previous snapshot
        sent = [e for e in calls if e[0] in ("sync", "sync_async")]
        steps = [int(e[2]["step"]) for e in sent]
        assert steps == sorted({*range(k, last + 1, k), last})
        assert [e[1] for e in sent] == [(b - a) * BATCH for a, b in zip([0, *steps], steps, strict=False)]
        assert [r.version for r in results[i]] == list(range(1, len(sent) + 1))
        assert callbacks[i].syncs == len(sent) and not any(r.caught_up for r in results[i])

    # The hub saw the step in every update's metrics (the dashboard plots against it).
    updates = HTTP.get(f"{hub.url}/v1/runs/{run}").json()["updates"]
    assert sorted({int(u["metrics"]["step"]) for u in updates}) == steps
    # Bit-identical weights on both peers after the final blocking sync, equal to the hub's last version.
    final = hub_model(hub, run)
    for model in models:
        assert model.lm_head.weight is model.transformer.wte.weight
        for name, value in weights(model).items():
            assert np.array_equal(value, final[name]), name


def test_overlap_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="overlap"):
        SyncCallback("http://hub:8000", sync_every=1, run="r", overlap="yes")  # type: ignore[arg-type]


def test_sync_async_before_join_is_a_clear_error() -> None:
    client = SyncClient("http://127.0.0.1:9", run="r")
    try:
        with pytest.raises(SyncError, match="join"):
            client.sync_async(tiny_gpt2(), samples=1)
    finally:
        client.close()
