"""The maths of a round: pure numpy functions over one tensor at a time. No I/O, no state.

A round's merged update is computed tensor by tensor so that the hub never holds more than a
tensor's worth of temporaries beside its accumulator (and DiLoCo's momentum).

Outer optimizers, on the sample-weighted mean delta ``mean`` of a round:

- ``avg`` (FedAvg / local SGD): ``update = mean``.
- ``diloco`` (Douillard et al., 2023): the pseudo-gradient is ``g = -mean``; Nesterov momentum
  as in ``torch.optim.SGD(nesterov=True)``: ``m = mu * m + g`` then
  ``update = -lr * (g + mu * m)``. The paper's defaults are ``lr = 0.7``, ``mu = 0.9``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["diloco_step", "fold", "outer_step", "weighted_mean"]


def fold(acc: np.ndarray, delta: np.ndarray, weight: float) -> None:
    """Add ``weight * delta`` into the float32 accumulator ``acc`` in place.

    This is the only in-place function here: the accumulator is the hub's one running copy.
    """
    if acc.shape != delta.shape:
        raise ValueError(f"shape {delta.shape} does not match the accumulator's {acc.shape}")
    if not weight > 0:
        raise ValueError(f"weight must be positive, got {weight}")
    acc += np.float32(weight) * delta


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Sample-weighted mean of deltas (the reference the streaming fold must agree with)."""
    if len(deltas) != len(weights) or not deltas:
        raise ValueError("need one positive weight per delta, and at least one delta")
    total = float(sum(weights))
    if not total > 0 or any(w <= 0 for w in weights):
        raise ValueError("weights must be positive")
    acc = np.zeros(deltas[0].shape, np.float32)
    for delta, weight in zip(deltas, weights, strict=True):
        fold(acc, delta, weight)
    return acc / np.float32(total)


def diloco_step(
    mean: np.ndarray, momentum: np.ndarray, *, lr: float, mu: float
) -> tuple[np.ndarray, np.ndarray]:
    """One Nesterov step on the pseudo-gradient ``-mean``: return ``(update, new momentum)``."""
    grad = -mean
    new_momentum = np.float32(mu) * momentum + grad
    update = np.float32(-lr) * (grad + np.float32(mu) * new_momentum)
    return update.astype(np.float32, copy=False), new_momentum.astype(np.float32, copy=False)


def outer_step(
    kind: str, mean: np.ndarray, momentum: np.ndarray | None, *, lr: float, mu: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """Apply the run's outer optimizer to one tensor's mean delta."""
    if kind == "avg":
        return mean, None
    if kind == "diloco":
        if momentum is None:
            raise ValueError("diloco needs a momentum buffer")
        return diloco_step(mean, momentum, lr=lr, mu=mu)
    raise ValueError(f"unknown outer optimizer {kind!r}; use 'avg' or 'diloco'")
