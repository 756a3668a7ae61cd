"""syncclient.peerlr: the factor of each peer's learning rate, and the scaler that applies it for one step."""

from __future__ import annotations

import math

import pytest
import torch

from syncclient.peerlr import LRScaler, PeerLR


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
