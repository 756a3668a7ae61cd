"""The store in-process: keys, handles, atomicity and the one translation of storage errors."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from syncserver.core.planes import BucketPlane
from syncserver.errors import Unavailable
from syncserver.records import RoundRecord, UpdateRecord
from syncserver.storage.bucket import object_name
from syncserver.storage.spares import SPARES
from syncserver.storage.store import (
    Missing,
    MomentumKey,
    ObjectRecord,
    ResidualKey,
    ResultKey,
    Staged,
    Store,
    UpdateKey,
    UploadClosed,
    VersionKey,
)
from syncwire import iter_chunks
from syncwire.format import encode_header, read_tensors


def body(arrays: dict[str, np.ndarray]) -> bytes:
    return b"".join(iter_chunks([(name, a, "F32") for name, a in arrays.items()]))


def write_version(store: Store, key: VersionKey, arrays: dict[str, np.ndarray]) -> None:
    """Through the atomic writer, as the engine does: the header, then slices at their offsets."""
    head, infos = encode_header([(name, "F32", a.shape) for name, a in arrays.items()])
    with store.write(key) as out:
        out.write(head)
        for info in infos:
            out.write_at(arrays[info.name].astype(np.float32), len(head) + info.start)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "hub")


def test_the_writer_publishes_whole_files_and_the_reader_reads_ranges(store: Store) -> None:
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float32)}
    write_version(store, VersionKey("r", 0), arrays)
    assert store.exists(VersionKey("r", 0)) and store.versions("r") == [0]
    with store.read(VersionKey("r", 0)) as f:
        assert f.read("w", 3, 7).tolist() == [3, 4, 5, 6]
        assert f.read("b").tolist() == [1] * 5


def test_a_failed_write_leaves_neither_the_file_nor_a_temporary(store: Store, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), store.write(ResultKey("r", 0)) as out:
        out.write(b"half a file")
        raise RuntimeError("the merge failed")
    assert not store.exists(ResultKey("r", 0))
    assert not [p for p in (tmp_path / "hub" / "runs").rglob("*") if p.is_file()]


def test_storage_errors_become_503s(store: Store, tmp_path: Path) -> None:
    (tmp_path / "hub" / "runs" / "blocked").write_text("a file where the run's folder goes")
    with pytest.raises(Unavailable, match="cannot write its data dir"), store.write(VersionKey("blocked", 0)):
        pass
    store.close()  # sqlite's errors too: here "cannot operate on a closed database"
    with pytest.raises(Unavailable, match="cannot write its database"):
        store.seal("r", {"a": 0})


def test_a_served_blob_outlives_its_pruning(store: Store) -> None:
    arrays = {"w": np.arange(4, dtype=np.float32)}
    for v in range(3):
        write_version(store, VersionKey("r", v), arrays)
    blob = store.serve(VersionKey("r", 0))
    store.prune("r", 2, keep=1)
    assert store.versions("r") == [2]
    try:
        assert blob.read(0, blob.size) == body(arrays)  # the download in flight completes
    finally:
        blob.close()
    with pytest.raises(Missing):
        store.serve(VersionKey("r", 0))


def version_path(tmp_path: Path, run: str, v: int) -> Path:
    return tmp_path / "hub" / "runs" / run / "versions" / f"{v:08d}.safetensors"


def spares(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "hub" / "tmp" / "spares").glob("*.spare"))


def test_a_pruned_file_is_written_over_by_the_next_write_and_cut_to_size(store: Store, tmp_path: Path) -> None:
    big = {"w": np.arange(64, dtype=np.float32), "b": np.ones(8, np.float32)}
    for v in range(2):
        write_version(store, VersionKey("r", v), big)
    pruned = version_path(tmp_path, "r", 0).stat().st_ino
    store.prune("r", 1, keep=1)
    assert store.versions("r") == [1] and len(spares(tmp_path)) == 1

    small = {"w": np.full(3, 7, np.float32)}  # fewer bytes than the spare holds: its tail must go
    write_version(store, VersionKey("r", 2), small)
    path = version_path(tmp_path, "r", 2)
    assert path.stat().st_ino == pruned and not spares(tmp_path)  # the very file, written over
    assert path.read_bytes() == body(small)
    arrays, _ = read_tensors(str(path))
    assert arrays["w"].tolist() == [7, 7, 7]


@pytest.mark.parametrize("reader", ["served blob", "memory map"])
def test_a_pruned_file_still_open_is_not_written_over(store: Store, tmp_path: Path, reader: str) -> None:
    old, new = {"w": np.arange(16, dtype=np.float32)}, {"w": np.full(16, -1, np.float32)}
    for v in range(2):
        write_version(store, VersionKey("r", v), old)
    pruned = version_path(tmp_path, "r", 0).stat().st_ino
    if reader == "served blob":  # a late peer still downloading version 0
        handle = store.serve(VersionKey("r", 0))
        still = lambda: handle.read(0, handle.size)  # noqa: E731
    else:  # a mapping outlives the descriptor it was made from
        arrays, _ = read_tensors(str(version_path(tmp_path, "r", 0)))
        still = lambda: body({"w": np.array(arrays["w"])})  # noqa: E731
    store.prune("r", 1, keep=1)

    write_version(store, VersionKey("r", 2), new)
    assert version_path(tmp_path, "r", 2).stat().st_ino != pruned  # a new file: the spare is in use
    assert still() == body(old)  # what is being read stays as it was
    if reader == "served blob":
        handle.close()
    else:
        del arrays, still
    write_version(store, VersionKey("r", 3), new)  # now nothing reads it: written over
    assert version_path(tmp_path, "r", 3).stat().st_ino == pruned
    assert version_path(tmp_path, "r", 3).read_bytes() == body(new)


def test_a_store_told_to_keep_no_spares_deletes_what_it_prunes(tmp_path: Path) -> None:
    store = Store(tmp_path / "hub", spares=0)
    for v in range(3):
        write_version(store, VersionKey("r", v), {"w": np.zeros(8, np.float32)})
    store.prune("r", 2, keep=1)
    assert store.versions("r") == [2] and not spares(tmp_path)
    assert [p.name for p in (tmp_path / "hub").rglob("*.safetensors")] == ["00000002.safetensors"]


def test_the_largest_few_pruned_files_are_kept_and_a_restart_drops_them(store: Store, tmp_path: Path) -> None:
    sizes = list(range(1, SPARES + 4))
    for v, n in enumerate(sizes):
        write_version(store, VersionKey("r", v), {"w": np.zeros(100 * n, np.float32)})
    store.prune("r", len(sizes) - 1, keep=1)
    kept = sorted(p.stat().st_size for p in spares(tmp_path))
    assert len(kept) == SPARES
    assert kept == sorted(len(body({"w": np.zeros(100 * n, np.float32)})) for n in sizes[-1 - SPARES : -1])
    store.clear_tmp()  # what a hub's start does
    assert not spares(tmp_path)
    write_version(store, VersionKey("r", 99), {"w": np.zeros(4, np.float32)})  # a new file, as before
    assert store.versions("r")[-1] == 99


def staged(store: Store, data: bytes) -> Staged:
    """``data`` received whole, as an upload stages it."""
    upload = store.fresh_upload()
    upload.open(0)
    upload.append([data])
    return upload.finish()


def test_an_update_is_acknowledged_with_its_record_or_not_at_all(store: Store) -> None:
    store.create_run("r", {})
    data = body({"w": np.ones(3, np.float32)})
    record = UpdateRecord("a", 0, 1, "d", 5, {}, len(data), 0.0, 0.0, 0)
    store.acknowledge(staged(store, data), "r", record)
    assert store.exists(UpdateKey("r", 0, "a")) and [u.peer for u in store.updates("r", 0)] == ["a"]
    # the same (run, round, peer) again is refused before the stored update is touched
    with pytest.raises(ValueError, match="already has an update stored"):
        store.acknowledge(staged(store, data), "r", UpdateRecord("a", 0, 2, "e", 5, {}, len(data), 0.0, 0.0, 0))
    assert [u.seq for u in store.updates("r", 0)] == [1]
    with store.read(UpdateKey("r", 0, "a")) as f:
        assert f.read("w").tolist() == [1, 1, 1]
    # a database that cannot record it: a 503, and no file is left for the round's fold to find
    late = staged(store, data)
    store.close()
    with pytest.raises(Unavailable):
        store.acknowledge(late, "r", UpdateRecord("b", 0, 3, "f", 5, {}, len(data), 0.0, 0.0, 0))
    assert not store.exists(UpdateKey("r", 0, "b"))


@pytest.mark.parametrize("peer", ["result", "updates", "00000000", "result.safetensors"])
def test_no_peer_name_is_a_file_of_the_hub(store: Store, peer: str) -> None:
    """A peer called ``result`` *was* stored at the round's result path: the merge replaced it."""
    store.create_run("r", {})
    data = body({"w": np.ones(3, np.float32)})
    store.acknowledge(staged(store, data), "r", UpdateRecord(peer, 0, 1, "d", 5, {}, len(data), 0.0, 0.0, 0))
    write_version(store, ResultKey("r", 0), {"w": np.zeros(3, np.float32)})  # the merge of round 0
    with store.read(UpdateKey("r", 0, peer)) as f:
        assert f.read("w").tolist() == [1, 1, 1]


def test_recovery_keeps_the_open_rounds_updates_and_drops_an_uncommitted_result(store: Store, tmp_path: Path) -> None:
    """Killed between the merge's rename and the commit: the result is not committed, the
    acknowledged updates (one of a peer called ``result``) are all there after the restart."""
    store.create_run("r", {})
    for seq, peer in enumerate(["a", "result"], 1):
        data = body({"w": np.full(3, seq, np.float32)})
        store.acknowledge(staged(store, data), "r", UpdateRecord(peer, 0, seq, "d", 5, {}, len(data), 0.0, 0.0, 0))
    write_version(store, ResultKey("r", 0), {"w": np.zeros(3, np.float32)})
    store.recover("r", 0)
    assert not store.exists(ResultKey("r", 0))
    for value, peer in enumerate(["a", "result"], 1):
        with store.read(UpdateKey("r", 0, peer)) as f:
            assert f.read("w").tolist() == [value] * 3


def test_a_copy_in_the_object_store_counts_from_its_record_and_the_round_commits_with_it(
    store: Store, tmp_path: Path
) -> None:
    """A result's copy is recorded in the round's own commit, a version's after its upload; a
    record survives a restart, is forgotten on demand, and a failed commit records nothing."""
    store.create_run("r", {})
    record = RoundRecord(0, 0.0, 1.0, ["a"], [], 4, 10, 10, {})
    copy = ObjectRecord(ResultKey("r", 0), 10, "etag0")
    store.commit_round("r", record, [copy])
    with pytest.raises(Unavailable):  # the same round again: the commit fails, and so does its copy
        store.commit_round("r", record, [ObjectRecord(ResultKey("r", 0), 99, "other")])
    store.record_object(ObjectRecord(VersionKey("r", 1), 12, "etag1"))
    store.close()
    again = Store(tmp_path / "hub")
    assert again.stored_object(ResultKey("r", 0)) == copy
    assert again.stored_object(ResultKey("r", 1)) is None
    assert again.stored_objects("r") == [copy, ObjectRecord(VersionKey("r", 1), 12, "etag1")]
    again.forget_objects([ResultKey("r", 0)])
    assert [r.key for r in again.stored_objects("r")] == [VersionKey("r", 1)]
    assert again.runs()[0].version == 1


def test_momentum_and_residual_copies_are_recorded_recovered_and_pruned_as_versions_are(store: Store) -> None:
    """DiLoCo's momentum and the hub's residual in the bucket (reducers write them) commit with
    their round, each under its own name; a restart forgets those past the committed version
    (a crash's), and pruning drops those of pruned versions with them."""
    store.create_run("r", {})
    for v in range(3):
        copies = [
            ObjectRecord(ResultKey("r", v), 10, f"e{v}"),
            ObjectRecord(MomentumKey("r", v + 1), 40, f"m{v}"),
            ObjectRecord(ResidualKey("r", v + 1), 40, f"s{v}"),
        ]
        store.commit_round("r", RoundRecord(v, 0.0, 1.0, ["a"], [], 4, 10, 10, {}), copies)
    store.record_object(ObjectRecord(MomentumKey("r", 4), 40, "late"))  # past version 3: a crash's
    assert store.stored_object(MomentumKey("r", 2)) == ObjectRecord(MomentumKey("r", 2), 40, "m1")
    listed = {object_name(r.key) for r in store.stored_objects("r")}
    deleted: list[str] = []
    objects = SimpleNamespace(
        url="s3://b", list=lambda prefix: [SimpleNamespace(name=n) for n in sorted(listed)], uploads=lambda prefix: []
    )
    objects.delete_names = deleted.extend
    plane = BucketPlane(store, 1, objects)  # type: ignore[arg-type]  # lists and deletes, no request is made
    asyncio.run(plane.recover(SimpleNamespace(name="r", version=3)))  # type: ignore[arg-type]
    assert deleted == [object_name(MomentumKey("r", 4))]  # the others are named: momentum and residual 3 too
    assert len({object_name(r.key) for r in store.stored_objects("r")}) == 9  # names of their own
    deleted.clear()
    asyncio.run(plane.prune(SimpleNamespace(name="r", version=3, keep_results=None), 3))  # type: ignore[arg-type]
    assert {object_name(k("r", n)) for k in (MomentumKey, ResidualKey) for n in (1, 2)} <= set(deleted)
    assert [r.key for r in store.stored_objects("r")] == [MomentumKey("r", 3), ResidualKey("r", 3)]


def test_recovery_moves_updates_of_the_older_layout(store: Store, tmp_path: Path) -> None:
    """A data dir written before updates had their own folder: the open round's acknowledged
    updates lay beside the result (``rounds/<v>/<peer>.safetensors``); they move, and stay."""
    store.create_run("r", {})
    data = body({"w": np.full(3, 7, np.float32)})
    for peer in ("a", "result"):
        store.acknowledge(staged(store, data), "r", UpdateRecord(peer, 0, 1, "d", 5, {}, len(data), 0.0, 0.0, 0))
    round_dir = tmp_path / "hub" / "runs" / "r" / "rounds" / f"{0:08d}"
    for path in (round_dir / "updates").iterdir():
        path.rename(round_dir / path.name)  # as the older layout had it
    (round_dir / "updates").rmdir()
    (round_dir / "zed.safetensors").write_bytes(data)  # not acknowledged: a leftover
    store.recover("r", 0)
    for peer in ("a", "result"):
        with store.read(UpdateKey("r", 0, peer)) as f:
            assert f.read("w").tolist() == [7, 7, 7]
    assert sorted(p.name for p in round_dir.rglob("*")) == ["a.safetensors", "result.safetensors", "updates"]


def test_a_resumable_upload_keeps_its_bytes_and_a_new_digest_supersedes_them(store: Store) -> None:
    first = store.resumable_upload("r", 0, "a", "d1")
    first.open(0)
    first.append([b"12345"])
    first.close()
    assert store.resumable_upload("r", 0, "a", "d1").held() == 5
    assert store.resumable_upload("r", 0, "a", "d2", supersede=True).held() == 0
    assert store.resumable_upload("r", 0, "a", "d1").held() == 0, "the older try is gone"


def test_a_partial_pruned_as_it_completes_is_missing(store: Store) -> None:
    upload = store.resumable_upload("r", 0, "a", "d")
    upload.open(0)
    upload.append([b"x"])
    store.prune("r", 1, keep=3)  # round 0 closed: its partials can never complete
    with pytest.raises(Missing):
        upload.finish()


def test_a_closed_upload_refuses_writes_and_keeps_its_bytes(store: Store) -> None:
    """Kept, finished or discarded, an upload takes no more bytes: an error that says so, not
    an assert (gone under ``python -O``), and not a write through a descriptor that another
    file may have by then."""
    kept = store.resumable_upload("r", 0, "a", "d")
    kept.open(0)
    kept.append([b"123"])
    kept.close()
    for use in (lambda: kept.append([b"45"]), lambda: kept.writeback(0, 3), kept.finish):
        with pytest.raises(UploadClosed, match="closed"):
            use()
    assert store.resumable_upload("r", 0, "a", "d").held() == 3
    finished = store.resumable_upload("r", 0, "b", "d")
    finished.open(0)
    finished.finish().discard()
    with pytest.raises(UploadClosed):
        finished.append([b"x"])


def test_an_upload_cut_while_it_writes_over_a_spare_holds_its_own_bytes_alone(store: Store, tmp_path: Path) -> None:
    """A resumable upload written over a larger pruned file: cut, it holds what arrived and
    nothing of the old file (its retry starts there); resumed and finished, the body exactly."""
    for v in range(2):
        write_version(store, VersionKey("r", v), {"w": np.full(1000, 9, np.float32)})
    store.prune("r", 1, keep=1)
    assert len(spares(tmp_path)) == 1
    body_ = bytes(range(256)) * 10
    upload = store.resumable_upload("r", 1, "a", "d")
    upload.open(0, len(body_))
    assert not spares(tmp_path), "the upload took the spare"
    upload.append([body_[:1000], body_[1000:1500]])
    upload.close()  # the link died
    again = store.resumable_upload("r", 1, "a", "d")
    assert again.held() == 1500
    again.open(1500)
    again.append([body_[1500:]])
    again.finish()
    (done,) = [p for p in (tmp_path / "hub" / "tmp").glob("*.part")]
    assert done.read_bytes() == body_


def older_hub(path: Path, *statements: str) -> Store:
    """A store opened on the data dir of an older hub whose database ``statements`` made."""
    path.mkdir()
    db = sqlite3.connect(path / "hub.sqlite3")
    for statement in statements:
        db.execute(statement)
    db.commit()
    db.close()
    return Store(path)


def test_a_database_of_an_older_hub_gets_the_new_column(tmp_path: Path) -> None:
    """Runs created before their creator was kept (for the quotas) load with ``creator=None``."""
    store = older_hub(
        tmp_path / "old",
        "CREATE TABLE runs (name TEXT PRIMARY KEY, config TEXT NOT NULL, schema TEXT, version INTEGER NOT NULL, "
        "created REAL NOT NULL, sealed INTEGER NOT NULL DEFAULT 0)",
        "INSERT INTO runs (name, config, version, created) VALUES ('r', '{}', -1, 0)",
    )
    store.create_run("s", {}, "token")
    assert [(r.name, r.creator) for r in store.runs()] == [("r", None), ("s", "token")]


def test_updates_of_an_older_hub_load_as_not_final(tmp_path: Path) -> None:
    """An update table from before final rounds gets the column; its updates were nobody's last."""
    store = older_hub(
        tmp_path / "old",
        "CREATE TABLE updates (run TEXT NOT NULL, round INTEGER NOT NULL, peer TEXT NOT NULL, seq INTEGER NOT NULL, "
        "digest TEXT NOT NULL, samples INTEGER NOT NULL, metrics TEXT NOT NULL, nbytes INTEGER NOT NULL, "
        "received REAL NOT NULL, seconds REAL NOT NULL, base INTEGER, PRIMARY KEY (run, round, peer))",
        "INSERT INTO updates VALUES ('r', 0, 'a', 1, 'd', 5, '{}', 10, 0, 0, 0)",
    )
    [update] = store.updates("r", 0)
    assert update.final is False and update.samples == 5
    assert update.object is None  # and on the hub's disk: no object store held updates then
    assert store.update_objects("r") == set()


def test_an_update_in_the_object_store_is_recorded_named_and_pruned_by_name(tmp_path: Path) -> None:
    """record_update stores the object's name (no file); update_objects names it until its round
    is pruned (forget_update_objects hands the names over once); a second record is refused."""
    store = Store(tmp_path / "hub")
    name = "runs/r/updates/00000000/a/some-key-xxxxxxxx.safetensors"
    update = UpdateRecord("a", 0, 1, "d" * 64, 5, {}, 10, 0.0, 0.1, base=0, object=name)
    store.record_update("r", update)
    assert store.updates("r", 0) == [update] and store.update_objects("r") == {name}
    assert UpdateKey.of("r", update) == UpdateKey("r", 0, "a", name, 10)
    with pytest.raises(ValueError, match="already has an update"):
        store.record_update("r", update)
    assert store.forget_update_objects("r", below=0) == []
    assert store.forget_update_objects("r", below=1) == [name]
    assert store.update_objects("r") == set() and store.updates("r", 0)[0].object is None
    assert store.forget_update_objects("r", below=1) == []
