"""SyncClient: join a run, sync every few thousand steps, leave. All HTTP lives here.

A peer keeps ``base``, the global version it started from (float32, one model copy), and
for lossy codecs the error-feedback ``residual`` (one more). A sync sends
``encode(local - base + residual)``, waits for the round's merged update ``U`` and sets the
model to ``base + decode(U)``: the very sum the hub computes, so every peer and the hub hold
bit-identical weights afterwards.

Overlap (:meth:`SyncClient.sync_async`, as in Streaming DiLoCo's eager updates): the peer
snapshots its weights ``x_t`` and encodes ``x_t - base + residual`` on the caller's thread,
then uploads it and waits for ``U`` on one background thread while training goes on.
:meth:`PendingSync.apply` sets ``base' = base + decode(U)`` (bit-identical on every peer and
the hub, as above) and ``model = base' + (model - x_t)``: the steps taken since the snapshot
stay on top of the merged version, and since the next delta is taken against ``base'`` they
count in the next round. So right after an overlapped sync only ``base`` is identical across
peers (each keeps its own in-flight steps); a blocking ``sync`` makes the weights identical
again. ``sync`` is the same code: ``sync_async``, wait, apply with no local steps to keep.

Retries: connect errors, timeouts, 5xx, 429 and 503 are retried with capped exponential
backoff and jitter (tenacity), honouring ``Retry-After``, for ``retry_seconds`` in all;
uploads are idempotent per (peer, round) on the hub, so a retried upload is never applied
twice; downloads resume with HTTP ``Range``. Then :class:`~syncclient.exceptions.HubUnreachable`.

Uploads resume too: before retrying an update, the SDK asks the hub (``HEAD`` with the same
headers) how many bytes of this very update (same digest) it holds, and sends only the rest
with ``Upload-Offset``; the hub verifies the digest over the whole body at the end.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import httpx
import numpy as np
import torch
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_exponential_jitter
from tqdm.auto import tqdm

from syncclient._model import ModelView
from syncclient.exceptions import (
    AuthError,
    ConflictError,
    HubError,
    HubUnreachable,
    NotFound,
    RoundClosed,
    SchemaMismatch,
    SyncError,
)
from syncwire import Codec, StreamReader, get_codec, iter_chunks, layout_bytes, wire_layout, wire_name
from syncwire.codecs import slices

__all__ = ["JoinInfo", "PendingSync", "SyncClient", "SyncResult"]

log = logging.getLogger(__name__)

_RETRY_STATUS = {429, 500, 502, 503, 504}
_PROGRESS_BYTES = 32 << 20


@dataclass(frozen=True)
class JoinInfo:
    """Where a peer stands after joining."""

    run: str
    peer: str
    rank: int
    world_size: int
    version: int
    codec: str
    outer: str
    config: dict[str, Any]


@dataclass(frozen=True)
class SyncResult:
    """What one sync did. ``caught_up`` means the round closed without this peer's update
    (it was late): the model was brought to the latest version and its local work dropped."""

    version: int
    bytes_up: int
    bytes_down: int
    seconds: float
    upload_seconds: float
    wait_seconds: float
    caught_up: bool = False
    compression: float = 1.0  # float32 bytes / bytes sent
    codec_error: float = 0.0  # ||delta - decoded|| / ||delta|| of what was sent
    # of ``seconds``, the part spent on the caller's (training) thread: all of it for ``sync``;
    # for ``sync_async`` the snapshot and encoding, waiting in ``apply`` and applying
    stall_seconds: float = 0.0


@dataclass
class _Download:
    reader: StreamReader
    version: int  # X-Sync-Version: the model version the body is (or leads to)


@dataclass(frozen=True)
class _Outcome:
    """What the background half of a sync brought back. ``latest`` is set when the round
    closed without us: the run's latest version, to catch up to."""

    bytes_up: int
    bytes_down: int
    upload_seconds: float
    wait_seconds: float
    latest: _Download | None = None


class PendingSync:
    """A sync on its way, from :meth:`SyncClient.sync_async`.

    ``done()`` tells, without blocking, whether the round's merged update has arrived (and
    been folded into the client's base); ``apply(model)`` loads it, keeping the steps taken
    since the snapshot, and waits for it first if need be. Apply it exactly once, before the
    client's next sync.
    """

    def __init__(
        self,
        client: SyncClient,
        future: Future[_Outcome],
        round_: int,
        snapshot: dict[str, np.ndarray] | None,
        started: float,
        stall: float,
        stats: dict[str, float],
    ) -> None:
        self._client, self._future, self.round = client, future, round_
        self._snapshot = snapshot  # x_t (None for a blocking sync: nothing to keep)
        self._started, self._stall, self._stats = started, stall, stats

    def done(self) -> bool:
        """Whether ``apply`` would return without waiting for the hub."""
        return self._future.done()

    def apply(self, model: torch.nn.Module) -> SyncResult:
        """Load the merged version plus this peer's steps since the snapshot into ``model``."""
        return self._client._apply(self, model)


class _Retry(Exception):
    """A response worth retrying (5xx, 429, 503); carries its Retry-After."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"{response.status_code} from {response.request.url.path}")
        self.response = response
        retry_after = response.headers.get("retry-after", "")
        self.retry_after = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None


def _tls_problem(exc: BaseException) -> str | None:
    """What to do about a TLS failure that no retry can fix; None for anything else.

    A certificate the SDK does not trust (self-signed, another host, expired) or an https://
    URL to a plain-HTTP hub. A TLS connection cut midway (a hub restarting) is retried.
    """
    cause: BaseException | None = exc
    for _ in range(16):  # the __cause__/__context__ chain: httpx -> httpcore -> ssl
        if cause is None:
            break
        if isinstance(cause, ssl.SSLCertVerificationError):
            return "the hub's TLS certificate is not trusted: pass verify=<the CA bundle that signed it>"
        if isinstance(cause, ssl.SSLError) and cause.reason == "WRONG_VERSION_NUMBER":
            return "the hub does not speak TLS there: use http://, or start it with --ssl-certfile"
        cause = cause.__cause__ or cause.__context__
    return None


def _retryable(exc: BaseException) -> bool:
    # a TLS setup error is not transport trouble: retrying it for retry_seconds only hides it
    return isinstance(exc, _Retry) or (isinstance(exc, httpx.TransportError) and _tls_problem(exc) is None)


def _error(response: httpx.Response) -> HubError:
    """Translate an error response into the SDK's exception (the one place that does)."""
    try:
        body = response.json()
        code, detail = str(body.get("error", "error")), str(body.get("detail", response.text))
    except (ValueError, AttributeError):
        body, code, detail = {}, "error", response.text[:500]
    status = response.status_code
    if status == 401:
        return AuthError(status, code, detail, body)
    if status == 404:
        return NotFound(status, code, detail, body)
    if status == 409:
        cls = RoundClosed if code == "round_closed" else ConflictError
        return cls(status, code, detail, body)
    return HubError(status, code, detail, body)


def _digest(chunks: Iterator[memoryview | bytes]) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return "sha-256=:" + base64.b64encode(h.digest()).decode() + ":"


class SyncClient:
    """One peer's connection to a run on a hub.

    >>> client = SyncClient("http://hub:8000", run="imdb-gpt2", peer="gpu-eu-1")
    >>> client.join(model)            # model now equals the run's latest version
    >>> client.sync(model, samples=256_000, metrics={"loss": 3.1})
    >>> client.leave()

    ``codec``, ``outer``, ``outer_lr``, ``outer_momentum``, ``min_peers``, ``round_timeout`` and
    ``norm_guard`` (refuse updates over that many times the usual norm) configure the run if this
    peer creates it; for an existing run they must match (or be
    None to accept the run's). ``min_peers`` is also the rendezvous size: the run starts once
    that many peers joined, and ranks follow sorted peer names, not join order.

    ``verify`` checks the hub's TLS certificate: True (the system's CAs), the path of a CA
    bundle (a PEM file, or a folder of them) for a hub with its own CA, or an ``ssl.SSLContext``.
    """

    def __init__(
        self,
        hub: str,
        *,
        run: str,
        peer: str | None = None,
        token: str | None = None,
        codec: str | None = None,
        outer: str | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        min_peers: int | None = None,
        round_timeout: float | None = None,
        norm_guard: float | None = None,
        verify: bool | str | ssl.SSLContext = True,
        timeout: float = 60.0,
        retry_seconds: float = 600.0,
    ) -> None:
        if not hub.startswith(("http://", "https://")):
            raise ValueError(f"hub must be an http:// or https:// URL, got {hub!r}")
        if codec is not None:
            get_codec(codec)  # fail here, not at the hub
        self.hub = hub.rstrip("/")
        self.run = run
        self.peer = peer or f"{socket.gethostname()}-{os.getpid()}"
        self.retry_seconds = retry_seconds
        self._config = {
            "codec": codec,
            "outer": outer,
            "outer_lr": outer_lr,
            "outer_momentum": outer_momentum,
            "min_peers": min_peers,
            "round_timeout": round_timeout,
            "norm_guard": norm_guard,
        }
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if isinstance(verify, str):  # httpx wants a context for a CA bundle
            folder = os.path.isdir(verify)
            verify = ssl.create_default_context(capath=verify if folder else None, cafile=None if folder else verify)
        self._http = httpx.Client(
            base_url=self.hub,
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=8, max_keepalive_connections=4),
        )
        self._runs = f"/v1/runs/{run}"
        # a long poll must end (answered) well before the read timeout, or waiting for a slow
        # round would look like a dead hub: retried with backoff, then HubUnreachable
        self._poll = max(1.0, min(20.0, timeout / 2))
        self.version = -1
        self.rank: int | None = None
        self.world_size: int | None = None
        self.codec: Codec | None = None
        self._base: dict[str, np.ndarray] | None = None
        self._residual: dict[str, np.ndarray] | None = None
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self._lease = 60.0
        self._max_download: int | None = None  # data bytes a hub body may declare; set at join
        self._worker: ThreadPoolExecutor | None = None  # the one thread a sync's network work runs on
        self._inflight: PendingSync | None = None  # started, not yet applied: base is the worker's

    # ---- the public surface --------------------------------------------------------------
    def join(self, model: torch.nn.Module) -> JoinInfo:
        """Join the run and load the global version into ``model``.

        The first peer of a new run uploads ``model`` as version 0; every other peer waits
        for it, so all start identical. Blocks until the run has started (``min_peers``).
        """
        view = ModelView(model)
        body = {"peer": self.peer, **{k: v for k, v in self._config.items() if v is not None}}
        state = self._call("POST", f"{self._runs}/peers", json=body).json()
        self._lease = float(state.get("lease_seconds", 60.0))
        self._start_heartbeat()
        said = ""
        while state["state"] != "ready":
            if state["state"] == "initialise":
                self._initialise(view)
            elif state.get("detail") != said:
                said = state.get("detail", "")
                log.info("run %s: %s", self.run, said)
            state = self._call("GET", f"{self._runs}/peers/{self.peer}/start", params={"wait": self._poll}).json()
        schema = {name: tuple(shape) for name, shape in state["schema"].items()}
        if schema != view.schema:
            self.close()
            raise SchemaMismatch(_schema_diff(schema, view.schema, self.run))
        self.codec = get_codec(state["config"]["codec"])
        # nothing the hub sends is bigger than the float32 model or an encoded update: a body
        # that declares more is refused before anything is allocated
        fp32 = 4 * sum(math.prod(s) for s in schema.values())
        self._max_download = max(fp32, layout_bytes(wire_layout(self.codec, schema)))
        self.rank, self.world_size = int(state["rank"]), int(state["world_size"])
        self._pull(view)
        log.info(
            "run %s: joined as %s (rank %d of %d) at version %d",
            self.run,
            self.peer,
            self.rank,
            self.world_size,
            self.version,
        )
        config = state["config"]
        return JoinInfo(
            self.run,
            self.peer,
            self.rank,
            self.world_size,
            self.version,
            config["codec"],
            config["outer"],
            config,
        )

    def sync(self, model: torch.nn.Module, *, samples: int, metrics: Mapping[str, float] | None = None) -> SyncResult:
        """Send what ``model`` learned since the last sync; return with the merged version loaded.

        ``samples`` (examples seen since the last sync) weighs this peer in the average. Blocks
        for the whole round: :meth:`sync_async` is the same sync with training going on meanwhile.
        """
        return self._apply(self._start(model, samples, metrics, keep_local=False), model)

    def sync_async(
        self, model: torch.nn.Module, *, samples: int, metrics: Mapping[str, float] | None = None
    ) -> PendingSync:
        """Start a sync and return at once, so that training goes on while it travels (overlap).

        On this thread: snapshot ``model`` as ``x_t`` (one more float32 copy of the model, held
        until applied) and encode ``x_t - base + residual``. On one background thread: upload,
        wait for the round's merged update ``U``, and fold it in: ``base' = base + decode(U)``.
        Then ``pending.apply(model)`` sets ``model = base' + (model - x_t)``: the merged version
        plus this peer's steps since the snapshot, which count in the next round (its delta is
        taken against ``base'``). ``apply`` waits if the result is not in yet.

        One sync at a time: ``sync``, ``sync_async`` or ``pull`` before ``apply`` raises
        :class:`SyncError` (waiting there would hide a forgotten ``apply``). A late peer (the
        round closed without it) is caught up as by ``sync``: ``apply`` loads the latest version
        and drops all local work since the last sync, the steps taken meanwhile included.
        """
        return self._start(model, samples, metrics, keep_local=True)

    def pull(self, model: torch.nn.Module) -> int:
        """Load the run's latest version into ``model`` (dropping local changes); return it."""
        if self._base is None:
            raise SyncError("join(model) before pull()")
        self._check_idle()
        self._pull(ModelView(model))
        return self.version

    def status(self) -> dict[str, Any]:
        """The run's state as the hub sees it (peers, open round, recent rounds)."""
        result: dict[str, Any] = self._call("GET", self._runs).json()
        return result

    def leave(self) -> None:
        """Tell the hub this peer is done (it stops waiting for it), then close."""
        if self._heartbeat is not None:
            try:
                self._call("POST", f"{self._runs}/peers/{self.peer}/leave")
            except SyncError as exc:
                log.warning("run %s: leaving failed (%s); the hub will drop us when our lease expires", self.run, exc)
        self.close()

    def close(self) -> None:
        """Stop the heartbeat and close connections (without leaving the run)."""
        self._stop.set()
        if self._inflight is not None and not self._inflight.done():
            log.warning(
                "run %s: closing with the sync of round %d in flight, never applied", self.run, self._inflight.round
            )
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)
        self._heartbeat = None
        self._http.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # ---- internals -----------------------------------------------------------------------
    def _check_idle(self) -> None:
        if self._inflight is not None:
            raise SyncError(
                f"the sync of round {self._inflight.round} is in flight: apply it (pending.apply(model)) first"
            )

    def _start(
        self, model: torch.nn.Module, samples: int, metrics: Mapping[str, float] | None, *, keep_local: bool
    ) -> PendingSync:
        """The caller's half of a sync: snapshot, encode, hand the network work to the worker."""
        if self._base is None or self.codec is None:
            raise SyncError("join(model) before sync()")
        self._check_idle()
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive int, got {samples!r}")
        started = time.monotonic()
        view = ModelView(model)
        local = view.export()  # on CPU float32 these share memory with the model: copy to keep
        snapshot = {name: x.copy() for name, x in local.items()} if keep_local else None
        parts, stats = self._encode(snapshot or local)  # new arrays: training may go on
        sent_metrics = {k: float(v) for k, v in (metrics or {}).items() if math.isfinite(float(v))}
        if not self.codec.lossless:
            sent_metrics.update(codec_ratio=stats["ratio"], codec_error=stats["error"])
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"weightsync-sync-{self.peer}")
        future = self._worker.submit(self._exchange, self.version, parts, samples, sent_metrics, view.schema)
        self._inflight = PendingSync(self, future, self.version, snapshot, started, time.monotonic() - started, stats)
        return self._inflight

    def _exchange(
        self,
        round_: int,
        parts: list[tuple[str, np.ndarray, str]],
        samples: int,
        metrics: dict[str, float],
        schema: dict[str, tuple[int, ...]],
    ) -> _Outcome:
        """The worker's half: upload, long-poll the result, fold it into ``base`` (which nobody
        else touches while a sync is in flight). Late: fetch the latest version instead."""

        def body() -> Iterator[memoryview | bytes]:
            return iter_chunks(parts)

        started = time.monotonic()
        headers = {
            "Content-Digest": _digest(body()),
            "X-Sync-Samples": str(samples),
            "X-Sync-Metrics": json.dumps(metrics),
        }
        size = sum(len(c) for c in body())
        path = f"{self._runs}/rounds/{round_}/updates/{self.peer}"
        try:
            self._call(
                "PUT",
                path,
                headers=headers,
                content=lambda: self._progress(body(), size, "upload"),
                resume=lambda: self._upload_offset(path, headers),
            )
        except RoundClosed:
            return _Outcome(size, 0, time.monotonic() - started, 0.0, latest=self._fetch_latest())
        uploaded = time.monotonic()
        while True:
            download = self._download(
                f"{self._runs}/rounds/{round_}/result", {"wait": self._poll, "peer": self.peer}, allow_gone=True
            )
            if download is not None:
                break
        if download == "gone":
            return _Outcome(size, 0, uploaded - started, 0.0, latest=self._fetch_latest())
        assert self._base is not None and self.codec is not None and isinstance(download, _Download)
        reader = download.reader
        waited = time.monotonic()
        for name, shape in schema.items():
            # a slice at a time: no full-size decoded copy of a big tensor (see syncwire.codecs.slices)
            base = self._base[name].reshape(-1)
            for start, stop, where in slices(self.codec, shape):
                piece = {
                    suffix: reader.tensors[wire_name(name, suffix)].reshape(-1)[first : first + count]
                    for suffix, (first, count) in where.items()
                }
                base[start:stop] += self.codec.decode(piece, (stop - start,))
        return _Outcome(size, reader.received, uploaded - started, waited - uploaded)

    def _apply(self, pending: PendingSync, model: torch.nn.Module) -> SyncResult:
        """The caller's last half: wait for the worker, then load ``base'`` (blocking sync) or
        ``base' + (model - x_t)`` (overlap) into ``model``; or catch up when late."""
        if self._inflight is not pending:
            raise SyncError(f"the sync of round {pending.round} was applied already")
        view = ModelView(model)
        waiting = time.monotonic()
        try:
            outcome = pending._future.result()
        except BaseException:
            if pending._future.done():  # it failed: the next sync may try again (interrupted: not)
                self._inflight = None
            raise
        self._inflight = None
        snapshot, pending._snapshot = pending._snapshot, None
        if outcome.latest is not None:
            self._adopt(view, outcome.latest)
            log.warning(
                "run %s: round %d closed without %s (late); caught up to version %d, local steps dropped",
                self.run,
                pending.round,
                self.peer,
                self.version,
            )
        else:
            assert self._base is not None
            if snapshot is None:
                view.load(self._base)
            else:
                local = view.export()
                for name, x_t in snapshot.items():  # in place: no third copy of the model
                    np.subtract(local[name], x_t, out=x_t)  # the steps taken since the snapshot
                    x_t += self._base[name]  # on top of base' (IEEE + commutes: base' + (x - x_t))
                view.load(snapshot)
            self.version = pending.round + 1
        done = time.monotonic()
        late = outcome.latest is not None
        result = SyncResult(
            version=self.version,
            bytes_up=outcome.bytes_up,
            bytes_down=outcome.bytes_down,
            seconds=done - pending._started,
            upload_seconds=outcome.upload_seconds,
            wait_seconds=outcome.wait_seconds,
            caught_up=late,
            compression=1.0 if late else pending._stats["ratio"],
            codec_error=0.0 if late else pending._stats["error"],
            stall_seconds=pending._stall + done - waiting,
        )
        if not late:
            log.info(
                "run %s: synced to version %d in %.2fs, %.2fs of it on this thread (%.1f MB up, %.1f MB down)",
                self.run,
                self.version,
                result.seconds,
                result.stall_seconds,
                result.bytes_up / 1e6,
                result.bytes_down / 1e6,
            )
        return result

    def _encode(self, local: dict[str, np.ndarray]) -> tuple[list[tuple[str, np.ndarray, str]], dict[str, float]]:
        """Delta (plus error-feedback residual), encoded; update the residual on the way."""
        assert self._base is not None and self.codec is not None
        codec, parts = self.codec, []
        sent = err = norm = 0.0
        for name, x in local.items():
            delta = x - self._base[name]
            if not np.isfinite(delta).all():
                raise SyncError(f"tensor {name!r} holds NaN or Inf: the update was not sent (training diverged?)")
            if not codec.lossless:
                if self._residual is None:
                    self._residual = {}
                if name in self._residual:
                    delta += self._residual[name]
            encoded = codec.encode(delta)
            layout = codec.layout(delta.shape)
            for suffix, array in encoded.items():
                parts.append((wire_name(name, suffix), array, layout[suffix][0]))
                sent += array.nbytes
            if not codec.lossless:
                assert self._residual is not None
                residual = delta - codec.decode(encoded, delta.shape)
                self._residual[name] = residual
                err += float(np.dot(residual.ravel(), residual.ravel()))
                norm += float(np.dot(delta.ravel(), delta.ravel()))
        fp32 = sum(x.nbytes for x in local.values())
        return parts, {"ratio": fp32 / max(sent, 1.0), "error": math.sqrt(err / norm) if norm > 0 else 0.0}

    def _initialise(self, view: ModelView) -> None:
        arrays = view.export()
        items = [(name, a, "F32") for name, a in arrays.items()]
        size = sum(len(c) for c in iter_chunks(items))
        log.info("run %s: uploading version 0 (%.1f MB)", self.run, size / 1e6)
        try:
            self._call(
                "PUT",
                f"{self._runs}/versions/0",
                params={"peer": self.peer},
                content=lambda: self._progress(iter_chunks(items), size, "version 0"),
            )
        except ConflictError as exc:  # someone else initialised (we lost our claim): just pull
            log.info("run %s: %s", self.run, exc.detail)

    def _pull(self, view: ModelView) -> None:
        self._adopt(view, self._fetch_latest())

    def _fetch_latest(self) -> _Download:
        download = self._download(f"{self._runs}/model", {"peer": self.peer})
        assert isinstance(download, _Download)
        return download

    def _adopt(self, view: ModelView, download: _Download) -> None:
        """Make a downloaded full model the base and load it (local work is dropped)."""
        reader = download.reader
        if set(reader.tensors) != set(view.schema):
            raise SchemaMismatch(_schema_diff({k: v.shape for k, v in reader.tensors.items()}, view.schema, self.run))
        self._base = {name: reader.tensors[name] for name in view.schema}
        view.load(self._base)
        self._residual = None  # the residual belonged to work that was just dropped
        self.version = download.version

    def _retrying(self) -> Retrying:
        backoff = wait_exponential_jitter(multiplier=0.5, max=20.0, jitter=1.0)

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, _Retry) and exc.retry_after is not None:
                return min(exc.retry_after, 60.0)
            return float(backoff(state))

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "run %s: hub trouble (%s: %s); retry %d",
                self.run,
                type(exc).__name__,
                exc,
                state.attempt_number,
            )

        return Retrying(
            retry=retry_if_exception(_retryable),
            wait=wait,
            stop=stop_after_delay(self.retry_seconds),
            before_sleep=before_sleep,
            reraise=True,
        )

    def _call(
        self,
        method: str,
        path: str,
        *,
        content: Callable[[], Iterator[bytes | memoryview]] | None = None,
        resume: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request with retries. ``content`` makes a fresh body iterator per attempt.

        ``resume`` makes the body resumable: before each retry it says how many bytes the hub
        already holds, and only the rest is sent, with ``Upload-Offset`` (headers unchanged).
        """
        offset, headers = 0, kwargs.pop("headers", None) or {}
        try:
            for attempt in self._retrying():
                with attempt:
                    if resume is not None and attempt.retry_state.attempt_number > 1:
                        offset = resume()
                        log.info("run %s: resuming %s at byte %d", self.run, path, offset)
                    body = content() if content else None
                    if offset and body is not None:
                        body = _skip(body, offset)
                    response = self._http.request(
                        method,
                        path,
                        content=cast("Iterator[bytes] | None", body),
                        headers={**headers, "Upload-Offset": str(offset)} if offset else headers,
                        **kwargs,
                    )
                    if response.status_code in _RETRY_STATUS or (resume is not None and _is_offset_mismatch(response)):
                        raise _Retry(response)
        except _Retry as exc:
            raise HubUnreachable(f"{self.hub}{path}: still {exc} after {self.retry_seconds:.0f}s of retries") from exc
        except httpx.TransportError as exc:
            why = _tls_problem(exc) or f"after {self.retry_seconds:.0f}s of retries"
            raise HubUnreachable(f"{self.hub}{path}: {type(exc).__name__}: {exc} ({why})") from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    def _upload_offset(self, path: str, headers: dict[str, str]) -> int:
        """Bytes of this update (named by its headers' digest) the hub holds; 0 if it cannot say
        (the PUT from 0 then reports the real trouble). Transport errors count as a failed try."""
        response = self._http.head(path, headers=headers)
        if response.status_code in _RETRY_STATUS:
            raise _Retry(response)
        offset = response.headers.get("upload-offset", "")
        return int(offset) if response.is_success and offset.isdigit() else 0

    def _download(self, path: str, params: dict[str, Any], allow_gone: bool = False) -> _Download | str | None:
        """GET a safetensors body into arrays, resuming with Range after a cut.

        Returns None on 204 (long poll still open) and "gone" on 410 when ``allow_gone``.
        """
        reader = StreamReader(self._max_download)
        etag: str | None = None
        version = -1
        bar: Any = None
        try:
            for attempt in self._retrying():
                with attempt:
                    headers = (
                        {"Range": f"bytes={reader.received}-", "If-Range": etag} if reader.received and etag else {}
                    )
                    with self._http.stream("GET", path, params=params, headers=headers) as r:
                        if r.status_code in _RETRY_STATUS:
                            r.read()
                            raise _Retry(r)
                        if r.status_code == 204:
                            return None
                        if r.status_code == 410 and allow_gone:
                            return "gone"
                        if r.status_code >= 400:
                            r.read()
                            raise _error(r)
                        if r.status_code == 200 and reader.received:
                            reader = StreamReader(self._max_download)  # the file changed: start over
                        etag = r.headers.get("etag")
                        version = int(r.headers.get("x-sync-version", -1))
                        total = reader.received + int(r.headers.get("content-length", 0))
                        if bar is None and total >= _PROGRESS_BYTES and log.isEnabledFor(logging.INFO):
                            bar = tqdm(total=total, unit="B", unit_scale=True, desc="download", leave=False)
                        for chunk in r.iter_bytes(1 << 20):
                            reader.feed(chunk)
                            if bar is not None:
                                bar.update(len(chunk))
                    if not reader.done:
                        raise httpx.RemoteProtocolError("body ended early")
        except _Retry as exc:
            raise HubUnreachable(f"{self.hub}{path}: still {exc} after {self.retry_seconds:.0f}s") from exc
        except httpx.TransportError as exc:
            why = _tls_problem(exc)
            raise HubUnreachable(f"{self.hub}{path}: {type(exc).__name__}: {exc}{f' ({why})' if why else ''}") from exc
        finally:
            if bar is not None:
                bar.close()
        return _Download(reader, version)

    def _progress(self, chunks: Iterator[bytes | memoryview], total: int, what: str) -> Iterator[bytes | memoryview]:
        if total < _PROGRESS_BYTES or not log.isEnabledFor(logging.INFO):
            yield from chunks
            return
        with tqdm(total=total, unit="B", unit_scale=True, desc=what, leave=False) as bar:
            for chunk in chunks:
                yield chunk
                bar.update(len(chunk))

    def _start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            return
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._beat, name=f"weightsync-heartbeat-{self.peer}", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        """Renew the lease while the user trains for minutes between syncs."""
        failures = 0
        while not self._stop.wait(self._lease / 3):
            try:
                r = self._http.post(f"{self._runs}/peers/{self.peer}/heartbeat", timeout=10)
                failures = 0 if r.status_code < 400 else failures + 1
            except httpx.HTTPError:
                failures += 1
            except RuntimeError:  # client closed under us
                return
            if failures == 3:
                log.warning("run %s: heartbeats are failing; the hub may drop this peer", self.run)


def _skip(chunks: Iterator[bytes | memoryview], n: int) -> Iterator[bytes | memoryview]:
    """The body from byte ``n`` on (views, no copies)."""
    for chunk in chunks:
        if n >= len(chunk):
            n -= len(chunk)
            continue
        yield memoryview(chunk)[n:] if n else chunk
        n = 0


def _is_offset_mismatch(response: httpx.Response) -> bool:
    """409 ``upload_offset``: the hub lost the bytes we resumed after (it restarted): ask again."""
    if response.status_code != 409:
        return False
    try:
        return bool(response.json().get("error") == "upload_offset")
    except (ValueError, AttributeError):
        return False


def _schema_diff(run: Mapping[str, tuple[int, ...]], model: Mapping[str, tuple[int, ...]], name: str) -> str:
    missing = sorted(run.keys() - model.keys())
    extra = sorted(model.keys() - run.keys())
    shapes = sorted(k for k in run.keys() & model.keys() if tuple(run[k]) != tuple(model[k]))
    parts = [
        f"missing {missing[:3]}" if missing else "",
        f"unexpected {extra[:3]}" if extra else "",
        f"shape differs for {shapes[:3]}" if shapes else "",
    ]
    return f"the model does not match run {name!r}: " + "; ".join(p for p in parts if p)
