"""The maths of a round: pure numpy functions over one tensor (or slice) at a time. No I/O, no state.

The accumulator holds the *running weighted mean* of the updates folded so far, not their
weighted sum: each fold is a convex combination of the mean so far and the new update, so every
value stays between the smallest and the largest input. A float32 sum of ``samples x delta``
overflowed with honest-looking inputs (two updates near 2e38, or 1e25 x 2^53 samples) and
published Inf to every peer.

Outer optimizers, on the sample-weighted mean delta ``mean`` of a round:

- ``avg`` (FedAvg / local SGD): ``update = mean``.
- ``diloco`` (Douillard et al., 2023): the pseudo-gradient is ``g = -mean``; Nesterov momentum as
  in ``torch.optim.SGD(nesterov=True)``: ``m = mu * m + g``, ``update = -lr * (g + mu * m)``, warmed
  up (:func:`warmup`; why: docs/concepts/outer.md), and a run's final round is plain averaging.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "delayed_nesterov_step",
    "diloco_step",
    "fold",
    "global_norm",
    "norm_outlier",
    "outer_step",
    "warmup",
    "weighted_mean",
]

_NORM_CHUNK = 1 << 20  # values squared at a time in float64: 8 MB of temporaries, whatever the tensor
_F32_MAX = float(np.finfo(np.float32).max)


def fold(mean: np.ndarray, delta: np.ndarray, weight: float, before: float) -> None:
    """Fold ``delta`` with ``weight`` into ``mean`` (the weighted mean of updates weighing
    ``before``; 0: none yet), in place: the accumulator is the hub's one running copy.

    ``mean = mean * (before / total) + delta * (weight / total)``, ``total = before + weight``:
    both terms are at most their input in size, so the sum is finite whenever the inputs are, but
    for float32 rounding within a few ulps of float32's largest value; those values are summed in
    float64 and clipped to it (the exact mean is no larger). The same inputs in the same order
    give the same bits: a restarted hub re-folds to the very same mean."""
    if mean.shape != delta.shape:
        raise ValueError(f"shape {delta.shape} does not match the accumulator's {mean.shape}")
    if not weight > 0 or not before >= 0:
        raise ValueError(f"weight must be positive and before non-negative, got {weight} and {before}")
    if before == 0:
        mean[...] = delta
        return
    total = before + weight
    kept = mean * np.float32(before / total)
    taken = delta * np.float32(weight / total)
    try:
        with np.errstate(over="raise"):
            np.add(kept, taken, out=mean)
    except FloatingPointError:
        bad = ~np.isfinite(mean)
        mean[bad] = np.clip(kept[bad].astype(np.float64) + taken[bad], -_F32_MAX, _F32_MAX)


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Sample-weighted mean of deltas, folded as the hub folds them (in this order)."""
    if len(deltas) != len(weights) or not deltas:
        raise ValueError("need one positive weight per delta, and at least one delta")
    if any(not w > 0 for w in weights):
        raise ValueError("weights must be positive")
    mean = np.zeros(deltas[0].shape, np.float32)
    before = 0.0
    for delta, weight in zip(deltas, weights, strict=True):
        fold(mean, delta, weight, before)
        before += weight
    return mean


def diloco_step(mean: np.ndarray, momentum: np.ndarray, *, lr: float, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """One Nesterov step on the pseudo-gradient ``-mean``: return ``(update, new momentum)``."""
    return delayed_nesterov_step(mean, momentum, lr=lr, mu=mu, fresh=True, complete=True)


def delayed_nesterov_step(
    mean: np.ndarray, momentum: np.ndarray, *, lr: float, mu: float, fresh: bool, complete: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Delayed Nesterov (Liu et al., 2024, "Asynchronous Local-SGD Training for Language
    Modeling"): momentum advances once per *whole* outer step, not per update, so it tolerates delay.

    Each part ``g = -mean`` of a step's pseudo-gradient is applied at once as plain SGD
    (``-lr * g``) and added to the momentum; the part that completes the step (``complete``) also
    applies the look-ahead ``-lr * mu * m``; a ``fresh`` part first decays it (``m = mu * m``).
    Over parts ``g_1 .. g_k`` the model moves by ``-lr * (G + mu * m)``, ``m = mu * m_old + G``,
    ``G = g_1 + ... + g_k``: one Nesterov step on ``G``. A one-part step (every barrier round) is
    :func:`diloco_step`, bit for bit."""
    grad = -mean
    new_momentum = (np.float32(mu) * momentum if fresh else momentum) + grad
    look_ahead = grad + np.float32(mu) * new_momentum if complete else grad
    update = np.float32(-lr) * look_ahead
    return update.astype(np.float32, copy=False), new_momentum.astype(np.float32, copy=False)


def warmup(lr: float, mu: float, steps: int, length: int) -> tuple[float, float]:
    """DiLoCo's ``(lr, mu)`` at outer step ``steps`` (0: the first) of a ``length``-step warm-up:
    ``mu_t = mu * steps / length`` and ``lr = 1 / (1 + mu_t)`` (so ``lr_t * (1 + mu_t) = 1``), then
    the run's own from step ``length`` on (0: no warm-up, DiLoCo as published)."""
    if steps < 0 or length < 0:
        raise ValueError(f"steps and length must be >= 0, got {steps} and {length}")
    if steps >= length:
        return lr, mu
    mu_t = mu * steps / length
    return 1.0 / (1.0 + mu_t), mu_t


def outer_step(
    kind: str,
    mean: np.ndarray,
    momentum: np.ndarray | None,
    *,
    lr: float,
    mu: float,
    fresh: bool = True,
    complete: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Apply the run's outer optimizer to one tensor's mean delta (``fresh``/``complete``: the
    Delayed Nesterov clock of :func:`delayed_nesterov_step`; a barrier round is both)."""
    if kind == "avg":
        return mean, None
    if kind == "diloco":
        if momentum is None:
            raise ValueError("diloco needs a momentum buffer")
        return delayed_nesterov_step(mean, momentum, lr=lr, mu=mu, fresh=fresh, complete=complete)
    raise ValueError(f"unknown outer optimizer {kind!r}; use 'avg' or 'diloco'")


def global_norm(tensors: Iterable[np.ndarray]) -> float:
    """L2 norm of several tensors taken as one vector, summed in float64 (no overflow for any
    finite float32, no drift over a billion values). NaN or Inf anywhere gives a non-finite norm."""
    total = 0.0
    for tensor in tensors:
        flat = np.asarray(tensor).reshape(-1)
        for i in range(0, flat.size, _NORM_CHUNK):
            chunk = flat[i : i + _NORM_CHUNK].astype(np.float64)
            total += float(np.dot(chunk, chunk))
    return float(np.sqrt(total))


def norm_outlier(norm: float, reference: Sequence[float], factor: float) -> float | None:
    """The poisoned-update rule: that median if ``norm`` is over ``factor`` times the median of
    ``reference`` (norms already accepted), else None. No verdict with under two reference norms
    (the median of one is that update) or a median of 0 (peers that did not train): the guard only
    ever rejects against a majority of sane updates."""
    if not factor > 1:
        raise ValueError(f"factor must be above 1, got {factor}")
    if len(reference) < 2:
        return None
    median = statistics.median(reference)
    if not median > 0:
        return None
    return median if not norm <= factor * median else None  # a NaN norm is an outlier too
