"""ModelView's overlap half without a hub: the snapshot's kept memory and the rebase's formula.

Hand-computed values are exact in float32 and bfloat16; the random ones check the bits against
numpy's ``base + (x - x_t)``, which the overlap tests' expectations are written in.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncclient.weights import ModelView


def module(**tensors: torch.Tensor) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, value in tensors.items():
        root.register_parameter(name, torch.nn.Parameter(value))
    return root


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rebase_sets_the_merged_version_plus_the_steps_taken_since_the_snapshot(dtype: torch.dtype) -> None:
    model = module(w=torch.tensor([1.5, 1.75], dtype=dtype))  # the model now: steps taken meanwhile
    base, snapshot = {"w": f32(1.5, 1.0)}, {"w": f32(1.25, 2.0)}  # base' = base + decode(U); x_t
    ModelView(model).rebase(base, snapshot)
    assert model.w.dtype == dtype and model.w.requires_grad
    np.testing.assert_array_equal(model.w.detach().float().numpy(), f32(1.75, 0.75))  # base' + (x - x_t)
    np.testing.assert_array_equal(base["w"], f32(1.5, 1.0))  # neither input changes
    np.testing.assert_array_equal(snapshot["w"], f32(1.25, 2.0))


def test_rebase_is_numpys_formula_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    x, x_t, base = (rng.standard_normal((3, 100_003)).astype(np.float32) * 0.02 for _ in range(3))
    model = module(w=torch.tensor(x))
    ModelView(model).rebase({"w": base}, {"w": x_t})
    assert np.array_equal(model.w.detach().numpy(), base + (x - x_t))


def test_the_snapshot_is_a_copy_in_memory_kept_from_sync_to_sync() -> None:
    model = module(w=torch.ones(4), b=torch.zeros(2))
    view, kept = ModelView(model), {}
    first = view.snapshot(kept)
    assert first.keys() == kept.keys() == {"w", "b"}
    arrays = {name: id(a) for name, a in kept.items()}
    with torch.no_grad():
        model.w.add_(1.0)  # a step after the snapshot does not reach it
    np.testing.assert_array_equal(first["w"], np.ones(4, np.float32))
    second = view.snapshot(kept)
    assert {name: id(a) for name, a in second.items()} == arrays  # the same memory, written again
    np.testing.assert_array_equal(second["w"], np.full(4, 2.0, np.float32))
    assert second["w"].dtype == np.float32 and not np.shares_memory(second["w"], model.w.detach().numpy())
