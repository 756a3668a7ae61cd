"""A check lease: the body check of an update a peer uploaded to the object store, done by a reducer
(:func:`~syncserver.reduce.check.check_update`, the hub's own check) so that the hub reads no update
body; the flow and the trust model: docs/object-store.md, docs/SECURITY.md. No HTTP, no hub state.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from syncserver.errors import BadRequest, HubError, InvalidUpdate, PayloadTooLarge
from syncserver.reduce.check import Checked, UpdateRules, check_update
from syncserver.storage.s3 import ObjectStore
from syncwire import get_codec, wire_layout

__all__ = ["MAX_DETAIL", "REFUSALS", "CheckJob", "CheckReport", "CheckRules", "Refusal", "accept", "work_check"]

MAX_DETAIL = 2000
#: the errors :func:`check_update` raises, by code: the only refusals a reducer may report
REFUSALS: dict[str, type[HubError]] = {cls.code: cls for cls in (BadRequest, InvalidUpdate, PayloadTooLarge)}


class CheckRules(BaseModel):
    """:class:`UpdateRules` on the wire (the layout follows from the schema and the codec)."""

    model_config = ConfigDict(extra="forbid")
    tensors: dict[str, list[int]] = Field(description="The run's schema: each tensor's shape, in file order.")
    codec: str
    max_bytes: int = Field(ge=0)
    norm: bool

    @classmethod
    def of(cls, rules: UpdateRules) -> CheckRules:
        tensors = {name: list(shape) for name, shape in rules.schema.items()}
        return cls(tensors=tensors, codec=rules.codec.spec, max_bytes=rules.max_bytes, norm=rules.norm)

    def rules(self) -> UpdateRules:
        codec = get_codec(self.codec)
        schema = {name: tuple(shape) for name, shape in self.tensors.items()}
        return UpdateRules(wire_layout(codec, schema), schema, codec, self.max_bytes, self.norm)


class CheckJob(BaseModel):
    """A check lease as the hub hands it out (``POST /v1/reduce/lease``, ``kind: "check"``),
    reported to ``/checked`` with a :class:`CheckReport`."""

    model_config = ConfigDict(extra="forbid")
    report: ClassVar[str] = "checked"
    kind: Literal["check"] = "check"
    lease: str = Field(description="The lease's id: renew it and report it by this id.")
    run: str
    round: int
    peer: str
    seconds: float = Field(description="The lease's length: renew it within this many seconds.")
    object: str = Field(description="The update's object in the hub's bucket.")
    size: int = Field(ge=0, description="Its size, as the store said when the upload completed.")
    digest: str = Field(description="The sha-256 the peer declared (the hub compares it, not the reducer).")
    rules: CheckRules


class Refusal(BaseModel):
    """What the hub answers the peer: ``status``, ``error`` (code) and ``detail`` (reason)."""

    model_config = ConfigDict(extra="forbid")
    status: int
    error: str
    detail: str = Field(max_length=MAX_DETAIL)


class CheckReport(BaseModel):
    """A reducer's report of a check lease (``POST /v1/reduce/leases/{lease}/checked``): the body's
    ``digest``, ``nbytes`` and ``norm`` when it passed, ``refused``, or ``failed`` (not checked)."""

    model_config = ConfigDict(extra="forbid")
    reducer: str = Field(min_length=1, max_length=128)
    seconds: float = Field(ge=0, le=86_400)
    digest: str | None = Field(None, pattern="^[0-9a-f]{64}$")
    nbytes: int | None = Field(None, ge=0, le=2**50)
    norm: float | None = None
    refused: Refusal | None = None
    failed: str | None = Field(None, max_length=MAX_DETAIL)

    @model_validator(mode="after")
    def _one_outcome(self) -> CheckReport:
        passed = self.digest is not None and self.nbytes is not None
        if passed + (self.refused is not None) + (self.failed is not None) != 1:
            raise ValueError("a check report says one thing: passed (digest, nbytes), refused, or failed")
        return self


def work_check(job: CheckJob, reducer: str, *, objects: Callable[[], ObjectStore] | None, **_: object) -> CheckReport:
    """Check the job's object as ``reducer``: one streaming GET into :func:`check_update` (the
    table's ``stop`` and ``pool`` do not apply). A refusal is a report, any other failure a report
    that it failed."""
    started = time.monotonic()

    def report(**outcome: object) -> CheckReport:
        return CheckReport.model_validate({"reducer": reducer, "seconds": time.monotonic() - started, **outcome})

    try:
        if objects is None:
            raise RuntimeError("a check lease reads the object store: give this reducer SYNC_STORE, as the hub has")
        with contextlib.closing(objects().stream(job.object)) as chunks:
            checked = check_update(chunks, job.rules.rules())
    except tuple(REFUSALS.values()) as exc:
        assert isinstance(exc, HubError)
        return report(refused={"status": exc.status, "error": exc.code, "detail": exc.detail[:MAX_DETAIL]})
    except Exception as exc:
        return report(failed=repr(exc)[:MAX_DETAIL])
    return report(digest=checked.digest, nbytes=checked.nbytes, norm=checked.norm)


def accept(report: CheckReport, job: CheckJob) -> Checked | None:
    """The checked body of a reducer's pass that holds up; None: the hub checks the body itself (a
    refusal it cannot confirm without reading the body must not turn a valid update away). Cheap
    checks only (the caller compares the digest): the object's size, a norm exactly when asked, finite, >= 0."""
    norm = report.norm
    if report.digest is None or report.nbytes != job.size or job.rules.norm != (norm is not None):
        return None  # a refusal or failure (no digest with its size: one outcome a report), or a bad pass
    if norm is not None and not (math.isfinite(norm) and norm >= 0):
        return None
    return Checked(report.digest, job.size, norm, report.seconds)
