"""Durable hub state: sqlite for the small records, plain safetensors files for tensors.

The hub names what it wants with *keys* (:class:`VersionKey`, ...) and works through *handles*
(:meth:`Store.read`, :meth:`Store.write`, :meth:`Store.serve`, :class:`Upload`). No path leaves
this module; every ``OSError`` and ``sqlite3.Error`` becomes :class:`~syncserver.errors.Unavailable`
here, once (503: nothing changed).

Invariants: what acknowledges something is durable first (tmp + fsync + rename + directory fsync;
sqlite in WAL with ``synchronous=FULL``), and the record is written last. A round commits in the
transaction that moves its run's version; files past it are a crash's leftovers, removed on start.

The samples ledger (core/ledger.py) is the ``updates`` table (acknowledged) and the ``lost`` table,
written in the transaction of the round commit or peer record that found the loss.

Layout under ``data_dir``::

    hub.sqlite3
    runs/<run>/versions/<v>.safetensors     the model after v merges (float32)
    runs/<run>/momentum/<v>.safetensors     DiLoCo's momentum that goes with version v
    runs/<run>/residual/<v>.safetensors     the hub's error feedback that goes with version v (topk)
    runs/<run>/rounds/<v>/updates/<peer>.safetensors  an acknowledged update for round v (wire codec)
    runs/<run>/rounds/<v>/result.safetensors round v's merged update (wire codec)
    tmp/                                    uploads in flight
    tmp/spares/<id>.spare                   pruned tensor files, kept to write the next ones into
    tmp/partials/<run>/<v>/<peer>/<name>.part  an update cut mid-body or held for its digest

Updates have a folder of their own: no peer name is a hub file (docs/RELIABILITY.md, "Peer names
that collide with the hub's files"); data dirs of the older layout are moved on start.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from syncserver.errors import Unavailable
from syncserver.records import Loss, RoundRecord, UpdateRecord
from syncserver.storage.spares import SPARES, Spares
from syncserver.storage.writeback import start_writeback
from syncwire.format import TensorFile
from syncwire.runsettings import FLUSH_KEY

__all__ = [
    "Blob",
    "BlobWriter",
    "Missing",
    "MomentumKey",
    "ObjectRecord",
    "Published",
    "Stored",
    "PeerRecord",
    "ResidualKey",
    "ResultKey",
    "RunRecord",
    "Staged",
    "Store",
    "Upload",
    "UploadClosed",
    "UpdateKey",
    "VersionKey",
    "storage_error",
]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    name TEXT PRIMARY KEY, config TEXT NOT NULL, schema TEXT, version INTEGER NOT NULL,
    created REAL NOT NULL, sealed INTEGER NOT NULL DEFAULT 0, creator TEXT);
CREATE TABLE IF NOT EXISTS peers (
    run TEXT NOT NULL, name TEXT NOT NULL, rank INTEGER, active_from INTEGER NOT NULL,
    joined REAL NOT NULL, left INTEGER NOT NULL DEFAULT 0, group_size INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (run, name));
CREATE TABLE IF NOT EXISTS updates (
    run TEXT NOT NULL, round INTEGER NOT NULL, peer TEXT NOT NULL, seq INTEGER NOT NULL,
    digest TEXT NOT NULL, samples INTEGER NOT NULL, metrics TEXT NOT NULL, nbytes INTEGER NOT NULL,
    received REAL NOT NULL, seconds REAL NOT NULL, base INTEGER, final INTEGER NOT NULL DEFAULT 0,
    object TEXT, PRIMARY KEY (run, round, peer));
CREATE TABLE IF NOT EXISTS rounds (
    run TEXT NOT NULL, round INTEGER NOT NULL, opened REAL NOT NULL, closed REAL NOT NULL,
    participants TEXT NOT NULL, dropped TEXT NOT NULL, samples INTEGER NOT NULL,
    bytes_in INTEGER NOT NULL, result_bytes INTEGER NOT NULL, timings TEXT NOT NULL,
    PRIMARY KEY (run, round));
CREATE TABLE IF NOT EXISTS objects (
    run TEXT NOT NULL, kind TEXT NOT NULL, number INTEGER NOT NULL, size INTEGER NOT NULL, etag TEXT NOT NULL,
    PRIMARY KEY (run, kind, number));
CREATE TABLE IF NOT EXISTS lost (
    run TEXT NOT NULL, round INTEGER NOT NULL, peer TEXT NOT NULL, samples INTEGER NOT NULL,
    PRIMARY KEY (run, round, peer));
"""
_ADDED = [  # columns added since the first hub, and what an older data dir without them meant
    ("runs", "creator", "TEXT"),  # who created a run counts against its quota (quotas.py); unknown
    ("updates", "base", "INTEGER"),  # from before async runs: every update's base is its round
    ("updates", "final", "INTEGER NOT NULL DEFAULT 0"),  # from before final rounds: none was a last
    ("updates", "object", "TEXT"),  # from before updates in the object store: all on disk
    ("peers", "group_size", "INTEGER NOT NULL DEFAULT 1"),
    ("rounds", "interval", "TEXT"),  # from before sync_every auto: no round picked an interval
]


# ---- records -------------------------------------------------------------------------------
@dataclass
class RunRecord:
    name: str
    config: dict[str, Any]
    schema: dict[str, tuple[int, ...]] | None
    version: int  # -1 until version 0 exists
    created: float
    sealed: bool
    creator: str | None = None  # the kind of token that created it (quotas.py); None: before it was kept


@dataclass
class PeerRecord:
    name: str
    rank: int | None
    active_from: int
    joined: float
    left: bool
    group_size: int = 1  # ranks of a torch.distributed group that train as this one peer


# ---- keys ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Numbered:
    run: str
    number: int
    kind: ClassVar[str]  # its name in the objects table and its folder (versions, momentum, residual)


class VersionKey(_Numbered):
    """The model after ``number`` merges, float32."""

    kind = "version"


class MomentumKey(_Numbered):
    """DiLoCo's outer momentum that goes with version ``number``."""

    kind = "momentum"


class ResidualKey(_Numbered):
    """What the results up to version ``number`` left out, for codecs with ``hub_feedback``."""

    kind = "residual"


@dataclass(frozen=True)
class UpdateKey:
    """``peer``'s acknowledged update for ``round`` (wire codec). ``object``: its name in the
    object store, when it went there instead of the hub's disk (``size``: its bytes)."""

    run: str
    round: int
    peer: str
    object: str | None = None
    size: int | None = None

    @classmethod
    def of(cls, run: str, update: UpdateRecord) -> UpdateKey:
        """The key of an acknowledged update's record: where the merge finds its bytes."""
        size = update.nbytes if update.object is not None else None
        return cls(run, update.round, update.peer, update.object, size)


@dataclass(frozen=True)
class ResultKey:
    """Round ``round``'s merged update (wire codec): what turns version ``round`` into ``round + 1``."""

    run: str
    round: int


Key = VersionKey | MomentumKey | ResidualKey | UpdateKey | ResultKey
Published = VersionKey | ResultKey  # what peers download: it may have a copy in an object store
#: what may live in the object store under a record of the hub's: what peers download, and (written
#: by reducers, with a store) DiLoCo's momentum and the hub's residual, which the next round reads
Stored = VersionKey | ResultKey | MomentumKey | ResidualKey


@dataclass(frozen=True)
class ObjectRecord:
    """A copy of a result, version, momentum or residual in the object store: its size and the
    store's ETag. It exists only once uploaded whole (the record is written after the upload)."""

    key: Stored
    size: int
    etag: str


_KINDS: dict[str, type[VersionKey | MomentumKey | ResidualKey]] = {
    k.kind: k for k in (VersionKey, MomentumKey, ResidualKey)
}


def _row(run: str, record: UpdateRecord | RoundRecord | PeerRecord) -> tuple[Any, ...]:
    """A record's row: its run, then its fields in order (its table's columns), lists and dicts as JSON."""
    return (run, *(json.dumps(v) if isinstance(v, dict | list) else v for v in vars(record).values()))


def _kind(key: Stored) -> tuple[str, int]:
    return ("result", key.round) if isinstance(key, ResultKey) else (key.kind, key.number)


def _stored(run: str, kind: str, number: int) -> Stored:
    return ResultKey(run, number) if kind == "result" else _KINDS[kind](run, number)


# ---- errors --------------------------------------------------------------------------------
class Missing(LookupError):
    """What was asked for is not stored (pruned, or removed as it arrived)."""


class UploadClosed(RuntimeError):
    """An upload written to after it was closed: nothing is written (its descriptor number may be
    another file's by then). One writer at a time holds an upload, and its writes end first."""


def storage_error(exc: OSError | sqlite3.Error) -> Unavailable:
    """The one translation of a storage failure: 503, and the caller has changed nothing."""
    if isinstance(exc, sqlite3.Error):
        full, what = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL, f"database ({exc})"
    else:
        full, what = exc.errno == errno.ENOSPC, f"data dir ({exc.strerror})"
    if full:
        return Unavailable("the hub's disk is full; nothing was stored", retry_after=30)
    return Unavailable(f"the hub cannot write its {what}; nothing was stored", retry_after=30)


@contextlib.contextmanager
def _translating() -> Iterator[None]:
    """:func:`storage_error` for a block, or a function decorated with ``@_translating()``."""
    try:
        yield
    except (OSError, sqlite3.Error) as exc:
        raise storage_error(exc) from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path) -> None:
    """Move a complete, already fsynced file into place durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@_translating()
def _pwrite(fd: int, data: bytes | memoryview, position: int) -> None:
    """All of ``data`` at ``position`` (a ``pwrite`` may write less)."""
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(fd, view, position)
        view, position = view[done:], position + done


# ---- handles -------------------------------------------------------------------------------
class BlobWriter:
    """An open file being written all or nothing (see :meth:`Store.write`): bytes at the end
    (:meth:`write`) or arrays at an offset (:meth:`write_at`, safe from several threads)."""

    def __init__(self, fd: int, path: Path | None = None) -> None:
        self._fd = fd
        self.path = path  # the file being written: local reducers write their ranges into it
        self._end = 0  # where :meth:`write` goes on
        self._lock = threading.Lock()
        self.size = 0  # the end of what was written (a spare written over is cut there)

    def write(self, data: bytes) -> None:
        _pwrite(self._fd, data, self._end)
        self._end += len(data)
        self._grow(self._end)

    def write_at(self, array: np.ndarray, position: int) -> None:
        """Write an array's bytes at ``position`` and start their writeback at once, so the
        fsync that publishes the file waits for the last slices only."""
        view = array.reshape(-1).view(np.uint8).data
        _pwrite(self._fd, view, position)
        start_writeback(self._fd, position, len(view))
        self._grow(position + len(view))

    def reserve(self, size: int) -> None:
        """Make the file ``size`` bytes long now, for writers in other processes (local
        reducers, ``pwrite`` into :attr:`path`) whose writes this one does not see."""
        with _translating():
            os.ftruncate(self._fd, size)
        self._grow(size)

    def _grow(self, end: int) -> None:
        with self._lock:
            self.size = max(self.size, end)


class Blob:
    """A file opened for serving: it stays readable even if pruning removes its name meanwhile."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size

    def read(self, offset: int, n: int) -> bytes:
        with _translating():
            return os.pread(self._fd, n, offset)

    def close(self) -> None:
        os.close(self._fd)


@dataclass(frozen=True)
class Staged:
    """A complete, fsynced body waiting to be published under a key, or discarded."""

    _path: Path

    def reader(self) -> TensorFile:
        with _translating():
            return TensorFile(self._path)

    def discard(self) -> None:
        self._path.unlink(missing_ok=True)


class Upload:
    """Where one body gathers as it arrives: a fresh file, or a *partial* that keeps what
    arrived across attempts (resumable updates), named by (run, round, peer, digest or key).
    Only the file ops; receiving is :mod:`syncserver.storage.uploads`."""

    def __init__(self, path: Path, done_path: Path | None, spares: Spares) -> None:
        self._path = path
        self._done_path = done_path  # a partial moves here once whole (out of pruning's reach)
        self._spares = spares
        self._fd: int | None = None
        self._end = 0  # the body's bytes in the file: a spare written over holds more until cut
        self.resumable = done_path is not None
        self.ident = str(path)  # names the upload across requests (one writer at a time may hold it)

    def held(self) -> int:
        """Bytes the hub holds of this upload."""
        try:
            return self._path.stat().st_size
        except FileNotFoundError:
            return 0

    @_translating()
    def open(self, offset: int, size: int | None = None) -> None:
        """Open for writing from ``offset`` (0: from scratch, into a spare that holds ``size``
        bytes if there is one; the caller checked :meth:`held`)."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        if offset:
            self._fd = os.open(self._path, os.O_RDWR)
            os.ftruncate(self._fd, offset)  # same upload, same bytes: anything past offset is re-sent
        else:
            self._fd = self._spares.open(size, self._path)
        self._end = offset

    def _writable(self) -> int:
        if self._fd is None:
            raise UploadClosed(f"upload {self._path.name} is closed: nothing more can be written to it")
        return self._fd

    def append(self, chunks: list[bytes]) -> None:
        """Write ``chunks`` after the body's bytes."""
        fd = self._writable()
        for chunk in chunks:
            _pwrite(fd, chunk, self._end)
            self._end += len(chunk)

    def writeback(self, offset: int, nbytes: int) -> None:
        start_writeback(self._writable(), offset, nbytes)

    @_translating()
    def read(self, offset: int, n: int) -> bytes:
        """Bytes already held (a resumed body's start, opened at its offset, is read back to check it)."""
        return os.pread(self._writable(), n, offset)

    @_translating()
    def finish(self) -> Staged:
        """fsync and close; a partial then leaves the partials folder, out of the reach of the
        pruning of a closed round's partials (:class:`Missing` if that took it already)."""
        fd = self._writable()
        os.ftruncate(fd, self._end)  # a spare's old tail
        os.fsync(fd)
        self.close()
        if self._done_path is None:
            return Staged(self._path)
        try:
            os.replace(self._path, self._done_path)
        except FileNotFoundError:
            raise Missing("the partial upload was removed as it arrived: its round closed") from None
        return Staged(self._done_path)

    def close(self) -> None:
        """Close; the file then holds the body's bytes alone (:meth:`held` is its size)."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, self._end)
            except OSError:  # held() must count the body's bytes alone: then none
                self._path.unlink(missing_ok=True)
            finally:
                os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        self.close()
        self._path.unlink(missing_ok=True)


# ---- the store -------------------------------------------------------------------------------
class Store:
    """The hub's disk. Record methods are called from the event loop thread (sqlite is fast
    here: a handful of small rows per round); bulk tensor I/O happens in worker threads."""

    @_translating()
    def __init__(self, data_dir: Path, spares: int = SPARES) -> None:
        self._root = Path(data_dir)
        (self._root / "runs").mkdir(parents=True, exist_ok=True)
        self._tmp = self._root / "tmp"
        self._tmp.mkdir(exist_ok=True)
        self._spares = Spares(self._tmp / "spares", spares)
        self._db = sqlite3.connect(self._root / "hub.sqlite3", isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        for table, column, kind in _ADDED:  # a database of an older hub
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    def describe(self) -> str:
        """Where the data lives, for the startup log line."""
        return str(self._root.resolve())

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with _translating():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _rows(self, sql: str, *params: Any) -> list[Any]:
        with _translating():
            return self._db.execute(sql, params).fetchall()

    # ---- keys to paths (private) -----------------------------------------------------------
    def _run_dir(self, run: str) -> Path:
        return self._root / "runs" / run

    def _round_dir(self, run: str, round_: int) -> Path:
        return self._run_dir(run) / "rounds" / f"{round_:08d}"

    def _path(self, key: Key) -> Path:
        if isinstance(key, UpdateKey):
            return self._updates_dir(key.run, key.round) / f"{key.peer}.safetensors"
        if isinstance(key, ResultKey):
            return self._round_dir(key.run, key.round) / "result.safetensors"
        folder = "versions" if isinstance(key, VersionKey) else key.kind
        return self._run_dir(key.run) / folder / f"{key.number:08d}.safetensors"

    def _updates_dir(self, run: str, round_: int) -> Path:
        return self._round_dir(run, round_) / "updates"

    def _partials(self, run: str) -> Path:
        return self._tmp / "partials" / run

    # ---- tensor files ------------------------------------------------------------------------
    def exists(self, key: Key) -> bool:
        return self._path(key).exists()

    @_translating()
    def versions(self, run: str) -> list[int]:
        """The versions of ``run`` whose files are stored, in order."""
        return sorted(int(path.stem) for path in (self._run_dir(run) / "versions").glob("*.safetensors"))

    @_translating()
    def read(self, key: Key) -> TensorFile:
        """A ranged reader (``pread`` a slice at a time); close it (it is a context manager)."""
        return TensorFile(self._path(key))

    @contextlib.contextmanager
    def write(self, key: Key, size: int | None = None) -> Iterator[BlobWriter]:
        """Write ``key`` all or nothing: a crash or an error leaves the old file or none.
        ``size``, the bytes it will hold if known, picks the spare to write over (:class:`Spares`)."""
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        with _translating():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._spares.open(size, tmp)
        try:
            try:
                writer = BlobWriter(fd, tmp)
                yield writer
                with _translating():
                    os.ftruncate(fd, writer.size)  # a larger spare's tail goes
                    os.fsync(fd)
            finally:
                os.close(fd)
            with _translating():
                _publish(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @_translating()
    def serve(self, key: Key) -> Blob:
        """Open ``key`` for a download; :class:`Missing` if it is not there (pruned)."""
        try:
            return Blob(self._path(key))
        except FileNotFoundError:
            raise Missing(f"{key} is not stored") from None

    # ---- uploads -----------------------------------------------------------------------------
    def fresh_upload(self) -> Upload:
        """Somewhere to receive a body that is not resumable (version 0)."""
        return Upload(self._tmp / f"{uuid.uuid4().hex}.part", None, self._spares)

    @_translating()
    def resumable_upload(self, run: str, round_: int, peer: str, name: str, *, supersede: bool = False) -> Upload:
        """The partial upload of one update, named by its hex sha-256 or ``key-<Upload-Key>`` (the
        route checked it: no path separators). ``supersede``: the peer's other partials for the
        round go (it gave up on them)."""
        folder = self._partials(run) / f"{round_:08d}" / peer
        path = folder / f"{name}.part"
        if supersede:
            for stale in folder.glob("*.part"):
                if stale != path:
                    stale.unlink(missing_ok=True)
        return Upload(path, self._tmp / f"{uuid.uuid4().hex}.part", self._spares)

    @_translating()
    def publish_initial(self, staged: Staged, run: str, schema: dict[str, tuple[int, ...]]) -> None:
        """Version 0 of ``run``: its file, then the record that says it exists."""
        _publish(staged._path, self._path(VersionKey(run, 0)))
        with self._tx() as db:
            db.execute("UPDATE runs SET schema = ?, version = 0 WHERE name = ?", (json.dumps(schema), run))

    def acknowledge(self, staged: Staged, run: str, update: UpdateRecord) -> None:
        """Store an update: its file, then its record (the acknowledgement's commit point). A
        failure leaves neither, and an update already stored is never touched (ValueError)."""
        path = self._path(UpdateKey(run, update.round, update.peer))
        self._refuse_second(run, update)
        try:
            with _translating():
                _publish(staged._path, path)
            self.record_update(run, update)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def record_update(self, run: str, update: UpdateRecord) -> None:
        """Record an update whose bytes are durable already: the commit point of its
        acknowledgement (an update in the object store has no file here: ``update.object``)."""
        self._refuse_second(run, update)
        with self._tx() as db:
            sql = f"INSERT INTO updates (run, {self._UPDATE_COLUMNS}) VALUES ({','.join('?' * 13)})"
            db.execute(sql, _row(run, update))

    def _refuse_second(self, run: str, update: UpdateRecord) -> None:
        if self._rows("SELECT 1 FROM updates WHERE run = ? AND round = ? AND peer = ?", run, update.round, update.peer):
            raise ValueError(f"{update.peer!r} already has an update stored for round {update.round} of {run!r}")

    # ---- runs ----------------------------------------------------------------------------
    def runs(self) -> list[RunRecord]:
        rows = self._rows("SELECT name, config, schema, version, created, sealed, creator FROM runs ORDER BY rowid")
        return [
            RunRecord(
                n, json.loads(c), {k: tuple(v) for k, v in json.loads(s).items()} if s else None, v, t, bool(x), by
            )
            for n, c, s, v, t, x, by in rows
        ]

    def create_run(self, name: str, config: dict[str, Any], creator: str | None = None) -> None:
        with self._tx() as db:
            row = (name, json.dumps(config), time.time(), creator)
            db.execute("INSERT INTO runs (name, config, version, created, creator) VALUES (?, ?, -1, ?, ?)", row)

    def seal(self, run: str, ranks: dict[str, int]) -> None:
        with self._tx() as db:
            db.execute("UPDATE runs SET sealed = 1 WHERE name = ?", (run,))
            rows = [(rank, run, peer) for peer, rank in ranks.items()]
            db.executemany("UPDATE peers SET rank = ? WHERE run = ? AND name = ?", rows)

    # ---- peers ---------------------------------------------------------------------------
    def peers(self, run: str) -> list[PeerRecord]:
        rows = self._rows("SELECT * FROM peers WHERE run = ? ORDER BY joined", run)
        return [PeerRecord(n, r, a, j, bool(left), g) for _, n, r, a, j, left, g in rows]

    def save_peer(self, run: str, peer: PeerRecord, lost: Loss | None = None) -> None:
        """A peer's record; ``lost``: what it forfeits by joining again or leaving (the ledger's)."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO peers VALUES (?,?,?,?,?,?,?)", _row(run, peer))
            self._insert_losses(db, run, [lost] if lost is not None else [])

    # ---- updates and rounds --------------------------------------------------------------
    _UPDATE_COLUMNS = "peer, round, seq, digest, samples, metrics, nbytes, received, seconds, base, final, object"

    def _updates(self, where: str, *params: Any) -> list[UpdateRecord]:
        """The update records ``SELECT ... FROM updates WHERE {where}`` finds."""
        rows = self._rows(f"SELECT {self._UPDATE_COLUMNS} FROM updates WHERE {where}", *params)
        return [
            UpdateRecord(p, r, s, d, n, json.loads(m), b, t, sec, r if base is None else base, bool(final), name)
            for p, r, s, d, n, m, b, t, sec, base, final, name in rows
        ]

    def updates(self, run: str, round_: int) -> list[UpdateRecord]:
        return self._updates("run = ? AND round = ? ORDER BY seq", run, round_)

    def update_from(self, run: str, peer: str, base: int) -> UpdateRecord | None:
        """``peer``'s update computed from version ``base``, wherever it was merged (a peer sends
        at most one per version it starts from)."""
        found = self._updates("run = ? AND peer = ? AND COALESCE(base, round) = ?", run, peer, base)
        return found[0] if found else None

    def next_seq(self, run: str) -> int:
        ((seq,),) = self._rows("SELECT COALESCE(MAX(seq), 0) + 1 FROM updates WHERE run = ?", run)
        return int(seq)

    def commit_round(
        self, run: str, record: RoundRecord, objects: Sequence[ObjectRecord] = (), lost: Sequence[Loss] = ()
    ) -> None:
        """The commit point of a round: version ``round + 1`` exists from here on, with the
        records of ``objects`` (the round's copies in the object store) and the samples its close
        found ``lost`` (the ledger's)."""
        with self._tx() as db:
            for copy in objects:
                self._insert_object(db, run, copy)
            self._insert_losses(db, run, lost)
            db.execute("INSERT INTO rounds VALUES (?,?,?,?,?,?,?,?,?,?,?)", _row(run, record))
            db.execute("UPDATE runs SET version = ? WHERE name = ?", (record.round + 1, run))

    # ---- the samples ledger ---------------------------------------------------------------
    @staticmethod
    def _insert_losses(db: sqlite3.Connection, run: str, losses: Sequence[Loss]) -> None:
        sql = "INSERT INTO lost VALUES (?,?,?,?) ON CONFLICT (run, round, peer) "
        sql += "DO UPDATE SET samples = samples + excluded.samples"
        db.executemany(sql, [(run, loss.round, loss.peer, loss.samples) for loss in losses])

    def ledger(self, run: str) -> dict[str, tuple[int, int, int]]:
        """Per peer: the samples of its acknowledged updates, its samples lost, and the newest base
        version it has an acknowledged update from (-1: none)."""
        counted = f"CASE WHEN json_extract(metrics, '$.{FLUSH_KEY}') IS NULL THEN samples ELSE 0 END"  # once
        sql = f"SELECT peer, SUM({counted}), MAX(COALESCE(base, round)) FROM updates WHERE run = ? GROUP BY peer"
        acked = {peer: (int(n), int(base)) for peer, n, base in self._rows(sql, run)}
        lost = dict(self._rows("SELECT peer, SUM(samples) FROM lost WHERE run = ? GROUP BY peer", run))
        return {p: (acked.get(p, (0, -1))[0], int(lost.get(p, 0)), acked.get(p, (0, -1))[1]) for p in acked | lost}

    def losses(self, run: str, limit: int = 20) -> list[Loss]:
        """The latest samples ``run`` lost, by the round they were trained for, latest first."""
        sql = "SELECT round, peer, samples FROM lost WHERE run = ? ORDER BY round DESC, peer LIMIT ?"
        return [Loss(r, p, n) for r, p, n in self._rows(sql, run, limit)]

    # ---- copies in the object store ------------------------------------------------------
    @staticmethod
    def _insert_object(db: sqlite3.Connection, run: str, record: ObjectRecord) -> None:
        row = (run, *_kind(record.key), record.size, record.etag)
        db.execute("INSERT OR REPLACE INTO objects VALUES (?,?,?,?,?)", row)

    def record_object(self, record: ObjectRecord) -> None:
        """``record.key`` has a whole copy in the object store (written after its upload)."""
        with self._tx() as db:
            self._insert_object(db, record.key.run, record)

    def stored_object(self, key: Stored) -> ObjectRecord | None:
        sql = "SELECT size, etag FROM objects WHERE run = ? AND kind = ? AND number = ?"
        row = self._rows(sql, key.run, *_kind(key))
        return ObjectRecord(key, *row[0]) if row else None

    def stored_objects(self, run: str) -> list[ObjectRecord]:
        rows = self._rows("SELECT kind, number, size, etag FROM objects WHERE run = ? ORDER BY kind, number", run)
        return [ObjectRecord(_stored(run, kind, n), size, etag) for kind, n, size, etag in rows]

    def forget_objects(self, keys: list[Stored]) -> None:
        """Drop the records of copies about to be deleted from the store (pruned, or past a crash)."""
        if not keys:
            return
        with self._tx() as db:
            rows = [(key.run, *_kind(key)) for key in keys]
            db.executemany("DELETE FROM objects WHERE run = ? AND kind = ? AND number = ?", rows)

    def update_objects(self, run: str) -> set[str]:
        """The names of the updates of ``run`` that live in the object store (not pruned yet)."""
        return {name for (name,) in self._rows("SELECT object FROM updates WHERE run = ? AND object IS NOT NULL", run)}

    def names_update_object(self, run: str, name: str) -> bool:
        """Does an update record of ``run`` name the object ``name``? (Then no clean-up deletes it.)"""
        return bool(self._rows("SELECT 1 FROM updates WHERE run = ? AND object = ? LIMIT 1", run, name))

    def forget_update_objects(self, run: str, below: int) -> list[str]:
        """Drop the object names of ``run``'s updates merged in rounds before ``below`` (pruned
        with their round, as the hub prunes its files); the names, for the caller to delete."""
        where = "WHERE run = ? AND round < ? AND object IS NOT NULL"
        with self._tx() as db:
            rows = db.execute(f"SELECT object FROM updates {where}", (run, below)).fetchall()
            db.execute(f"UPDATE updates SET object = NULL {where}", (run, below))
        return [name for (name,) in rows]

    def rounds(self, run: str, limit: int = 50) -> list[RoundRecord]:
        rows = self._rows("SELECT * FROM rounds WHERE run = ? ORDER BY round DESC LIMIT ?", run, limit)
        return [
            RoundRecord(r, o, c, json.loads(p), json.loads(d), s, b, rb, json.loads(t), i and json.loads(i))
            for _, r, o, c, p, d, s, b, rb, t, i in reversed(rows)
        ]

    def samples_through(self, run: str, round_: int) -> int:
        """Samples trained in ``run`` by the end of round ``round_`` (version ``round_ + 1``)."""
        sql = "SELECT COALESCE(SUM(samples), 0) FROM rounds WHERE run = ? AND round <= ?"
        return int(self._rows(sql, run, round_)[0][0])

    def round_metrics(self, run: str, limit: int = 500) -> list[UpdateRecord]:
        """The latest updates of a run (their metrics feed status and the dashboard)."""
        return self._updates("run = ? ORDER BY seq DESC LIMIT ?", run, limit)[::-1]

    # ---- housekeeping --------------------------------------------------------------------
    @_translating()
    def recover(self, run: str, version: int) -> None:
        """Remove what a crash may have left past the committed state of ``run``."""
        acked = {u.peer for u in self.updates(run, version)} if version >= 0 else set()
        for kind in ("versions", "momentum", "residual"):
            for path in (self._run_dir(run) / kind).glob("*.safetensors"):
                if int(path.stem) > version:
                    path.unlink()
        for path in (self._run_dir(run) / "rounds").glob("*"):
            if not path.is_dir():
                continue
            if int(path.name) > version:
                shutil.rmtree(path)
            elif int(path.name) == version:
                self._recover_open_round(path, self._updates_dir(run, version), acked)
        for path in self._run_dir(run).rglob(".*.tmp"):
            path.unlink()

    def _recover_open_round(self, folder: Path, updates: Path, acked: set[str]) -> None:
        """The open round keeps its acknowledged updates alone (a result there never committed),
        an update of the older layout (beside the result: named after its acknowledged peer)
        moved into ``updates/`` first."""
        updates.mkdir(exist_ok=True)
        for f in folder.iterdir():
            if f.is_file() and f.suffix == ".safetensors" and f.stem in acked and not (updates / f.name).exists():
                os.replace(f, updates / f.name)
                _fsync_dir(updates)
                _fsync_dir(folder)
        for f in [*folder.iterdir(), *updates.iterdir()]:
            if f.is_file() and (f.parent == folder or f.name.startswith(".") or f.stem not in acked):
                f.unlink()

    @_translating()
    def clear_tmp(self) -> None:
        """Drop uploads in flight, partials included: after a crash the peers start them again."""
        self._spares.clear()
        for path in self._tmp.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    @_translating()
    def prune(self, run: str, version: int, keep: int, keep_results: int | None = None) -> None:
        """Keep the last ``keep`` versions and ``keep_results`` round results (default ``keep``;
        an async run's peers fetch the results since their base); drop older files, and the
        partial uploads no open round can take."""
        floor = version - keep + 1
        for kind in ("versions", "momentum", "residual"):
            for path in (self._run_dir(run) / kind).glob("*.safetensors"):
                if int(path.stem) < floor:
                    self._spares.retire(path)
        results_floor = version - max(keep, keep_results or 0) + 1
        for path in (self._run_dir(run) / "rounds").glob("*"):
            if path.is_dir() and int(path.name) < results_floor:
                for tensors in path.rglob("*.safetensors"):  # the result and the updates
                    self._spares.retire(tensors)
                shutil.rmtree(path, ignore_errors=True)
        for path in self._partials(run).glob("*"):
            if int(path.name) < version - (keep_results or 0):
                shutil.rmtree(path, ignore_errors=True)
