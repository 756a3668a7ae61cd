"""One fingerprint for a model's weights, the same on the hub and on every peer.

sha-256 over the named float32 arrays in name order, each preceded by its name and shape: equal
digests mean bit-identical weights (what a sync promises). ``weightsync-run --local-peers``
prints the hub's last version's digest, and each hooked peer its own when it leaves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

__all__ = ["weights_sha256"]


def weights_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name], dtype="<f4")
        h.update(f"{name}|{list(a.shape)}\n".encode())
        h.update(a.data.cast("B"))
    return h.hexdigest()
