"""The round maths against hand-computed values (tiny arrays, like Flower's aggregate_test)."""

from __future__ import annotations

import numpy as np
import pytest

from syncserver.reduce.aggregate import delayed_nesterov_step, diloco_step, fold, outer_step, warmup, weighted_mean


def test_weighted_mean_by_samples() -> None:
    a = np.array([1.0, 2.0], np.float32)
    b = np.array([4.0, -2.0], np.float32)
    # (1*1 + 3*4) / 4 = 3.25 ; (1*2 + 3*-2) / 4 = -1
    np.testing.assert_array_equal(weighted_mean([a, b], [1, 3]), np.array([3.25, -1.0], np.float32))


def test_fold_keeps_a_running_mean_in_place_and_checks_inputs() -> None:
    mean = np.zeros(2, np.float32)
    fold(mean, np.array([1.0, 2.0], np.float32), 2, before=0)  # the first update is the mean
    np.testing.assert_array_equal(mean, [1.0, 2.0])
    fold(mean, np.array([4.0, -4.0], np.float32), 6, before=2)  # 1 * 2/8 + 4 * 6/8 = 3.25; 0.5 - 3 = -2.5
    np.testing.assert_array_equal(mean, [3.25, -2.5])
    with pytest.raises(ValueError, match="shape"):
        fold(mean, np.zeros(3, np.float32), 1, before=8)
    with pytest.raises(ValueError, match="positive"):
        fold(mean, np.zeros(2, np.float32), 0, before=8)


F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    ("values", "weights", "expected"),
    [
        ([2e38, 2e38], [1, 1], 2e38),  # the float32 sum (4e38) *was* Inf
        ([F32_MAX, F32_MAX], [1, 2], F32_MAX),  # 1/3 and 2/3 round up in float32: clipped, not Inf
        ([F32_MAX, -F32_MAX], [1, 1], 0.0),
        ([1e25, 1e25], [2**40, 2**40], 1e25),  # 1e25 x 2^40 x 2 summed in float32 is near its limit
    ],
    ids=["2e38", "max-rounding", "opposite", "1e25-x-2^40"],
)
def test_the_weighted_mean_is_finite_whenever_the_inputs_are(
    values: list[float], weights: list[int], expected: float
) -> None:
    deltas = [np.full(3, v, np.float32) for v in values]
    got = weighted_mean(deltas, weights)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.float32(expected), rtol=1e-6, atol=1e-6)


def test_the_fold_is_the_same_bits_every_time() -> None:
    """A restarted hub re-folds the acknowledged updates in the same order: same bits."""
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(1000).astype(np.float32) for _ in range(5)]
    weights = [3, 1, 4, 1, 5]
    first, second = weighted_mean(deltas, weights), weighted_mean([d.copy() for d in deltas], weights)
    assert first.tobytes() == second.tobytes()
    exact = sum(d.astype(np.float64) * w for d, w in zip(deltas, weights, strict=True)) / sum(weights)
    np.testing.assert_allclose(first, exact, rtol=0, atol=1e-6)


def test_weighted_mean_rejects_bad_weights() -> None:
    with pytest.raises(ValueError):
        weighted_mean([], [])
    with pytest.raises(ValueError):
        weighted_mean([np.zeros(1, np.float32)], [-1])


def test_diloco_two_nesterov_steps_by_hand() -> None:
    lr, mu = 0.7, 0.9
    m = np.zeros(1, np.float32)
    # step 1: mean delta 1.0 -> g = -1; m = -1; update = -0.7 * (-1 + 0.9 * -1) = 1.33
    u1, m = diloco_step(np.array([1.0], np.float32), m, lr=lr, mu=mu)
    np.testing.assert_allclose(u1, [1.33], rtol=1e-6)
    np.testing.assert_allclose(m, [-1.0])
    # step 2: mean delta 0.5 -> g = -0.5; m = 0.9 * -1 - 0.5 = -1.4; update = -0.7 * (-0.5 - 1.26) = 1.232
    u2, m = diloco_step(np.array([0.5], np.float32), m, lr=lr, mu=mu)
    np.testing.assert_allclose(m, [-1.4], rtol=1e-6)
    np.testing.assert_allclose(u2, [1.232], rtol=1e-6)


def test_diloco_matches_torch_sgd_nesterov() -> None:
    torch = pytest.importorskip("torch")
    p = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    m = np.zeros(3, np.float32)
    ours = np.zeros(3, np.float32)
    rng = np.random.default_rng(0)
    for _ in range(4):
        mean = rng.standard_normal(3).astype(np.float32)
        p.grad = torch.from_numpy(-mean)  # pseudo-gradient
        opt.step()
        update, m = diloco_step(mean, m, lr=0.7, mu=0.9)
        ours += update
    np.testing.assert_allclose(ours, p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_outer_step_plain_average_is_the_mean() -> None:
    mean = np.array([0.25], np.float32)
    update, momentum = outer_step("avg", mean, None, lr=0.7, mu=0.9)
    assert update is mean and momentum is None
    with pytest.raises(ValueError, match="unknown outer"):
        outer_step("adam", mean, None, lr=1, mu=0)


def test_delayed_nesterov_over_a_whole_step_is_one_nesterov_step() -> None:
    """Four asynchronous parts of an outer step, applied as they come, move the model as one
    Nesterov step on their sum does, and leave the same momentum (Liu et al., 2024)."""
    lr, mu = 0.7, 0.9
    rng = np.random.default_rng(1)
    m0 = rng.standard_normal(5).astype(np.float32)
    parts = [rng.standard_normal(5).astype(np.float32) * 0.25 for _ in range(4)]
    moved, m = np.zeros(5, np.float32), m0.copy()
    for i, part in enumerate(parts):
        update, m = outer_step("diloco", part, m, lr=lr, mu=mu, fresh=i == 0, complete=i == 3)
        moved += update
        if i < 3:  # until the step completes, a part moves the model by plain SGD, no momentum
            np.testing.assert_allclose(update, lr * part, rtol=1e-6)
    whole, m_whole = diloco_step(np.sum(parts, axis=0), m0, lr=lr, mu=mu)
    np.testing.assert_allclose(moved, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, m_whole, rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_of_a_whole_step_is_diloco_bit_for_bit() -> None:
    mean, m = np.array([0.3, -1.7], np.float32), np.array([0.2, 0.1], np.float32)
    a = delayed_nesterov_step(mean, m, lr=0.7, mu=0.9, fresh=True, complete=True)
    b = diloco_step(mean, m, lr=0.7, mu=0.9)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_warmup_ramps_momentum_and_keeps_each_step_at_most_the_mean() -> None:
    """Over the warm-up, ``lr_t * (1 + mu_t) == 1``: no step moves the weights more than the
    mean delta at once; the first is plain averaging; from ``length`` on, the run's own values."""
    lr, mu, length = 0.7, 0.9, 20
    assert warmup(lr, mu, 0, length) == (1.0, 0.0)
    for t in range(length):
        lr_t, mu_t = warmup(lr, mu, t, length)
        assert mu_t == pytest.approx(mu * t / length) and lr_t * (1 + mu_t) == pytest.approx(1.0)
    assert warmup(lr, mu, length, length) == (lr, mu) == warmup(lr, mu, 10**6, length)
    assert warmup(lr, mu, 0, 0) == (lr, mu)  # no warm-up: DiLoCo as published
    with pytest.raises(ValueError):
        warmup(lr, mu, -1, length)


def test_a_first_warmup_step_is_plain_averaging_bit_for_bit() -> None:
    mean = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    lr, mu = warmup(0.7, 0.9, 0, 20)
    update, m = diloco_step(mean, np.zeros_like(mean), lr=lr, mu=mu)
    assert np.array_equal(update, mean) and np.array_equal(m, -mean)
