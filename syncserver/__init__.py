"""weightsync hub: an HTTP server that averages the weights of far-apart training peers.

It needs no torch: tensors are numpy arrays in safetensors files (see :mod:`syncwire`).
"""

from __future__ import annotations

__version__ = "0.1.0"

from syncserver.api.factory import create_app
from syncserver.settings import HubSettings

__all__ = ["HubSettings", "__version__", "create_app"]
