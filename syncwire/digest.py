"""One fingerprint for a model's weights, the same on the hub and on every peer.

sha-256 over the named float32 arrays in name order, each preceded by its name and shape: equal
digests mean bit-identical weights (what a sync promises). Each peer prints its own as it
leaves a run (:func:`left_line`: the hooks at exit, the reference job at its end), and the local
launcher (``syncserver/local.py``) finds those lines in the peers' logs (:data:`LEFT`) and checks
them against the hub's last version.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import numpy as np

__all__ = ["LEFT", "left_line", "weights_sha256"]

LEFT = re.compile(r"^weightsync: (\S+) left run '(\S+)' at version (\d+); weights sha256 ([0-9a-f]{64})$", re.M)
"""A :func:`left_line` in a log: peer, run, version, digest."""


def weights_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name], dtype="<f4")
        h.update(f"{name}|{list(a.shape)}\n".encode())
        h.update(a.data.cast("B"))
    return h.hexdigest()


def left_line(peer: str, run: str, version: int, digest: str) -> str:
    """The line a peer prints on stderr as it leaves ``run`` at ``version`` with weights of ``digest``."""
    return f"weightsync: {peer} left run {run!r} at version {version}; weights sha256 {digest}"
