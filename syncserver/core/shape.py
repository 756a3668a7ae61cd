"""What a run's schema implies, worked out once, in a worker thread, when it becomes known.

A schema may hold 100,000 tensors (a mixture-of-experts checkpoint: a 7 MB safetensors header).
Rebuilding the update layout and header per HEAD or PUT took 1.4-5.3 s *on the event loop*, and
four clients polling such a run stalled every other run (a status took 4-16 s): requests only
read what is computed here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from syncwire import Codec, Schema, TensorInfo, layout_bytes, wire_layout
from syncwire.codecs import Layout
from syncwire.format import MAX_HEADER_BYTES, encode_header

__all__ = ["HEADER_SLACK", "RunShape"]

HEADER_SLACK = 64 * 1024  # bytes an update's safetensors header may exceed twice the run's own


@dataclass(frozen=True)
class RunShape:
    """A run's schema and what follows from it. Built by :meth:`of` (O(schema): in a worker thread)."""

    schema: Schema
    layout: Layout  # every wire tensor an update must hold (the run's codec)
    max_update_bytes: int  # the largest update body the hub reads
    parameters: int
    schema_lists: dict[str, list[int]]  # tensor -> shape, as a ready answer carries it
    schema_json: bytes  # the same, as JSON

    @classmethod
    def of_infos(cls, infos: Mapping[str, TensorInfo], codec: Codec, max_body_bytes: int) -> RunShape:
        """The shape of a version 0 whose header gave ``infos``: its tensors in file order."""
        schema = {i.name: i.shape for i in sorted(infos.values(), key=lambda i: i.start)}
        return cls.of(schema, codec, max_body_bytes)

    @classmethod
    def of(cls, schema: Schema, codec: Codec, max_body_bytes: int) -> RunShape:
        layout = wire_layout(codec, schema)
        # a few times the run's own header (writers pad it), not 8 MiB: a small run's limit stays small
        own_header, _ = encode_header((name, dtype, shape) for name, (dtype, shape) in layout.items())
        header_cap = min(MAX_HEADER_BYTES, 2 * len(own_header) + HEADER_SLACK)
        lists = {name: list(shape) for name, shape in schema.items()}
        return cls(
            schema=schema,
            layout=layout,
            max_update_bytes=min(8 + header_cap + layout_bytes(layout), max_body_bytes),
            parameters=sum(math.prod(shape) for shape in schema.values()),
            schema_lists=lists,
            schema_json=json.dumps(lists, separators=(",", ":")).encode(),
        )
