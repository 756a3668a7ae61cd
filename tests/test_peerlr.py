"""syncclient.peerlr: the factor of each peer's learning rate, and the scaler that applies it for one step."""

from __future__ import annotations

import math

import pytest
import torch

from syncclient.peerlr import DEFAULT_PEER_LR, LRScaler, PeerLR, scale_each_step


@pytest.mark.parametrize(
    ("scaling", "peers", "full"), [("none", 4, 1.0), ("sqrt", 4, 2.0), ("linear", 4, 4.0), ("sqrt", 1, 1.0)]
)
def test_the_factor_follows_the_peers_and_ramps_in_over_the_warmup(scaling: str, peers: int, full: float) -> None:
    assert PeerLR(scaling).factor(peers, 0) == full
    ramped = PeerLR(scaling, warmup=4)
    assert [ramped.factor(peers, s) for s in range(6)] == pytest.approx(
        [1 + (full - 1) * s / 4 for s in range(4)] + [full, full]
    )


@pytest.mark.parametrize("peers", [0, -2, 1.5, True])
def test_a_peer_count_below_one_is_refused(peers: object) -> None:
    with pytest.raises(ValueError, match="peers must be an int >= 1"):
        PeerLR("sqrt").factor(peers, 0)  # type: ignore[arg-type]


def test_the_scaler_multiplies_for_one_step_and_restores_without_compounding() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [weight], "lr": 0.1}, {"params": [], "lr": 0.2}])
    scaler = LRScaler()
    scaler.before(opt, math.sqrt(2))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * math.sqrt(2), 0.2 * math.sqrt(2)])
    scaler.before(opt, 2.0)  # a step whose after() never came: restored first, then scaled once
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.4])
    scaler.after()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    scaler.before(opt, 1.0)
    scaler.after()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]


def test_each_step_of_a_hooked_optimizer_is_scaled_and_its_scheduler_keeps_its_own_rates() -> None:
    """What the Lightning callback and the plain-loop hooks use: torch's per-optimizer hooks."""
    weight = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([weight], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    steps = [0]
    remove = scale_each_step(opt, PeerLR("linear", warmup=2), 4, lambda: steps[0])
    moved = []
    for _ in range(4):
        before = weight.item()
        weight.grad = torch.ones(1)
        opt.step()  # plain SGD: the weight moves by exactly the rate the step used
        moved.append(before - weight.item())
        sched.step()
        steps[0] += 1
    # factor 1, 2.5, 4, 4 (linear from 1 to N=4 over 2 steps) times the scheduler's 0.1 / (1 + s)
    assert moved == pytest.approx([0.1 * f / (1 + s) for s, f in enumerate([1.0, 2.5, 4.0, 4.0])])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 5) == sched.get_last_lr()[0]
    remove()
    before = weight.item()
    opt.step()
    assert before - weight.item() == pytest.approx(0.1 / 5)  # unhooked: the scheduler's rate alone
    assert scale_each_step(opt, PeerLR("sqrt"), 1, lambda: 0) is not None  # one peer: nothing to hook


def test_the_default_keeps_every_peer_at_the_given_rate_and_a_scaling_ramps_in_over_a_round() -> None:
    assert DEFAULT_PEER_LR == PeerLR("none", None) == PeerLR()
    assert [DEFAULT_PEER_LR.for_rounds(4).factor(4, s) for s in (0, 2, 100)] == [1.0, 1.0, 1.0]
    sqrt = PeerLR("sqrt")
    assert sqrt.for_rounds(30) == PeerLR("sqrt", 30)
    assert sqrt.for_rounds(None) == PeerLR("sqrt", 0)  # a samples run: no fixed round length
    assert PeerLR("linear", 5).for_rounds(30) == PeerLR("linear", 5)  # a warm-up given stays
    assert [sqrt.for_rounds(4).factor(4, s) for s in (0, 2, 4, 100)] == [1.0, 1.5, 2.0, 2.0]


@pytest.mark.parametrize("warmup", [-1, 2.5, True, "3"])
def test_a_bad_warmup_is_refused(warmup: object) -> None:
    with pytest.raises(ValueError, match="lr_scaling_warmup must be an int >= 0"):
        PeerLR("linear", warmup)  # type: ignore[arg-type]
