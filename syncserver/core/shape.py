"""What a run's schema implies, worked out once: requests must not redo O(schema) work.

A run's schema is fixed by version 0 and may hold 100,000 tensors (a mixture-of-experts
checkpoint: a 7 MB safetensors header). Rebuilding the update layout and its header for
every HEAD or PUT took 1.4-5.3 s *on the event loop* with such a run, and four clients
polling it stalled every other run on the hub (a status took 4-16 s). So the layout, the
size limits and the JSON of the schema that every ready peer is sent are computed here,
in a worker thread, when the schema becomes known (version 0, or a hub's start), and requests
only read them.
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
        # the header may be a few times the size of the run's own (other writers pad it, add
        # metadata), not the format's 8 MiB cap: a small run's limit stays small
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
