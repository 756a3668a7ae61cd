"""Reducers write their parts of the result to the bucket, and build version v+1 there after the
commit (issue 24, part R step 4): every lease's bytes of each output are one part of a multipart
upload the hub completes, so a reducer needs nothing of the hub's disk (avg rounds) and the hub
uploads no result and no version but the first. In process against SeaweedFS: the bits of a lone
hub on local disk, for fp32 and int8."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import syncserver.core.leases
from syncserver.core.leases import Board, build_leased, merge_into_bucket
from syncserver.errors import LeaseLost
from syncserver.reduce.engine import Accumulator, MergeEngine, Outer, RoundMerge
from syncserver.reduce.lease import MEANS, Done, MergeJob, SliceJob, UpdateSource, _At, _updates, work
from syncserver.storage.bucket import object_name, update_name
from syncserver.storage.store import ObjectRecord, ResultKey, Store, UpdateKey, VersionKey
from syncwire import get_codec
from tests.conftest import Hub
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, wait_for
from tests.s3server import SeaweedFS
from tests.test_metrics import scrape
from tests.test_reducers import ADMIN, SCHEMA, TOKEN, _bytes, _reducers, _train
from tests.test_streaming_hub import _update_file

#: 12 MB of fp32: two parts of S3's 5 MiB at least (SeaweedFS refuses smaller ones but the last)
BIG = {"w": (1_500_000,), "e": (1_000, 1_500)}


@pytest.mark.parametrize(("spec", "schema", "parts"), [("fp32", BIG, 2), ("int8", SCHEMA, 1)])
def test_leases_written_as_parts_give_the_bits_of_the_hub_alone(
    tmp_path: Path, seaweedfs: SeaweedFS, spec: str, schema: dict[str, tuple[int, ...]], parts: int
) -> None:
    """Two rounds of three updates in the bucket, merged by K = 2 leases whose jobs name no file
    of the hub (version v, the updates: objects; the result: part URLs), worked by the hub's own
    lease function, then version v+1 built by K = 2 build leases: the completed result and
    version objects are the lone hub's files. Round 1 (a final one: its result is fp32) merges
    under the bound the build of version 1 reported, and so without reading version 1 at all
    (the object is away while it merges); the build reads it from the bucket (the hub's disk has
    no version file but version 0, which the leases read in the bucket too: a reducer on another
    machine could not read the hub's). A small result is one part (S3's parts are 5 MiB but the last)."""
    codec, outer = get_codec(spec), Outer("avg", 1.0, 0.0)
    rng = np.random.default_rng(3)
    model = _update_file(get_codec("fp32"), {k: rng.standard_normal(s, dtype=np.float32) for k, s in schema.items()})
    rounds = [
        [
            _update_file(codec, {k: rng.standard_normal(s, dtype=np.float32) * 1e-2 for k, s in schema.items()})
            for _ in range(3)
        ]
        for _ in range(2)
    ]
    alone = Store(tmp_path / "alone")
    with alone.write(VersionKey("r", 0)) as f:
        f.write(model)
    objects = seaweedfs.store(f"parts-{spec}/")
    info = objects.put(object_name(VersionKey("r", 0)), model)
    hub = Store(tmp_path / "hub")  # version 0 on its disk, uploaded for the reducers; nothing else
    with hub.write(VersionKey("r", 0)) as f:
        f.write(model)
    hub.record_object(ObjectRecord(VersionKey("r", 0), info.size, info.etag))
    engines = MergeEngine(alone, threads=2), MergeEngine(hub, threads=2, objects=objects)
    board = Board(0.05, lambda: objects)  # no reducer: the hub works each lease, as a reducer would
    taken: list[MergeJob] = []
    original = syncserver.core.leases.jobs

    def spy(*args: object, **kwargs: object) -> list[MergeJob]:
        made = original(*args, **kwargs)  # type: ignore[arg-type]
        taken.extend(made)
        return made

    syncserver.core.leases.jobs = spy  # type: ignore[assignment]
    loop = asyncio.new_event_loop()  # the board's events live in one loop, as in the hub
    bound: dict[str, float] | None = None  # round 0: none known, version 0 is read
    try:
        for v, updates in enumerate(rounds):
            keys, remote = [], []
            for k, data in enumerate(updates):
                with alone.write(UpdateKey("r", v, f"p{k}")) as f:
                    f.write(data)
                name = update_name("r", v, f"p{k}", f"k{k}", f"a{v}{k}")
                objects.put(name, data)
                keys.append((UpdateKey("r", v, f"p{k}"), 3.0 + 2 * k))
                remote.append((UpdateKey("r", v, f"p{k}", name, len(data)), 3.0 + 2 * k))
            engines[0].merge(
                RoundMerge(
                    "r", v, Accumulator(schema), codec, outer, total=21.0, fraction=1.0, final=v == 1, unfolded=keys
                )
            )
            engines[0].build_versions("r", v + 1, codec, schema)
            here = object_name(VersionKey("r", v))
            held = bytes(objects.read(here))
            if bound is not None:
                objects.delete(here)  # under the bound, the merge must not need it
            size, records, after = loop.run_until_complete(
                merge_into_bucket(
                    board,
                    2,
                    engines[1],
                    RoundMerge(
                        "r",
                        v,
                        Accumulator(schema),
                        codec,
                        outer,
                        total=21.0,
                        fraction=1.0,
                        final=v == 1,
                        unfolded=remote,
                        bound=bound,
                    ),
                    objects,
                )
            )
            objects.put(here, held)
            assert size == len(_bytes(alone, ResultKey("r", v)))
            assert [r.key for r in records] == [ResultKey("r", v)] and records[0].size == size
            assert bytes(objects.read(object_name(ResultKey("r", v)))) == _bytes(alone, ResultKey("r", v))
            record, bound = loop.run_until_complete(build_leased(board, 2, "r", v, schema, codec, objects))
            version = _bytes(alone, VersionKey("r", v + 1))
            assert record.key == VersionKey("r", v + 1) and record.size == len(version)
            assert bytes(objects.read(object_name(VersionKey("r", v + 1)))) == version
            with alone.read(VersionKey("r", v + 1)) as built:
                truth = {n: float(np.abs(built.read(n)).max()) for n in schema}
            assert bound == truth  # the build's peaks are exact
            assert all(truth[n] <= after[n] <= truth[n] + 1 for n in schema)  # the merge's: a bound
        assert not objects.uploads("runs/")  # every multipart upload completed
        assert [p.name for p in (tmp_path / "hub").rglob("*.safetensors")] == ["00000000.safetensors"]  # version 0
        # a lease names nothing on the hub's disk: a reducer on another machine can do it
        assert len(taken) == 2 * parts
        for job in taken:
            assert job.base is None and job.base_object is not None
            assert all(u.path is None for u in job.updates)
            assert job.result.path is None
        assert all(bool(job.result.head) == (job.result.start == 0) for job in taken)  # the header: in part 1
        # 12 MB of fp32 result in 2 leases: one part each (16 MiB parts, at least 5 MiB)
        assert [c.part for job in taken[-parts:] for c in job.result.parts] == list(range(1, parts + 1))
    finally:
        syncserver.core.leases.jobs = original  # type: ignore[assignment]
        loop.close()
        for engine in engines:
            engine.close()
        alone.close()
        hub.close()


def test_a_build_lease_whose_reducer_died_is_built_again_and_a_late_report_refused(
    tmp_path: Path, seaweedfs: SeaweedFS
) -> None:
    """Version 1 built in the bucket after round 0's commit: the reducer that takes the build
    lease dies (never reports); the lease expires and, no reducer being left, the hub builds
    it itself, to the bytes of the lone hub's version file; the dead one's late report is 409."""
    codec = get_codec("int8")
    rng = np.random.default_rng(8)
    model = _update_file(get_codec("fp32"), {k: rng.standard_normal(s, dtype=np.float32) for k, s in SCHEMA.items()})
    alone = Store(tmp_path / "alone")
    with alone.write(VersionKey("r", 0)) as f:
        f.write(model)
    with alone.write(UpdateKey("r", 0, "p")) as f:
        f.write(_update_file(codec, {k: rng.standard_normal(s, dtype=np.float32) for k, s in SCHEMA.items()}))
    engine = MergeEngine(alone, threads=1)
    outer = Outer("avg", 1.0, 0.0)
    engine.merge(
        RoundMerge(
            "r", 0, Accumulator(SCHEMA), codec, outer, total=1.0, fraction=1.0, unfolded=[(UpdateKey("r", 0, "p"), 1.0)]
        )
    )
    engine.build_versions("r", 1, codec, SCHEMA)
    objects = seaweedfs.store("dead-build/")
    objects.put(object_name(VersionKey("r", 0)), model)
    objects.put(object_name(ResultKey("r", 0)), _bytes(alone, ResultKey("r", 0)))
    board = Board(0.3, lambda: objects)

    async def scene() -> tuple[ObjectRecord, str]:
        built = asyncio.ensure_future(build_leased(board, 1, "r", 0, SCHEMA, codec, objects))
        job = await board.take("dead", 5.0)  # taken, then never renewed nor reported
        assert job is not None and job.lease
        record, _ = await built
        return record, job.lease

    try:
        record, lease = asyncio.run(scene())
        version = _bytes(alone, VersionKey("r", 1))
        assert record.size == len(version) and bytes(objects.read(object_name(VersionKey("r", 1)))) == version
        assert board.reducers["dead"].expired == 1 and board.reducers["hub"].leases == 1
        with pytest.raises(LeaseLost):
            board.done(lease, Done(reducer="dead", seconds=1.0, bytes=1))
        assert not objects.uploads("runs/")
    finally:
        engine.close()
        alone.close()


def test_a_reducer_that_cannot_reach_a_file_of_the_hub_says_so_in_one_line(tmp_path: Path) -> None:
    """A lease that names a file on the hub's disk (DiLoCo's momentum, say) worked on another
    machine: the reducer fails it with one line naming the file and what to do."""
    job = MergeJob.model_validate(
        {
            "lease": "L",
            "run": "r",
            "round": 1,
            "seconds": 5.0,
            "step": {
                "round": 1, "outer": "diloco", "kind": "diloco", "lr": 0.7, "mu": 0.9, "fresh": False,
                "complete": True, "scale": None, "empty": False, "codec": "fp32", "run_codec": "fp32",
            },
            "base": None,
            "base_object": "runs/r/versions/00000001/model.safetensors",
            "momentum": str(tmp_path / "elsewhere" / "momentum.safetensors"),
            "residual": None,
            "updates": [],
            "slices": [],
            "result": {"parts": [{"part": 1, "url": "http://127.0.0.1:9/x", "size": 8}], "size": 8, "at": {}},
            "next_momentum": None,
            "next_residual": None,
            "reads": 0,
            "writes": 0,
        }
    )  # fmt: skip
    report = work(job, "far", objects=lambda: None)  # type: ignore[arg-type,return-value]
    said = report.detail  # type: ignore[union-attr]
    assert report.error == "failed", report  # type: ignore[union-attr]
    assert "\n" not in said and "momentum.safetensors" in said and "hub's machine" in said, said


def _far_reducer(url: str, seaweedfs: SeaweedFS, prefix: str, folder: Path) -> subprocess.Popen[bytes]:
    """A `syncserver reduce` as on another machine: its own working folder, no SYNC_* of the
    hub's but the store's URL and credentials (it never learns the hub's data dir)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "AWS_"))}
    env |= {**seaweedfs.env(), "SYNC_STORE": f"s3://{seaweedfs.bucket}/{prefix}", "SYNC_REDUCE_TOKEN": ADMIN}
    with (folder / "reducer.log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "syncserver", "reduce", "--hub", url], env=env, stdout=out, stderr=out, cwd=folder
        )


#: plain averaging, and DiLoCo with topk (its momentum and the hub's residual: parts in the
#: bucket, read by ranges the round after); async rounds with the peers syncing one after the
#: other: the same acknowledgement order (the fold order) on every hub, so the same bits
AVG: dict[str, tuple[dict[str, object], bool]] = {
    **{
        spec: ({"codec": spec, "outer": "avg", "policy": "async", "round_samples": 9}, True)
        for spec in ("int8", "fp32")
    },
    "diloco-topk": ({"codec": "topk", "outer": "diloco", "policy": "async", "round_samples": 9}, True),
}
PEERS = ("a", "b", "c")


def test_three_peers_and_two_far_reducers_give_the_bits_of_a_hub_alone(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, tmp_path: Path
) -> None:
    """3 peers x 2 `syncserver reduce` processes started away from the hub's data dir, store
    and reducers: int8 and fp32 runs (plain averaging) and a DiLoCo run with topk (momentum and
    residual in the bucket) close every round to the bits of a lone hub without a store,
    results and models; the hub uploaded version 0 only (its
    weightsync_store_upload_bytes_total is one model: no result went through it)."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    alone = hub_factory(env=env)
    expected = {run: _train(alone.url, run, 2, PEERS, options) for run, options in AVG.items()}
    hub = hub_factory(
        "--store", f"s3://{seaweedfs.bucket}/far", "--reducers", "2", "--local-reducers", "0",
        env={**env, **seaweedfs.env()},
    )  # fmt: skip
    reducers = [_far_reducer(hub.url, seaweedfs, "far", tmp_path / f"far{i}") for i in range(2)]
    try:
        for run, options in AVG.items():
            assert _train(hub.url, run, 2, PEERS, options) == expected[run], run
    finally:
        for proc in reducers:
            proc.kill()
            proc.wait()
    samples = scrape(hub, TOKEN)
    for run in AVG:
        model = HTTP.get(f"{alone.url}/v1/runs/{run}/model", headers={"Authorization": f"Bearer {TOKEN}"})
        # version 0 went up once (the reducers read it there); no result, no later version
        uploaded = samples["weightsync_store_upload_bytes_total", (("run", run),)]
        assert 0 < uploaded < 1.01 * len(model.content), (run, uploaded)
    assert sum(int(r["leases"]) for r in _reducers(hub).values()) >= 4  # type: ignore[call-overload]
    assert "hub" not in _reducers(hub)  # the far reducers worked every lease


def test_a_dead_reducer_s_part_is_sent_again_a_dead_hub_s_aborted(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, tmp_path: Path
) -> None:
    """Round 0: a reducer uploads its part, its report is cut and it is SIGKILLed: the lease
    expires and another reducer uploads the same part number again; same bits. Round 1: the
    part is uploaded, its report cut, and the hub SIGKILLed before completing the upload: the
    restarted hub aborts the open multipart uploads and the round is merged again, to the bits
    of a lone hub without a store."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    options = AVG["int8"]
    expected = _train(hub_factory(env=env).url, "int8", 2, PEERS, options)
    hub = hub_factory(
        "--store", f"s3://{seaweedfs.bucket}/crash", "--reducers", "2", "--local-reducers", "0",
        "--reduce-lease-seconds", "1.5", env={**env, **seaweedfs.env()},
    )  # fmt: skip
    objects = seaweedfs.store("crash/")
    results: list[dict[str, str]] = []
    with FaultProxy(hub.port) as first, FaultProxy(hub.port) as second:
        first.cut(after=0, match="/done")
        doomed = _far_reducer(first.url, seaweedfs, "crash", tmp_path / "doomed")
        wait_for(lambda: len(_reducers(hub)) == 1, "the first reducer to ask for a lease")
        peers = threading.Thread(target=lambda: results.append(_train(hub.url, "int8", 2, PEERS, options)))
        peers.start()
        wait_for(lambda: any(r.fault == "cut" for r in first.matching("/done")), "round 0's report to be cut")
        rescuer = _far_reducer(second.url, seaweedfs, "crash", tmp_path / "rescuer")
        try:
            doomed.kill()
            doomed.wait()
            auth = {"Authorization": f"Bearer {TOKEN}"}
            wait_for(lambda: HTTP.get(f"{hub.url}/v1/runs/int8", headers=auth).json()["version"] >= 1, "round 0")
            second.cut(after=0, match="/done")  # round 1's report: its part is up, the upload open
            wait_for(lambda: any(r.fault == "cut" for r in second.matching("/done")), "round 1's report to be cut")
            open_before = {u.upload_id for u in objects.uploads("runs/int8/")}
            assert open_before  # the result's and version 2's uploads, their parts sent
            hub.kill()
            hub.start()
            assert not open_before & {u.upload_id for u in objects.uploads("runs/int8/")}
            peers.join(120)
            assert results == [expected]
        finally:
            rescuer.kill()
            rescuer.wait()
    assert "work_lease_expired" in hub.log() and "object_store_orphans_deleted" in hub.log()


def test_a_lease_streams_of_the_updates_a_mean_holds_only_the_slices_it_lacks(seaweedfs: SeaweedFS) -> None:
    """A lease over a mean that holds the first two of three updates, with one of its two slices
    held here: its readers of those two updates expect (and so stream) only the slice it lacks,
    the third update's every slice; nothing is read before a slice asks (no request at all)."""
    slices = [
        SliceJob(name="w", start=0, stop=4096, parts={"": (0, 4096)}, out_parts={}),
        SliceJob(name="w", start=4096, stop=8192, parts={"": (4096, 4096)}, out_parts={}),
    ]
    updates = [UpdateSource(object=f"u{i}", weight=1.0) for i in range(3)]
    MEANS.put("parts-run", "m", "w", 4096, np.zeros(4096, np.float32))
    objects = seaweedfs.store("lease-updates/")
    before = objects.bytes_read
    with contextlib.ExitStack() as files:
        readers = _updates(_At("L", files, lambda: objects), updates, slices, "m", 2)
        expected = [wire._expected for wire, _ in readers]  # type: ignore[union-attr]
    assert expected == [[("w", 0, 4096)], [("w", 0, 4096)], [("w", 0, 4096), ("w", 4096, 8192)]]
    assert objects.bytes_read == before
    MEANS.start("parts-run", [])
