"""One peer's requests to one run: the network half of a sync, the latest version, version 0.
No model and no torch: the client hands in encoded parts and an
:class:`~syncclient.update.UpdateState`, and gets back what happened (:class:`Outcome`).

:meth:`RunFlows.exchange` (on the client's worker thread) uploads the update; the hub answers
with the round it went into (in an async run maybe a later one than its base); it long-polls that
round's result and folds into the base every result from the update's base to that round, in
order, as the hub built its versions, so the base ends as the hub's version bit for bit (one
round, always so in a barrier run: folded while it downloads). A refused update (round closed,
async: too stale) brings back the latest version to catch up to; a pruned result, the latest
version as the new base.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from syncclient.exceptions import ConflictError, HubError, HubUnreachable, RoundClosed, StaleUpdate, SyncError
from syncclient.objects import PartedUpload, upload_parts
from syncclient.transport import Digest, Download, OnTensor, Parts, Transport, body_size
from syncclient.update import EncodedUpdate, UpdateState
from syncwire import iter_chunks

__all__ = ["Outcome", "RunFlows"]

log = logging.getLogger(__name__)


class _StoreTrouble(Exception):
    """The object store path failed: the update goes to the hub by PUT instead."""


@dataclass(frozen=True)
class Outcome:
    """What the network half of a sync brought back: the base now holds ``version``. ``latest``:
    the run's latest version, to catch up to (the round closed without us; async: our base was
    too old). ``fresh_base``: ours is in but a result we needed was pruned: this version is the base."""

    bytes_up: int
    bytes_down: int
    upload_seconds: float
    wait_seconds: float
    version: int = -1
    run_samples: int = -1
    next_every: int | None = None  # the run picks its interval: steps from this sync to the next
    latest: Download | None = None
    fresh_base: Download | None = None


class RunFlows:
    """The request flows of one peer in one run, over a :class:`~syncclient.transport.Transport`."""

    def __init__(self, transport: Transport, *, run: str, peer: str, poll: float) -> None:
        self.transport, self.run, self.peer, self.poll = transport, run, peer, poll
        self.path = f"/v1/runs/{run}"
        self.uploads = "hub"  # where updates go, as the hub's ready answer says (hub or store)

    def join(
        self, settings: dict[str, Any], *, version0: Callable[[], Parts], joined: Callable[[float], None]
    ) -> dict[str, Any]:
        """Join and wait until the run starts: the ``ready`` answer (rank, schema, config).
        ``joined(lease_seconds)`` once the hub knows the peer; ``version0()``: the model to upload
        if this peer is told to initialise the run."""
        body = {"peer": self.peer, **settings}
        state: dict[str, Any] = self.transport.call("POST", f"{self.path}/peers", json=body).json()
        joined(float(state.get("lease_seconds", 60.0)))
        said = ""
        while state["state"] != "ready":
            if state["state"] == "initialise":
                self.initialise(version0())
            elif state.get("detail") != said:
                said = state.get("detail", "")
                log.info("run %s: %s", self.run, said)
            start = f"{self.path}/peers/{self.peer}/start"
            state = self.transport.call("GET", start, params={"wait": self.poll}).json()
        self.uploads = state.get("uploads", "hub")
        return state

    def exchange(
        self,
        round_: int,
        update: EncodedUpdate,
        samples: int,
        metrics: dict[str, float],
        state: UpdateState,
        final: bool,
    ) -> Outcome:
        """Upload an update computed from version ``round_`` as it encodes, and fold the merged
        result(s) into ``state``'s base (nobody else touches it while a sync is in flight).
        ``metrics`` go with it, the codec's ratio and error added once encoded. ``final``: this
        peer's last update (``X-Sync-Final``)."""
        started = time.monotonic()
        try:
            size, ack = self._send(round_, update, samples, metrics, state, final)
        except (RoundClosed, StaleUpdate):
            size = body_size(update.parts)  # sent, though refused
            return Outcome(size, 0, time.monotonic() - started, 0.0, latest=self.latest())
        uploaded = time.monotonic()
        landed = int(ack["round"])
        try:
            # the usual case (the round it was computed from): fold our result while it downloads
            stream = state.stream_fold() if landed == round_ else None
            own = self.result(landed, wait=True, on_tensor=stream.take if stream else None)  # ours first
            waited, received = time.monotonic(), own.reader.received
            if stream is not None:
                stream.finish()
            else:  # results of earlier rounds come first: fold in order, as the hub built them
                for earlier in range(round_, landed):
                    result = self.result(earlier, wait=False)
                    state.fold(result.reader.tensors, result.reader.metadata.get("codec"))
                    received += result.reader.received
                state.fold(own.reader.tensors, own.reader.metadata.get("codec"))
        except HubError as exc:
            if exc.status != 410:
                raise
            latest = self.latest()  # a result was pruned: the latest version, which holds ours, is the new base
            down, up = latest.reader.received, uploaded - started
            return Outcome(
                size, down, up, 0.0, latest.version, latest.run_samples, latest.next_every, fresh_base=latest
            )
        return Outcome(
            size, received, uploaded - started, waited - uploaded, landed + 1, own.run_samples, own.next_every
        )

    def hand_in(
        self,
        round_: int,
        update: EncodedUpdate,
        samples: int,
        metrics: dict[str, float],
        state: UpdateState,
        final: bool,
    ) -> int | None:
        """A preempted peer's last update (syncclient.preemption): uploaded and acknowledged, no
        result waited for. The round it landed in; None if that closed without it (the work is lost)."""
        try:
            return int(self._send(round_, update, samples, metrics, state, final)[1]["round"])
        except (RoundClosed, StaleUpdate):
            return None

    def _send(
        self,
        round_: int,
        update: EncodedUpdate,
        samples: int,
        metrics: dict[str, float],
        state: UpdateState,
        final: bool,
    ) -> tuple[int, dict[str, Any]]:
        """Upload an update as it encodes (to the store if the run says so): its size and acknowledgement."""
        headers = {"X-Sync-Samples": str(samples)}
        if final:
            headers["X-Sync-Final"] = "?1"

        def encoded() -> dict[str, float]:  # sent last: the codec's figures are in by then
            sent = dict(metrics)
            update.wait()
            if not state.codec.lossless:
                sent.update(codec_ratio=update.ratio, codec_error=update.error)
            return sent

        def completing() -> dict[str, str]:
            return {"X-Sync-Metrics": json.dumps(encoded())}

        path = f"{self.path}/rounds/{round_}/updates/{self.peer}"
        try:
            ack: dict[str, Any] | None = None
            if self.uploads == "store":
                try:
                    size, ack = self._to_store(path, update, samples, final, encoded)
                except _StoreTrouble as exc:
                    said = "run %s: the object store failed for round %d's update (%s); sending it to the hub"
                    log.warning(said, self.run, round_, exc)
            if ack is None:
                size, ack = self.transport.upload(
                    path, update.parts, what="upload", headers=headers, ready=update.ready, completing=completing
                )
        finally:
            update.settle()
        return size, ack

    def _to_store(
        self,
        path: str,
        update: EncodedUpdate,
        samples: int,
        final: bool,
        metrics: Callable[[], dict[str, float]],
    ) -> tuple[int, dict[str, Any]]:
        """Upload an update straight to the hub's object store as it encodes: presigned part URLs
        from the hub, the parts to the store, then the hub checks and acknowledges it (its answer,
        as a PUT's). An expired URL or an upload the hub forgot (restarted) gets a fresh plan once.
        :class:`_StoreTrouble` when the store path fails; the hub's refusals raise as ever."""
        size = body_size(update.parts)
        key = secrets.token_urlsafe(24)
        digest = Digest()

        def content() -> Iterator[bytes | memoryview]:
            return digest.watch(iter_chunks(update.parts, ready=update.ready))

        for attempt in (1, 2):
            try:
                # one try: a hub that cannot hand out URLs now (store down, restarting) gets the PUT
                plan = self.transport.call("POST", f"{path}/presign", json={"key": key, "size": size}, retry=False)
            except HubUnreachable as exc:
                raise _StoreTrouble(f"no upload plan: {exc}") from exc
            except HubError as exc:
                self._no_store(exc)
                if exc.code == "store_unavailable":
                    raise _StoreTrouble(exc.detail) from exc
                raise
            got = plan.json()
            done = {int(n): etag for n, etag in got["done"].items()}
            upload = PartedUpload(size, got["part_size"], {int(n): u for n, u in got["urls"].items()}, done)
            try:
                etags = upload_parts(self.transport.store(), upload, content)
            except HubUnreachable as exc:
                raise _StoreTrouble(f"uploading the parts: {exc}") from exc
            except HubError as exc:  # 403: an expired URL; 404: an upload the hub aborted
                if attempt == 1 and exc.status in (403, 404):
                    continue
                raise _StoreTrouble(f"uploading the parts: {exc}") from exc
            report = {
                "key": key,
                "size": size,
                "digest": digest.hexdigest(content, size),
                "etags": etags,
                "samples": samples,
                "metrics": metrics(),
                "final": final,
            }
            try:
                answer: dict[str, Any] = self.transport.call("POST", f"{path}/uploaded", json=report).json()
            except HubUnreachable as exc:
                raise _StoreTrouble(f"reporting the upload: {exc}") from exc
            except HubError as exc:
                self._no_store(exc)
                if exc.code == "upload_unknown" and attempt == 1:
                    continue  # the hub restarted: a fresh upload, every part again
                if exc.code in ("store_unavailable", "upload_unknown"):
                    raise _StoreTrouble(exc.detail) from exc
                raise
            return size, answer
        raise _StoreTrouble("the object store refused the parts twice")

    def _no_store(self, exc: HubError) -> None:
        """``409 no_store`` (the hub restarted without ``SYNC_STORE``): this update and the next go
        to the hub by PUT, until a start says otherwise."""
        if exc.code == "no_store":
            self.uploads = "hub"
            raise _StoreTrouble(exc.detail) from exc

    def result(
        self,
        round_: int,
        *,
        wait: bool,
        on_tensor: OnTensor | None = None,
    ) -> Download:
        """Round ``round_``'s merged update (``wait``: long-polling while the round is open)."""
        path = f"{self.path}/rounds/{round_}/result"
        while True:
            download = self.transport.download(path, {"wait": self.poll if wait else 0, "peer": self.peer}, on_tensor)
            if download is not None:  # None: the long poll ended with the round still open
                if download.store_seconds is not None:
                    self._downloaded(round_, download.store_seconds)
                return download

    def _downloaded(self, round_: int, seconds: float) -> None:
        """Tell the hub how long a result took from its object store (it saw the 307, not the end:
        the dashboard's download phase). One try: a lost report loses a timeline span only."""
        try:
            self.transport.call(
                "POST",
                f"{self.path}/peers/{self.peer}/downloaded",
                json={"round": round_, "seconds": round(seconds, 4)},
                retry=False,
                timeout=10,
            )
        except SyncError as exc:
            log.debug("run %s: the download report for round %d was lost (%s)", self.run, round_, exc)

    def catch_up(self) -> Outcome:
        """No update: just the latest version, to adopt (the base cannot be trusted)."""
        latest = self.latest()
        return Outcome(0, latest.reader.received, 0.0, 0.0, latest=latest)

    def latest(self) -> Download:
        """The run's latest version, whole."""
        download = self.transport.download(f"{self.path}/model", {"peer": self.peer})
        if download is None:
            raise SyncError(f"run {self.run}: the hub answered 204 for the model")
        return download

    def initialise(self, parts: Parts) -> None:
        """Upload version 0 (this peer was told to initialise the run)."""
        log.info("run %s: uploading version 0 (%.1f MB)", self.run, sum(a.nbytes for _, a, _ in parts) / 1e6)
        try:
            self.transport.put(f"{self.path}/versions/0", parts, what="version 0", params={"peer": self.peer})
        except ConflictError as exc:  # someone else initialised (we lost our claim): just pull
            log.info("run %s: %s", self.run, exc.detail)
