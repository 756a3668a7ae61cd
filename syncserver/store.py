"""Durable hub state: sqlite for the small records, plain safetensors files for tensors.

Every write that acknowledges something is durable before the acknowledgement: files go
through tmp + fsync + rename + directory fsync, and sqlite runs in WAL mode with
``synchronous=FULL``. The commit point of a round is the sqlite transaction that moves a
run's version; files of a version past that point are leftovers of a crash and are removed
on start (see :meth:`Store.recover`).

Layout under ``data_dir``::

    hub.sqlite3
    runs/<run>/versions/<v>.safetensors     the model after v merges (float32)
    runs/<run>/momentum/<v>.safetensors     DiLoCo's momentum that goes with version v
    runs/<run>/rounds/<v>/<peer>.safetensors an acknowledged update for round v (wire codec)
    runs/<run>/rounds/<v>/result.safetensors round v's merged update (wire codec)
    tmp/                                    uploads in flight
    tmp/partials/<run>/<v>/<peer>/<digest>.part  an update cut mid-body, kept for its resume
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = ["PeerRecord", "RoundRecord", "RunRecord", "Store", "UpdateRecord", "atomic_file"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    name TEXT PRIMARY KEY, config TEXT NOT NULL, schema TEXT, version INTEGER NOT NULL,
    created REAL NOT NULL, sealed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS peers (
    run TEXT NOT NULL, name TEXT NOT NULL, rank INTEGER, active_from INTEGER NOT NULL,
    joined REAL NOT NULL, left INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (run, name));
CREATE TABLE IF NOT EXISTS updates (
    run TEXT NOT NULL, round INTEGER NOT NULL, peer TEXT NOT NULL, seq INTEGER NOT NULL,
    digest TEXT NOT NULL, samples INTEGER NOT NULL, metrics TEXT NOT NULL, nbytes INTEGER NOT NULL,
    received REAL NOT NULL, seconds REAL NOT NULL, PRIMARY KEY (run, round, peer));
CREATE TABLE IF NOT EXISTS rounds (
    run TEXT NOT NULL, round INTEGER NOT NULL, opened REAL NOT NULL, closed REAL NOT NULL,
    participants TEXT NOT NULL, dropped TEXT NOT NULL, samples INTEGER NOT NULL,
    bytes_in INTEGER NOT NULL, result_bytes INTEGER NOT NULL, timings TEXT NOT NULL,
    PRIMARY KEY (run, round));
"""


@dataclass
class RunRecord:
    name: str
    config: dict[str, Any]
    schema: dict[str, tuple[int, ...]] | None
    version: int  # -1 until version 0 exists
    created: float
    sealed: bool


@dataclass
class PeerRecord:
    name: str
    rank: int | None
    active_from: int
    joined: float
    left: bool


@dataclass
class UpdateRecord:
    peer: str
    round: int
    seq: int
    digest: str
    samples: int
    metrics: dict[str, float]
    nbytes: int
    received: float
    seconds: float


@dataclass
class RoundRecord:
    round: int
    opened: float
    closed: float
    participants: list[str]
    dropped: list[str]
    samples: int
    bytes_in: int
    result_bytes: int
    timings: dict[str, float]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """Write ``path`` all or nothing: a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def publish_file(tmp: Path, path: Path) -> None:
    """Move a complete, already fsynced file into place durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class Store:
    """The hub's disk. Methods are called from the event loop thread (sqlite is fast here:
    a handful of small rows per round); bulk tensor I/O happens in worker threads."""

    def __init__(self, data_dir: Path) -> None:
        self.root = Path(data_dir)
        (self.root / "runs").mkdir(parents=True, exist_ok=True)
        self.tmp_dir = self.root / "tmp"
        self.tmp_dir.mkdir(exist_ok=True)
        self._db = sqlite3.connect(self.root / "hub.sqlite3", isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ---- paths -------------------------------------------------------------------------
    def run_dir(self, run: str) -> Path:
        return self.root / "runs" / run

    def version_path(self, run: str, version: int) -> Path:
        return self.run_dir(run) / "versions" / f"{version:08d}.safetensors"

    def momentum_path(self, run: str, version: int) -> Path:
        return self.run_dir(run) / "momentum" / f"{version:08d}.safetensors"

    def round_dir(self, run: str, round_: int) -> Path:
        return self.run_dir(run) / "rounds" / f"{round_:08d}"

    def update_path(self, run: str, round_: int, peer: str) -> Path:
        return self.round_dir(run, round_) / f"{peer}.safetensors"

    def result_path(self, run: str, round_: int) -> Path:
        return self.round_dir(run, round_) / "result.safetensors"

    def new_tmp(self) -> Path:
        return self.tmp_dir / f"{uuid.uuid4().hex}.part"

    def partial_path(self, run: str, round_: int, peer: str, digest: str) -> Path:
        """Where the bytes of one update gather across attempts (``digest``: hex sha-256)."""
        return self.tmp_dir / "partials" / run / f"{round_:08d}" / peer / f"{digest}.part"

    # ---- runs ----------------------------------------------------------------------------
    def runs(self) -> list[RunRecord]:
        rows = self._db.execute("SELECT name, config, schema, version, created, sealed FROM runs").fetchall()
        return [
            RunRecord(
                name,
                json.loads(config),
                {k: tuple(v) for k, v in json.loads(schema).items()} if schema else None,
                version,
                created,
                bool(sealed),
            )
            for name, config, schema, version, created, sealed in rows
        ]

    def create_run(self, name: str, config: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO runs (name, config, version, created) VALUES (?, ?, -1, ?)",
                (name, json.dumps(config), time.time()),
            )

    def set_initial_version(self, run: str, schema: dict[str, tuple[int, ...]]) -> None:
        with self._tx() as db:
            db.execute("UPDATE runs SET schema = ?, version = 0 WHERE name = ?", (json.dumps(schema), run))

    def seal(self, run: str, ranks: dict[str, int]) -> None:
        with self._tx() as db:
            db.execute("UPDATE runs SET sealed = 1 WHERE name = ?", (run,))
            db.executemany(
                "UPDATE peers SET rank = ? WHERE run = ? AND name = ?",
                [(rank, run, peer) for peer, rank in ranks.items()],
            )

    # ---- peers ---------------------------------------------------------------------------
    def peers(self, run: str) -> list[PeerRecord]:
        rows = self._db.execute(
            "SELECT name, rank, active_from, joined, left FROM peers WHERE run = ? ORDER BY joined", (run,)
        ).fetchall()
        return [PeerRecord(n, r, a, j, bool(left)) for n, r, a, j, left in rows]

    def save_peer(self, run: str, peer: PeerRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO peers (run, name, rank, active_from, joined, left) VALUES (?,?,?,?,?,?)",
                (run, peer.name, peer.rank, peer.active_from, peer.joined, int(peer.left)),
            )

    # ---- updates and rounds --------------------------------------------------------------
    def add_update(self, run: str, update: UpdateRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO updates VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    run,
                    update.round,
                    update.peer,
                    update.seq,
                    update.digest,
                    update.samples,
                    json.dumps(update.metrics),
                    update.nbytes,
                    update.received,
                    update.seconds,
                ),
            )

    def updates(self, run: str, round_: int) -> list[UpdateRecord]:
        rows = self._db.execute(
            "SELECT peer, round, seq, digest, samples, metrics, nbytes, received, seconds FROM updates "
            "WHERE run = ? AND round = ? ORDER BY seq",
            (run, round_),
        ).fetchall()
        return [UpdateRecord(p, r, s, d, n, json.loads(m), b, t, sec) for p, r, s, d, n, m, b, t, sec in rows]

    def next_seq(self, run: str) -> int:
        (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM updates WHERE run = ?", (run,)).fetchone()
        return int(seq)

    def commit_round(self, run: str, record: RoundRecord) -> None:
        """The commit point of a round: version ``round + 1`` exists from here on."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO rounds VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    run,
                    record.round,
                    record.opened,
                    record.closed,
                    json.dumps(record.participants),
                    json.dumps(record.dropped),
                    record.samples,
                    record.bytes_in,
                    record.result_bytes,
                    json.dumps(record.timings),
                ),
            )
            db.execute("UPDATE runs SET version = ? WHERE name = ?", (record.round + 1, run))

    def rounds(self, run: str, limit: int = 50) -> list[RoundRecord]:
        rows = self._db.execute(
            "SELECT round, opened, closed, participants, dropped, samples, bytes_in, result_bytes, timings "
            "FROM rounds WHERE run = ? ORDER BY round DESC LIMIT ?",
            (run, limit),
        ).fetchall()
        return [
            RoundRecord(r, o, c, json.loads(p), json.loads(d), s, b, rb, json.loads(t))
            for r, o, c, p, d, s, b, rb, t in reversed(rows)
        ]

    def round_metrics(self, run: str, limit: int = 500) -> list[UpdateRecord]:
        """The latest updates of a run (their metrics feed status and the dashboard)."""
        rows = self._db.execute(
            "SELECT peer, round, seq, digest, samples, metrics, nbytes, received, seconds FROM updates "
            "WHERE run = ? ORDER BY seq DESC LIMIT ?",
            (run, limit),
        ).fetchall()
        return [UpdateRecord(p, r, s, d, n, json.loads(m), b, t, sec) for p, r, s, d, n, m, b, t, sec in reversed(rows)]

    # ---- housekeeping --------------------------------------------------------------------
    def recover(self, run: str, version: int) -> None:
        """Remove what a crash may have left past the committed state of ``run``."""
        acked = {u.peer for u in self.updates(run, version)} if version >= 0 else set()
        for kind in ("versions", "momentum"):
            for path in (self.run_dir(run) / kind).glob("*.safetensors"):
                if int(path.stem) > version:
                    path.unlink()
        rounds = self.run_dir(run) / "rounds"
        for path in rounds.glob("*"):
            if not path.is_dir():
                continue
            if int(path.name) > version:
                shutil.rmtree(path)
            elif int(path.name) == version:
                for f in path.iterdir():
                    if f.name.startswith(".") or f.stem not in acked:
                        f.unlink()
        for path in self.run_dir(run).rglob(".*.tmp"):
            path.unlink()

    def clear_tmp(self) -> None:
        """Drop uploads in flight, partials included: after a crash the peers start them again."""
        for path in self.tmp_dir.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def prune(self, run: str, version: int, keep: int) -> None:
        """Keep the last ``keep`` versions and round results; drop older files."""
        floor = version - keep + 1
        for kind in ("versions", "momentum"):
            for path in (self.run_dir(run) / kind).glob("*.safetensors"):
                if int(path.stem) < floor:
                    path.unlink(missing_ok=True)
        for path in (self.run_dir(run) / "rounds").glob("*"):
            if path.is_dir() and int(path.name) < floor:
                shutil.rmtree(path, ignore_errors=True)
        # partial uploads for closed rounds can never complete
        for path in (self.tmp_dir / "partials" / run).glob("*"):
            if int(path.name) < version:
                shutil.rmtree(path, ignore_errors=True)
