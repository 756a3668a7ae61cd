"""Checking an update body that arrives as a stream of bytes from anywhere (an object read with one
GET) exactly as the hub checks a body PUT to it, for the hub (:mod:`syncserver.core.presigned`) or a
reducer (:mod:`syncserver.reduce.checklease`): the PUT path's checks and errors
(:class:`~syncserver.storage.body.BodyCheck`), plus the decoded L2 norm when the run needs it.

A norm needs a tensor's wire parts together (an int8 tensor's scales sit after its values, and a
body may order its tensors as it likes), so such a body goes through a temporary file in ``spool``
(deleted on return) read back with ``pread``: memory stays a few MiB whatever the order.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from syncserver.errors import InvalidUpdate
from syncserver.reduce.engine import MergeEngine
from syncserver.storage.body import BodyCheck
from syncwire import Codec, FormatError, Schema, check_layout
from syncwire.codecs import Layout
from syncwire.format import TensorFile

__all__ = ["Checked", "UpdateRules", "check_update"]


@dataclass(frozen=True)
class UpdateRules:
    """What a run asks of an update body: its wire ``layout`` (from ``schema`` and ``codec``), at
    most ``max_bytes`` bytes, and its decoded norm when ``norm``."""

    layout: Layout
    schema: Schema
    codec: Codec
    max_bytes: int
    norm: bool


@dataclass(frozen=True)
class Checked:
    """A body that passed: its sha-256 (hex), size, decoded L2 norm (None when not asked) and the
    seconds the check took (reading included)."""

    digest: str
    nbytes: int
    norm: float | None
    seconds: float


def check_update(
    chunks: Iterable[bytes | memoryview], rules: UpdateRules, *, spool: str | os.PathLike[str] | None = None
) -> Checked:
    """Check the body ``chunks`` brings; raise the PUT path's error at the first fault, reading no
    further (wrong tensors are refused after the header). ``spool``: default, the system's."""
    started = time.monotonic()
    body = BodyCheck(lambda infos: check_layout(infos, rules.layout), rules.max_bytes)
    with contextlib.ExitStack() as stack:
        file, name = None, ""
        if rules.norm:
            fd, name = tempfile.mkstemp(dir=spool, suffix=".check")
            stack.callback(Path(name).unlink, missing_ok=True)
            file = stack.enter_context(open(fd, "wb"))
        for chunk in chunks:
            body.feed(chunk)
            if file is not None:
                file.write(chunk)
        digest = body.finish()
        norm = None
        if file is not None:
            file.flush()
            with TensorFile(name) as wire:
                try:
                    norm = MergeEngine.norm(wire, rules.codec, rules.schema)
                except FormatError as exc:
                    raise InvalidUpdate(str(exc)) from None
    return Checked(digest, body.received, norm, time.monotonic() - started)
