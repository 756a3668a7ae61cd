"""The wire format weightsync speaks: safetensors framing and the codecs. numpy only.

Shared by the hub (:mod:`syncserver`, which must not need torch) and the SDK
(:mod:`syncclient`), so that both sides encode and decode with the very same code.
"""

from __future__ import annotations

from syncwire import quant, sparse  # noqa: F401  (register the int8, int4 and topk codecs)
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
