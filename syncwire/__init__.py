"""The wire format weightsync speaks: safetensors framing and the codecs (numpy), and the run
settings both sides take (:mod:`syncwire.runsettings`, plain Python). Shared by the hub (no
torch) and the SDK, so both encode and decode with the very same code. Every name loads on first
use: ``weightsync-run``'s hooks read the run settings in every Python process, without numpy.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syncwire.codecs import (
        Codec,
        Schema,
        available_codecs,
        check_layout,
        decode_tensor,
        encode_model,
        get_codec,
        layout_bytes,
        register_codec,
        wire_layout,
        wire_name,
    )
    from syncwire.format import (
        FormatError,
        HeaderReader,
        StreamReader,
        TensorInfo,
        iter_chunks,
        parse_header,
        read_tensors,
    )

__all__ = ["Codec", "Schema", "available_codecs", "check_layout", "decode_tensor", "encode_model", "get_codec"]
__all__ += ["layout_bytes", "register_codec", "wire_layout", "wire_name"]
__all__ += ["FormatError", "HeaderReader", "StreamReader", "TensorInfo", "iter_chunks", "parse_header", "read_tensors"]


def __getattr__(name: str) -> Any:
    """Each public name from its module, on first use; then a plain attribute."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    codecs = importlib.import_module("syncwire.codecs")  # which imports syncwire.format
    value = globals()[name] = getattr(codecs if hasattr(codecs, name) else sys.modules["syncwire.format"], name)
    return value
