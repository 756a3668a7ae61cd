"""The wire format weightsync speaks: safetensors framing and the codecs (numpy), and the run
settings both sides take (:mod:`syncwire.runsettings`, plain Python).

Shared by the hub (:mod:`syncserver`, which must not need torch) and the SDK
(:mod:`syncclient`), so that both sides encode and decode with the very same code. Every name
here loads on first use: ``weightsync-run``'s hooks read the run settings in every Python
process they sit in, and must not import numpy there.
"""

from __future__ import annotations

import importlib
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

__all__ = [
    "Codec",
    "FormatError",
    "HeaderReader",
    "Schema",
    "StreamReader",
    "TensorInfo",
    "available_codecs",
    "check_layout",
    "decode_tensor",
    "encode_model",
    "get_codec",
    "iter_chunks",
    "layout_bytes",
    "parse_header",
    "read_tensors",
    "register_codec",
    "wire_layout",
    "wire_name",
]
_FORMAT = {"FormatError", "HeaderReader", "StreamReader", "TensorInfo", "iter_chunks", "parse_header", "read_tensors"}


def __getattr__(name: str) -> Any:
    """Each public name from its module (the codecs or the format), on first use; then a plain
    attribute."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = "syncwire.format" if name in _FORMAT else "syncwire.codecs"
    value = globals()[name] = getattr(importlib.import_module(home), name)
    return value
