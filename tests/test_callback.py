"""SyncCallback with a real Trainer against a real hub: the event sequence, sample counts, metrics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainerControl, TrainingArguments

from syncclient import SyncClient
from syncclient.callbacks import SyncCallback
from syncclient.peerlr import PeerLR
from syncclient.schedule import SyncSchedule
from tests.conftest import Hub
from tests.harness import hub_model, run_peers
from tests.models import Blocks


@pytest.fixture(scope="module")
def hub(module_hub: Hub) -> Hub:
    """One hub for the tests here that take ``hub``, each on runs of its own names (tests/conftest.py)."""
    return module_hub


BATCH = 4


def tiny_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1000, n_positions=32)
    return GPT2LMHeadModel(config)


class RecordingClient(SyncClient):
    """A real SyncClient that also notes what the callback asked of it."""

    def __init__(self, *args: Any, events: list[tuple[Any, ...]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events = events
        self.finals: list[bool] = []  # the final= of each blocking sync

    def join(self, model: torch.nn.Module) -> Any:
        self.events.append(("join",))
        return super().join(model)

    def sync(self, model: torch.nn.Module, *, samples: int, metrics: Any = None, final: bool = False) -> Any:
        self.events.append(("sync", samples, dict(metrics or {})))
        self.finals.append(final)
        return super().sync(model, samples=samples, metrics=metrics, final=final)

    def leave(self) -> None:
        self.events.append(("leave",))
        super().leave()


class Recorder(TrainerCallback):
    """Notes the Trainer's events, in the same list as the client's calls."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("train_begin",))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("step", state.global_step))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("evaluate", state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("train_end",))


def training_args(out: Path, *, steps: int, accumulation: int = 1, eval_steps: int | None = None) -> Any:
    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1000,  # the callback must get a fresh loss anyway
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )


def kinds(events: list[tuple[Any, ...]]) -> list[Any]:
    return [e[0] if e[0] in ("join", "sync", "leave", "train_begin", "train_end") else e for e in events]


def test_two_peers_sync_every_k_steps_and_end_identical(hub: Hub, tmp_path: Path) -> None:
    run, k, steps = "callback", 2, 5
    events: list[list[tuple[Any, ...]]] = [[], []]
    results: list[list[Any]] = [[], []]
    models = [tiny_model(seed=10), tiny_model(seed=11)]  # different inits: join makes them equal

    clients = [RecordingClient(hub.url, run=run, peer=f"peer-{i}", min_peers=2, events=events[i]) for i in range(2)]
    callbacks = [SyncCallback(client=clients[i], sync_every=k, on_sync=results[i].append) for i in range(2)]
    # Trainers are built here, one after the other: building one resets accelerate's
    # process-wide state, which a Trainer training in another thread would trip over.
    trainers = [
        Trainer(
            model=models[i],
            args=training_args(tmp_path / f"peer-{i}", steps=steps, eval_steps=k),
            train_dataset=Blocks(64, seed=i, vocab=1000),
            eval_dataset=Blocks(16, seed=99, vocab=1000),
            callbacks=[callbacks[i], Recorder(events[i])],
        )
        for i in range(2)
    ]

    def peer(i: int) -> None:
        if i == 0:  # a script that joins first (to learn its rank): the callback must not join again
            clients[i].join(models[i])
        trainers[i].train()

    run_peers(2, peer)

    for i in range(2):
        assert kinds(events[i]) == [
            "join",
            "train_begin",
            ("step", 1),
            ("step", 2),
            "sync",  # after step 2's log, before step 2's evaluation
            ("evaluate", 2),
            ("step", 3),
            ("step", 4),
            "sync",
            ("evaluate", 4),
            ("step", 5),
            "sync",  # the final, partial round: 1 step
            ("evaluate", 5),
            "leave",  # SyncCallback's on_train_end runs before the Recorder's
            "train_end",
        ], events[i]
        syncs = [e for e in events[i] if e[0] == "sync"]
        assert [s[1] for s in syncs] == [k * BATCH, k * BATCH, 1 * BATCH]
        assert clients[i].finals == [False, False, True]  # the last step's sync is the peer's last
        assert all("loss" in s[2] and np.isfinite(s[2]["loss"]) for s in syncs)
        assert "eval_loss" not in syncs[0][2]  # nothing evaluated before the first sync
        assert "eval_loss" in syncs[1][2] and "eval_loss" in syncs[2][2]  # attached to the next update
        assert [r.version for r in results[i]] == [1, 2, 3]
        assert callbacks[i].last_result is results[i][-1] and callbacks[i].syncs == 3

    # Bit-identical weights on both peers, equal to the hub's last version (tie kept).
    final = hub_model(hub, run)
    for model in models:
        assert model.lm_head.weight is model.transformer.wte.weight
        params = dict(model.named_parameters())
        assert set(params) == set(final)
        for name, p in params.items():
            np.testing.assert_array_equal(p.detach().numpy(), final[name], err_msg=name)


def test_two_peers_on_a_sync_schedule_sync_at_the_same_steps_and_end_identical(hub: Hub, tmp_path: Path) -> None:
    run, steps = "schedule", 6
    plan = SyncSchedule(((1, 2),), 3)  # every step until step 2, then every 3: syncs at 1, 2, 5 and 6 (the end)
    events: list[list[tuple[Any, ...]]] = [[], []]
    models = [tiny_model(seed=10), tiny_model(seed=11)]
    clients = [RecordingClient(hub.url, run=run, peer=f"peer-{i}", min_peers=2, events=events[i]) for i in range(2)]
    callbacks = [SyncCallback(client=clients[i], sync_every=plan) for i in range(2)]
    trainers = [
        Trainer(
            model=models[i],
            args=training_args(tmp_path / f"peer-{i}", steps=steps),
            train_dataset=Blocks(64, seed=i, vocab=1000),
            callbacks=[callbacks[i], Recorder(events[i])],
        )
        for i in range(2)
    ]
    run_peers(2, lambda i: trainers[i].train())

    for i in range(2):
        at = [events[i][k - 1][1] for k, e in enumerate(events[i]) if e[0] == "sync"]  # the step before each sync
        assert at == [1, 2, 5, 6], events[i]
        assert [e[1] for e in events[i] if e[0] == "sync"] == [1 * BATCH, 1 * BATCH, 3 * BATCH, 1 * BATCH]
        assert clients[i].finals == [False, False, False, True] and callbacks[i].syncs == 4
    final = hub_model(hub, run)
    for model in models:
        for name, p in model.named_parameters():
            np.testing.assert_array_equal(p.detach().numpy(), final[name], err_msg=name)


def test_gradient_accumulation_counts_optimizer_steps(hub: Hub, tmp_path: Path) -> None:
    events: list[tuple[Any, ...]] = []
    client = RecordingClient(hub.url, run="accumulate", peer="solo", min_peers=1, events=events)
    trainer = Trainer(
        model=tiny_model(seed=0),
        args=training_args(tmp_path, steps=4, accumulation=2),
        train_dataset=Blocks(64, seed=0, vocab=1000),
        callbacks=[SyncCallback(client=client, sync_every=2)],
    )
    trainer.train()
    syncs = [e for e in events if e[0] == "sync"]
    # 2 optimizer steps x 4 per batch x 2 micro-batches, twice; no extra final sync (4 % 2 == 0).
    assert [s[1] for s in syncs] == [16, 16]
    assert events[0] == ("join",) and events[-1] == ("leave",)


def test_hub_url_form_creates_joins_and_closes_its_client(hub: Hub, tmp_path: Path) -> None:
    callback = SyncCallback(hub.url, sync_every=3, run="url-form", peer="solo", min_peers=1)
    model = tiny_model(seed=0)
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, steps=4),
        train_dataset=Blocks(32, seed=0, vocab=1000),
        callbacks=[callback],
    )
    trainer.train()
    assert callback.join_info is not None and callback.join_info.world_size == 1
    assert callback.syncs == 2 and callback.last_result is not None and callback.last_result.version == 2
    final = hub_model(hub, "url-form")
    np.testing.assert_array_equal(model.transformer.wte.weight.detach().numpy(), final["transformer.wte.weight"])


@pytest.mark.parametrize("sync_every", [0, -1, 1.5, True, "10", None])
def test_sync_every_must_be_a_positive_int(sync_every: Any) -> None:
    with pytest.raises(ValueError, match="sync_every"):
        SyncCallback("http://hub:8000", sync_every=sync_every, run="r")


def test_hub_xor_client() -> None:
    client = SyncClient("http://127.0.0.1:9", run="r")
    try:
        with pytest.raises(ValueError, match="either hub"):
            SyncCallback(sync_every=1)
        with pytest.raises(ValueError, match="either hub"):
            SyncCallback("http://127.0.0.1:9", sync_every=1, client=client)
        with pytest.raises(ValueError, match="client settings"):
            SyncCallback(client=client, sync_every=1, codec="bf16")
    finally:
        client.close()


@pytest.mark.parametrize("hub", ["hub:8000", "ftp://hub:8000", "http://", "localhost"])
def test_hub_must_be_an_http_url(hub: str) -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        SyncCallback(hub, sync_every=1, run="r")


def test_hub_form_needs_a_run_name() -> None:
    with pytest.raises(ValueError, match="run="):
        SyncCallback("http://hub:8000", sync_every=1)


def test_what_a_multi_process_peer_cannot_do_is_refused_before_any_network() -> None:
    """world_size > 1 serves the torch.distributed group (tests/test_group.py); without one, with
    overlap, or with a client that serves no group, the callback says so before any request."""
    args = SimpleNamespace(world_size=2)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    cases = [
        (SyncCallback("http://127.0.0.1:9", sync_every=1, run="r"), "torch.distributed is not initialised"),
        (SyncCallback("http://127.0.0.1:9", sync_every=1, run="r", overlap=True), "one process per peer"),
        (SyncCallback(client=SyncClient("http://127.0.0.1:9", run="r"), sync_every=1), r"group=torch\.distributed"),
    ]
    for callback, refusal in cases:
        with pytest.raises(ValueError, match=refusal):
            callback.on_train_begin(args, state, None, model=tiny_model(0))  # type: ignore[arg-type]
        callback.client.close()


def test_oversized_eval_metrics_shrink_to_the_losses(hub: Hub) -> None:
    """The events one by one: decide in on_step_end, sync in on_log; the hub caps metrics at 4 KiB."""
    events: list[tuple[Any, ...]] = []
    client = RecordingClient(hub.url, run="metrics", peer="solo", min_peers=1, events=events)
    callback = SyncCallback(client=client, sync_every=1)
    model = tiny_model(seed=0)
    args = SimpleNamespace(world_size=1, train_batch_size=4, gradient_accumulation_steps=1)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0, max_steps=2)
    control = TrainerControl()
    callback.on_train_begin(args, state, control, model=model)  # type: ignore[arg-type]
    many = {f"eval_metric_{i:03d}": float(i) for i in range(300)}
    callback.on_evaluate(args, state, control, metrics={"eval_loss": 2.0, **many}, model=model)  # type: ignore[arg-type]
    state.global_step = 1
    callback.on_step_end(args, state, control, model=model)  # type: ignore[arg-type]
    assert control.should_log and events == [("join",)]  # decided, not done yet
    callback.on_log(args, state, control, logs={"loss": 3.0}, model=model)  # type: ignore[arg-type]
    kind, samples, metrics = events[-1]
    assert (kind, samples, metrics.pop("step", 1.0)) == ("sync", 4, 1.0)  # step: for the dashboard
    assert metrics == {"eval_loss": 2.0, "loss": 3.0}
    assert callback.last_result is not None and callback.last_result.version == 1
    callback.on_train_end(args, state, control, model=model)  # type: ignore[arg-type]
    assert events[-1] == ("leave",) and len(events) == 3  # nothing left to sync


class LRRecorder(TrainerCallback):
    """The learning rate each optimizer step used, and what the optimizer holds right after it."""

    def __init__(self) -> None:
        self.used: list[tuple[int, float]] = []
        self.after: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
        self.used.append((state.global_step, optimizer.param_groups[0]["lr"]))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
        self.after.append(optimizer.param_groups[0]["lr"])


def test_each_peer_steps_at_the_lr_scaled_for_the_peers_and_the_scheduler_keeps_its_own(
    hub: Hub, tmp_path: Path
) -> None:
    steps, lr, warmup = 6, 1e-3, 2
    recorders = [LRRecorder(), LRRecorder()]
    callbacks = [
        SyncCallback(
            hub.url, sync_every=3, run="peer-lr", peer=f"p{i}", min_peers=2, lr_scaling="sqrt", lr_scaling_warmup=warmup
        )
        for i in range(2)
    ]
    args = [training_args(tmp_path / f"p{i}", steps=steps) for i in range(2)]
    for a in args:
        a.lr_scheduler_type = "linear"  # the scaling composes with any scheduler: lr(s) = lr x (6 - s) / 6
    trainers = [
        Trainer(
            model=tiny_model(seed=i),
            args=args[i],
            train_dataset=Blocks(64, seed=i, vocab=1000),
            callbacks=[callbacks[i], recorders[i]],
        )
        for i in range(2)
    ]
    run_peers(2, lambda i: trainers[i].train())

    factor = [1.0, 1.0 + (2**0.5 - 1) / 2] + [2**0.5] * 4  # ramps over the first 2 steps, then sqrt(2)
    for recorder, trainer in zip(recorders, trainers, strict=True):
        assert [s for s, _ in recorder.used] == list(range(steps))
        np.testing.assert_allclose(
            [u for _, u in recorder.used], [lr * (steps - s) / steps * factor[s] for s in range(steps)]
        )
        # right after each step the optimizer holds the scheduler's own rate again: it steps from there
        np.testing.assert_allclose(recorder.after, [lr * (steps - s) / steps for s in range(steps)])
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(trainer.lr_scheduler.get_last_lr()[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr_scaling": "cube"}, "lr_scaling must be one of none, sqrt, linear"),
        ({"lr_scaling": None}, "lr_scaling must be one of"),
        ({"lr_scaling_warmup": -1}, "lr_scaling_warmup must be an int >= 0"),
        ({"lr_scaling_warmup": "30"}, "lr_scaling_warmup must be an int >= 0"),
        ({"lr_scaling_warmup": 2.5}, "lr_scaling_warmup must be an int >= 0"),
        ({"lr_scaling_warmup": True}, "lr_scaling_warmup must be an int >= 0"),
    ],
)
def test_a_bad_lr_scaling_is_refused_when_the_callback_is_made(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyncCallback("http://hub:8000", sync_every=1, run="r", **kwargs)


def test_by_default_every_peer_steps_at_the_given_rate_and_a_scaling_ramps_in_over_a_round() -> None:
    assert SyncCallback("http://hub:8000", sync_every=10, run="r").peer_lr.factor(4, 50) == 1.0
    assert SyncCallback("http://hub:8000", sync_every=10, run="r", lr_scaling="sqrt").peer_lr == PeerLR("sqrt", 10)
