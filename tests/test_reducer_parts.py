"""Reducers write their parts of the result and of version v+1 to the bucket (issue 24, part R
step 4): every lease's bytes of each output are one part of a multipart upload the hub completes,
so a reducer needs nothing of the hub's disk (avg rounds) and the hub uploads no result. In
process against SeaweedFS: the bits of a lone hub on local disk, for fp32 and int8."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import syncserver.core.leases
from syncserver.core.leases import Board, merge_leased
from syncserver.reduce.engine import Accumulator, MergeEngine, Outer
from syncserver.reduce.lease import Job, work
from syncserver.storage.bucket import object_name, update_name
from syncserver.storage.store import ResultKey, Store, UpdateKey, VersionKey
from syncwire import get_codec
from tests.s3server import SeaweedFS
from tests.test_reducers import SCHEMA, _bytes
from tests.test_streaming_hub import _update_file

#: 12 MB of fp32: two parts of S3's 5 MiB at least (SeaweedFS refuses smaller ones but the last)
BIG = {"w": (1_500_000,), "e": (1_000, 1_500)}


@pytest.mark.parametrize(("spec", "schema", "parts"), [("fp32", BIG, 2), ("int8", SCHEMA, 1)])
def test_leases_written_as_parts_give_the_bits_of_the_hub_alone(
    tmp_path: Path, seaweedfs: SeaweedFS, spec: str, schema: dict[str, tuple[int, ...]], parts: int
) -> None:
    """Two rounds of three updates in the bucket, merged by K = 2 leases whose jobs name no file
    of the hub (version v, the updates: objects; the outputs: part URLs), worked by the hub's own
    lease function: the completed result and version v+1 objects are the lone hub's files, and
    round 1 reads version 1 from the bucket only (the hub's disk has no version file at all).
    A small result is one part (S3's parts are 5 MiB but the last)."""
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
    objects.put(object_name(VersionKey("r", 0)), model)
    hub = Store(tmp_path / "hub")  # holds no model file: everything is in the bucket
    engines = MergeEngine(alone, threads=2), MergeEngine(hub, threads=2, objects=objects)
    board = Board(0.05, lambda: objects)  # no reducer: the hub works each lease, as a reducer would
    taken: list[Job] = []
    original = syncserver.core.leases.jobs

    def spy(*args: object, **kwargs: object) -> list[Job]:
        made = original(*args, **kwargs)  # type: ignore[arg-type]
        taken.extend(made)
        return made

    syncserver.core.leases.jobs = spy  # type: ignore[assignment]
    loop = asyncio.new_event_loop()  # the board's events live in one loop, as in the hub
    try:
        for v, updates in enumerate(rounds):
            keys, remote = [], []
            for k, data in enumerate(updates):
                with alone.write(UpdateKey("r", v, f"p{k}")) as f:
                    f.write(data)
                name = update_name("r", v, f"p{k}", f"k{k}")
                objects.put(name, data)
                keys.append((UpdateKey("r", v, f"p{k}"), 3.0 + 2 * k))
                remote.append((UpdateKey("r", v, f"p{k}", name, len(data)), 3.0 + 2 * k))
            engines[0].merge("r", v, Accumulator(schema), codec, outer, total=21.0, fraction=1.0, unfolded=keys)
            engines[0].build_versions("r", v + 1, codec, schema)
            size, records = loop.run_until_complete(
                merge_leased(
                    board, 2, engines[1], "r", v, Accumulator(schema), codec, outer,
                    total=21.0, fraction=1.0, unfolded=remote,
                )
            )  # fmt: skip
            assert size == len(_bytes(alone, ResultKey("r", v)))
            assert [r.key for r in records] == [ResultKey("r", v), VersionKey("r", v + 1)]
            assert bytes(objects.read(object_name(ResultKey("r", v)))) == _bytes(alone, ResultKey("r", v))
            assert bytes(objects.read(object_name(VersionKey("r", v + 1)))) == _bytes(alone, VersionKey("r", v + 1))
            assert [r.size for r in records] == [size, len(_bytes(alone, VersionKey("r", v + 1)))]
        assert not objects.uploads("runs/")  # every multipart upload completed
        assert not list((tmp_path / "hub").rglob("*.safetensors"))  # the hub's disk holds no model bytes
        # a lease names nothing on the hub's disk: a reducer on another machine can do it
        assert len(taken) == 2 * parts
        for job in taken:
            assert job.base is None and job.base_object is not None
            assert all(u.path is None for u in job.updates)
            assert job.result.path is None and job.next_version is not None and job.next_version.path is None
        assert all(bool(job.result.head) == (job.result.part == 1) for job in taken)  # the header: in part 1
    finally:
        syncserver.core.leases.jobs = original  # type: ignore[assignment]
        loop.close()
        for engine in engines:
            engine.close()
        alone.close()
        hub.close()


def test_a_reducer_that_cannot_reach_a_file_of_the_hub_says_so_in_one_line(tmp_path: Path) -> None:
    """A lease that names a file on the hub's disk (DiLoCo's momentum, say) worked on another
    machine: the reducer fails it with one line naming the file and what to do."""
    job = Job.model_validate(
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
            "result": {"url": "http://127.0.0.1:9/x", "part": 1, "size": 8, "at": {}},
            "next_momentum": None,
            "next_residual": None,
            "reads": 0,
            "writes": 0,
        }
    )  # fmt: skip
    with pytest.raises(RuntimeError) as failed:
        work(job, "far", objects=lambda: None)  # type: ignore[arg-type,return-value]
    said = str(failed.value)
    assert "\n" not in said and "momentum.safetensors" in said and "hub's machine" in said, said
