"""Checking an update body that arrives as a stream of bytes from anywhere (an object in the
store, read with one GET), exactly as the hub checks a body PUT to it.

A plain function: no HTTP, no hub state, no record. Whoever reads the bytes calls it: today the
hub, in a worker thread, on an update a peer uploaded to the object store
(:mod:`syncserver.core.presigned`); a reducer can call it the same way, so that the hub reads
no body at all. It raises the very errors the PUT path raises (:mod:`syncserver.storage.uploads`):

- the size: over the run's limit (413), longer or shorter than its header says (400);
- the header: well-formed safetensors, exactly the run's wire tensors (422);
- the values: no NaN or Inf in any float part (422), scanned as the bytes go by
  (:class:`~syncserver.storage.uploads.FiniteScan`, the PUT path's own scan);
- the decoded update, when the run needs it (its norm guard is on, or its codec can refuse
  well-formed parts: ``check_on_receipt``): its L2 norm, slice by slice as the merge decodes
  (:meth:`MergeEngine.norm <syncserver.reduce.engine.MergeEngine.norm>`), or a 422;
- the sha-256 of every byte, for the caller to compare with what the peer declared.

A norm needs the tensors' wire parts together (an int8 tensor's scales sit after its values,
and a body may order its tensors as it likes), so a body whose norm is taken goes through a
temporary file (``spool``: a folder; deleted on return) and is read back with ``pread`` as the
PUT path reads its staged file; memory stays a few MiB whatever the body's order. Without a
norm nothing is written anywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from syncserver.errors import BadRequest, InvalidUpdate
from syncserver.reduce.engine import MergeEngine
from syncserver.storage.uploads import FiniteScan, check_length
from syncwire import Codec, FormatError, HeaderReader, Schema, check_layout
from syncwire.format import TensorFile

__all__ = ["Checked", "UpdateRules", "check_update"]

Layout = dict[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class UpdateRules:
    """What a run asks of an update body: its wire ``layout`` (from ``schema`` and ``codec``),
    at most ``max_bytes`` bytes, and its decoded norm when ``norm`` (norm guard, or a codec that
    checks on receipt)."""

    layout: Layout
    schema: Schema
    codec: Codec
    max_bytes: int
    norm: bool


@dataclass(frozen=True)
class Checked:
    """A body that passed: its sha-256 (hex), size, decoded L2 norm (None when not asked) and
    the seconds the check took (reading included)."""

    digest: str
    nbytes: int
    norm: float | None
    seconds: float


def check_update(
    chunks: Iterable[bytes | memoryview], rules: UpdateRules, *, spool: str | os.PathLike[str] | None = None
) -> Checked:
    """Check the body ``chunks`` brings, in order; raise the PUT path's error for the first fault.

    Stops reading at the first fault (a body with the wrong tensors is refused after its header).
    ``spool``: the folder of the temporary file a norm needs (default: the system's)."""
    started = time.monotonic()
    digest = hashlib.sha256()
    header = HeaderReader()
    scan: FiniteScan | None = None
    expected: int | None = None
    received = 0
    with contextlib.ExitStack() as stack:
        file, name = None, ""
        if rules.norm:
            fd, name = tempfile.mkstemp(dir=spool, suffix=".check")
            stack.callback(Path(name).unlink, missing_ok=True)
            file = stack.enter_context(open(fd, "wb"))
        for chunk in chunks:
            position = received
            received += len(chunk)
            check_length(received, expected, rules.max_bytes)
            if header.result is None:
                try:
                    if header.feed(chunk):
                        assert header.result is not None
                        infos, _, data_bytes = header.result
                        check_layout(infos, rules.layout)
                        scan = FiniteScan(infos, header.header_bytes)
                        expected = header.header_bytes + data_bytes
                except FormatError as exc:
                    raise InvalidUpdate(str(exc)) from None
                check_length(received, expected, rules.max_bytes)
            if scan is not None:
                scan.feed(position, chunk)
            digest.update(chunk)
            if file is not None:
                file.write(chunk)
        if header.result is None:
            raise BadRequest(f"body ends after {received} bytes, inside the safetensors header")
        assert expected is not None
        if received < expected:
            raise BadRequest(f"body is truncated: {received} of {expected} bytes arrived")
        norm = None
        if file is not None:
            file.flush()
            with TensorFile(name) as wire:
                try:
                    norm = MergeEngine.norm(wire, rules.codec, rules.schema)
                except FormatError as exc:
                    raise InvalidUpdate(str(exc)) from None
    return Checked(digest.hexdigest(), received, norm, time.monotonic() - started)
