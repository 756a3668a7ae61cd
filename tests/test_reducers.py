"""Reducers share the merge (issue 24): leases give the bits of the in-process merge for any K,
the board re-offers an expired lease and refuses a late report, and real ``syncserver reduce``
processes against a real hub give the bits of a hub that merges alone."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

import syncserver.core.leases
import syncserver.reduce.lease
import syncwire.codecs
from syncserver.core.leases import Board, FoldAhead, LeaseFailed
from syncserver.errors import LeaseLost, NotFound
from syncserver.reduce.engine import Accumulator, MergeEngine, NonFinite, Outer, RoundMerge, merge_slice
from syncserver.reduce.lease import MEANS, Done, FoldJob, Means, UpdateSource, fold_jobs, highest, jobs, parse, work
from syncserver.reduce.plan import pieces
from syncserver.storage.objectfile import TensorReader
from syncserver.storage.store import MomentumKey, ResidualKey, ResultKey, Store, UpdateKey, VersionKey
from syncwire import get_codec
from tests.conftest import Hub
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, Peers, wait_for
from tests.models import perturb
from tests.s3server import SeaweedFS
from tests.test_metrics import scrape
from tests.test_streaming_hub import _bytes, _update_file

SCHEMA = {"w": (20_003,), "b": (37,), "e": (30, 64)}  # "w": five slices of 4096 values
Keys = list[tuple[UpdateKey, float]]


@pytest.fixture(autouse=True)
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of 4096 values: a tiny model cut as GPT-2 is, in a few milliseconds."""
    monkeypatch.setattr(syncwire.codecs, "SLICE_VALUES", 4096)


def _stores(tmp_path: Path, spec: str, n: int, seed: int = 7) -> list[tuple[Store, list[tuple[UpdateKey, float]]]]:
    """``n`` stores holding the same version 0 and three updates of round 0 and of round 1."""
    codec = get_codec(spec)
    rng = np.random.default_rng(seed)
    model = {name: rng.standard_normal(s, dtype=np.float32) for name, s in SCHEMA.items()}
    rounds = [
        [
            _update_file(codec, {k: rng.standard_normal(s, dtype=np.float32) * 1e-2 for k, s in SCHEMA.items()})
            for _ in range(3)
        ]
        for _ in range(2)
    ]
    out = []
    for i in range(n):
        store = Store(tmp_path / str(i))
        with store.write(VersionKey("r", 0)) as f:
            f.write(_update_file(get_codec("fp32"), model))
        for v, updates in enumerate(rounds):
            for k, data in enumerate(updates):
                with store.write(UpdateKey("r", v, f"p{k}")) as f:
                    f.write(data)
        out.append((store, [(UpdateKey("r", 0, f"p{k}"), 3.0 + 2 * k) for k in range(3)]))
    return out


def _outputs(store: Store, v: int) -> list[bytes]:
    """Round ``v``'s result, the next momentum and residual if any, and version v + 1."""
    keys = (ResultKey("r", v), MomentumKey("r", v + 1), ResidualKey("r", v + 1))
    blob = store.serve(VersionKey("r", v + 1))
    try:
        version = blob.read(0, blob.size)
    finally:
        blob.close()
    return [*(_bytes(store, key) for key in keys if store.exists(key)), version]


CASES = [
    (spec, outer, final)
    for spec in ("fp32", "int8", "topk:chunk=64,k=4,block=64")
    for outer in ("avg", "diloco")
    for final in (False, True)
] + [("int4", "diloco", False), ("int4", "avg", True)]


@pytest.mark.parametrize(("spec", "outer", "final"), CASES)
def test_leases_worked_in_any_order_give_the_bits_of_the_in_process_merge(
    tmp_path: Path, spec: str, outer: str, final: bool
) -> None:
    """K = 1, 2, 3 leases, worked last first, one of them twice (an expired lease redone), give
    the in-process merge's result, momentum and residual, over two rounds (the second reads
    the first's momentum and residual); the in-process one folded one update before its close.
    The reducers fold ahead too (:class:`FoldAhead`, its fold leases cut K ways, the mean held in
    memory): K = 1 two steps of one update, K = 2 one step of one, K = 3 one step of two; the
    merge leases fold the rest after that mean (the lease redone folds its slices from the first
    update; at K = 3 the mean is dropped before the merge, as a restarted reducer lacks it): the
    same bits however the folds are grouped, and no mean is left held."""
    codec, outer_ = get_codec(spec), Outer(outer, 0.7, 0.9)
    stores = _stores(tmp_path, spec, 4)
    written: list[list[bytes]] = []
    for i, (store, keys0) in enumerate(stores):
        engine = MergeEngine(store, threads=2)
        for v in range(2):
            keys = [(UpdateKey("r", v, key.peer), w) for key, w in keys0]
            acc = Accumulator(SCHEMA)
            last = final and v == 1
            if i == 0:  # the hub alone, one update folded before the close
                engine.fold(acc, *keys[0], codec)
                engine.merge(
                    RoundMerge("r", v, acc, codec, outer_, total=30.0, fraction=1.0, final=last, unfolded=keys[1:])
                )
            else:
                ahead = FoldAhead(Board(lease_seconds=0.01), i, engine)
                steps = {1: [keys[:1], keys[1:2]], 2: [keys[:1]], 3: [keys[:2]]}[i]

                async def fold_ahead(
                    ahead: FoldAhead = ahead, steps: list[Keys] = steps, v: int = v, acc: Accumulator = acc
                ) -> None:
                    for step in steps:  # no reducer polls: the hub works the fold leases itself
                        await ahead.fold("r", v, acc, codec, [(key.peer, key, w) for key, w in step])

                asyncio.run(fold_ahead())
                assert acc.mean is None and acc.partial is not None and len(acc.folded) == sum(map(len, steps))
                held = 4 * sum(math.prod(shape) for shape in SCHEMA.values())
                assert MEANS.nbytes() == held  # the mean it folded onto went as the new one was made
                if i == 3:
                    MEANS.start("r", [])  # a reducer restarted: every slice folded from the first update
                with contextlib.ExitStack() as files:
                    rest = keys[len(acc.folded) :]
                    merge = engine.open_merge(
                        files,
                        RoundMerge("r", v, acc, codec, outer_, total=30.0, fraction=1.0, final=last, unfolded=rest),
                    )
                    leases = jobs(merge, SCHEMA, i)
                    # an int8/topk result is cut at tensors only: "w" is one lease whatever K
                    assert len(leases) == (i if get_codec(merge.step.codec).lossless else min(i, 2))
                    with ThreadPoolExecutor(2) as pool:  # a reducer's --threads 2
                        for job in [*reversed(leases), leases[0]]:
                            assert work(job, "t", pool=pool if i == 2 else None).error is None
                assert MEANS.nbytes() == 0  # the merge took every slice it held
            engine.build_versions("r", v + 1, codec, SCHEMA)
            written.append(_outputs(store, v))
        engine.close()
        store.close()
    reference = written[:2]
    for i in range(1, 4):
        assert written[2 * i : 2 * i + 2] == reference, f"K={i}"
    assert len(reference[0]) == 2 + (outer == "diloco") + codec.hub_feedback


def test_a_lease_that_would_not_be_finite_says_so(tmp_path: Path) -> None:
    """A slice whose version v + update overflows float32 reports non_finite (the hub then
    leaves an update out, as it does merging alone), and nothing is left half-published."""
    codec = get_codec("fp32")
    store = Store(tmp_path)
    with store.write(VersionKey("r", 0)) as f:
        f.write(_update_file(codec, {n: np.full(s, 3e38, np.float32) for n, s in SCHEMA.items()}))
    with store.write(UpdateKey("r", 0, "p")) as f:
        f.write(_update_file(codec, {n: np.full(s, 3e38, np.float32) for n, s in SCHEMA.items()}))
    engine = MergeEngine(store, threads=1)
    acc, key = Accumulator(SCHEMA), UpdateKey("r", 0, "p")
    with pytest.raises(NonFinite), contextlib.ExitStack() as files:
        outer = Outer("avg", 1, 0)
        merge = engine.open_merge(
            files, RoundMerge("r", 0, acc, codec, outer, total=1.0, fraction=math.inf, unfolded=[(key, 1.0)])
        )
        reports = [work(job, "t") for job in jobs(merge, SCHEMA, 2)]
        assert {r.error for r in reports} == {"non_finite"}
        raise NonFinite(reports[0].detail)
    assert not store.exists(ResultKey("r", 0))
    engine.close()
    store.close()


class _CountingReader:
    """A version file whose reads are counted (does a merge read version v?)."""

    def __init__(self, wire: TensorReader) -> None:
        self.wire, self.reads = wire, 0

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        self.reads += 1
        return self.wire.read(name, start, stop)


def test_a_bound_on_version_v_spares_its_reads_and_an_overflow_is_still_caught(tmp_path: Path) -> None:
    """Under a bound on |version v| that leaves room, a slice is checked without reading version
    v, gives the same result bytes and reports a bound on |version v+1| no lower than the truth;
    a bound with no room (or none) reads version v and checks exactly: an overflow is caught."""
    codec, outer = get_codec("int8"), Outer("avg", 1, 0)
    store = Store(tmp_path)
    rng = np.random.default_rng(5)
    start = {n: rng.standard_normal(s, dtype=np.float32) for n, s in SCHEMA.items()}
    with store.write(VersionKey("r", 0)) as f:
        f.write(_update_file(get_codec("fp32"), start))
    with store.write(UpdateKey("r", 0, "p")) as f:
        f.write(_update_file(codec, {n: np.full(s, 0.5, np.float32) for n, s in SCHEMA.items()}))
    engine = MergeEngine(store, threads=1)
    items = pieces(codec, codec, SCHEMA)
    written: list[bytes] = []
    peaks: list[dict[str, float]] = []
    for bound in ({n: float(np.abs(a).max()) for n, a in start.items()}, {n: 3e38 for n in SCHEMA}, None):
        with contextlib.ExitStack() as files:
            opened = engine.open_merge(
                files,
                RoundMerge(
                    "r",
                    0,
                    Accumulator(SCHEMA),
                    codec,
                    outer,
                    total=1.0,
                    fraction=1.0,
                    unfolded=[(UpdateKey("r", 0, "p"), 1.0)],
                ),
            )
            base = _CountingReader(opened.base)
            merge = dataclasses.replace(opened, base=base, bound=bound, peaks=[])  # type: ignore[arg-type]
            for p in items:
                merge_slice(merge, None, p.name, p.start, p.stop, p.parts, p.out_parts)
            assert base.reads == (0 if bound is not None and bound["w"] < 1e30 else len(items)), bound
            assert merge.peaks is not None
            peaks.append(highest(merge.peaks))
        written.append(_bytes(store, ResultKey("r", 0)))
    assert written[0] == written[1] == written[2]
    engine.build_versions("r", 1, codec, SCHEMA)
    with store.read(VersionKey("r", 1)) as version:
        truth = {n: float(np.abs(version.read(n)).max()) for n in SCHEMA}
    assert peaks[2] == truth == peaks[1]  # read: exact
    assert all(truth[n] <= peaks[0][n] <= truth[n] + 1.01 for n in SCHEMA)  # bounded: no lower than the truth
    # an overflow under a bound with no room: version v is read and the sum refused
    with store.write(VersionKey("r", 0)) as f:
        f.write(_update_file(get_codec("fp32"), {n: np.full(s, 3e38, np.float32) for n, s in SCHEMA.items()}))
    with store.write(UpdateKey("r", 0, "p")) as f:
        f.write(_update_file(get_codec("fp32"), {n: np.full(s, 3e38, np.float32) for n, s in SCHEMA.items()}))
    with contextlib.ExitStack() as files, pytest.raises(NonFinite):
        merge = engine.open_merge(
            files,
            RoundMerge(
                "r",
                0,
                Accumulator(SCHEMA),
                get_codec("fp32"),
                outer,
                total=1.0,
                fraction=1.0,
                unfolded=[(UpdateKey("r", 0, "p"), 1.0)],
                bound={n: 3e38 for n in SCHEMA},
            ),
        )
        p = pieces(get_codec("fp32"), get_codec("fp32"), SCHEMA)[0]
        merge_slice(merge, None, p.name, p.start, p.stop, p.parts, p.out_parts)
    engine.close()
    store.close()


# ---- the board ------------------------------------------------------------------------------------


def _fake_jobs(tmp_path: Path, n: int) -> list:  # type: ignore[type-arg]
    store = _stores(tmp_path, "fp32", 1)[0][0]
    engine = MergeEngine(store, threads=1)
    files = contextlib.ExitStack()
    keys = [(UpdateKey("r", 0, "p0"), 1.0)]
    merge = engine.open_merge(
        files,
        RoundMerge(
            "r", 0, Accumulator(SCHEMA), get_codec("fp32"), Outer("avg", 1, 0), total=1.0, fraction=1.0, unfolded=keys
        ),
    )
    out = jobs(merge, SCHEMA, n)
    files.close()
    engine.close()
    store.close()
    return out


def test_a_lease_keeps_its_wire_shape_and_parses_back_as_its_kind(tmp_path: Path) -> None:
    """A merge lease's JSON names no kind (the wire predates the other kinds), a fold lease's
    names its own; each parses back, as the reducer parses the hub's answer, into its kind."""
    merge = _fake_jobs(tmp_path, 1)[0]
    fold = fold_jobs(SCHEMA, get_codec("int8"), 1, "m", None, 0.0, [UpdateSource(path="u", weight=1.0)])[0]
    for job, kind in ((merge, None), (fold, "fold")):
        wire = job.model_dump(mode="json")
        assert wire.get("kind") == kind
        assert type(parse(wire)) is type(job) and parse(wire) == job
    with pytest.raises(ValueError, match="kind"):
        parse({**fold.model_dump(mode="json"), "kind": "sweep"})


def test_a_fold_lease_lost_mid_fold_is_redone_from_the_updates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two steps ahead (p0, then p1 and p2 at once), K = 2, the mean held in the reducers'
    memory. "doomed" folds the first step, so the second's leases are offered to it first: a
    reducer that asks meanwhile gets none. It takes one, takes its slices of the mean (folding
    them in place) and dies: its lease expires, and once it is not heard from the rescuer takes
    both leases, folding the dead one's slices again from the first update and the others after
    the mean it holds. The merge gives the bits of the hub alone folding as updates arrive, and
    the dead reducer's late report is refused."""
    monkeypatch.setattr(syncserver.core.leases, "AFFINITY_SECONDS", 0.2)
    codec, outer = get_codec("int8"), Outer("diloco", 0.7, 0.9)
    (alone, keys), (store, _) = _stores(tmp_path, "int8", 2)
    engine = MergeEngine(alone, threads=1)
    acc = Accumulator(SCHEMA)
    for key, w in keys:
        engine.fold(acc, key, w, codec)
    engine.merge(RoundMerge("r", 0, acc, codec, outer, total=30.0, fraction=1.0))
    engine.close()
    engine = MergeEngine(store, threads=1)
    acc = Accumulator(SCHEMA)

    async def scenario() -> None:
        board = Board(lease_seconds=0.3)
        ahead = FoldAhead(board, 2, engine)
        first = asyncio.create_task(ahead.fold("r", 0, acc, codec, [("p0", *keys[0])]))
        while not first.done():
            job = await board.take("doomed", wait=0.05)
            if job is not None:
                board.done(job.lease, await asyncio.to_thread(work, job, "doomed"))  # type: ignore[arg-type]
        before = acc.partial
        assert before is not None and set(before.holders.values()) == {"doomed"}
        second = asyncio.create_task(ahead.fold("r", 0, acc, codec, [(k.peer, k, w) for k, w in keys[1:]]))
        doomed = await board.take("doomed", wait=5)
        assert isinstance(doomed, FoldJob) and doomed.base == before.id and doomed.held == 1
        assert await board.take("rescuer", wait=0.05) is None  # the other lease waits for its holder
        for s in doomed.slices:  # folded in place, then the reducer is gone with its memory
            assert MEANS.take(before.id, s.name, s.start) is not None
        while not second.done():
            job = await board.take("rescuer", wait=0.05)
            if job is not None:
                board.done(job.lease, await asyncio.to_thread(work, job, "rescuer"))  # type: ignore[arg-type]
        await second
        with pytest.raises(LeaseLost):
            board.done(doomed.lease, Done(reducer="doomed", seconds=0.1, bytes=1))
        assert acc.partial is not None and set(acc.partial.holders.values()) == {"rescuer"}
        assert acc.folded == ["p0", "p1", "p2"] and board.reducers["doomed"].expired == 1

    asyncio.run(scenario())
    with contextlib.ExitStack() as files:
        merge = engine.open_merge(files, RoundMerge("r", 0, acc, codec, outer, total=30.0, fraction=1.0))
        for job in jobs(merge, SCHEMA, 2):
            assert work(job, "t").error is None
    assert _bytes(store, ResultKey("r", 0)) == _bytes(alone, ResultKey("r", 0))
    assert _bytes(store, MomentumKey("r", 1)) == _bytes(alone, MomentumKey("r", 1))
    assert MEANS.nbytes() == 0
    engine.close()


def test_the_board_offers_again_what_expired_and_refuses_the_late_report(tmp_path: Path) -> None:
    work_ = _fake_jobs(tmp_path, 2)

    async def scenario() -> None:
        board = Board(lease_seconds=0.3)
        merge = asyncio.create_task(board.run("r", 0, work_))
        first = await board.take("a", wait=5)
        second = await board.take("b", wait=5)
        assert first is not None and second is not None and first.run == "r"
        assert board.renew(second.lease, "b") == 0.3
        with pytest.raises(LeaseLost):
            board.renew(second.lease, "a")  # not a's
        board.done(second.lease, Done(reducer="b", seconds=0.01, bytes=10))
        with pytest.raises(LeaseLost):  # reported twice
            board.done(second.lease, Done(reducer="b", seconds=0.01, bytes=10))
        again = await board.take("b", wait=5)  # "a" went silent: its lease comes back, under a new id
        assert again is not None and again.lease != first.lease and again.slices == first.slices
        with pytest.raises(LeaseLost):
            board.done(first.lease, Done(reducer="a", seconds=0.01, bytes=10))
        with pytest.raises(NotFound):
            board.renew("0" * 32, "a")
        assert not merge.done()
        board.done(again.lease, Done(reducer="b", seconds=0.02, bytes=10))
        await asyncio.wait_for(merge, 5)
        stats = {r.name: r for r in board.live(60)}
        assert stats["a"].expired == 1 and stats["a"].leases == 0
        assert stats["b"].leases == 2 and stats["b"].seconds == pytest.approx(0.03) and stats["b"].holding is None
        assert await board.take("a", wait=0.05) is None  # nothing left on the board

    asyncio.run(scenario())


@pytest.mark.parametrize(("error", "raised"), [("non_finite", NonFinite), ("failed", LeaseFailed)])
def test_a_lease_that_fails_fails_the_merge_and_leaves_nothing_on_the_board(
    tmp_path: Path, error: str, raised: type[Exception]
) -> None:
    work_ = _fake_jobs(tmp_path, 3)

    async def scenario() -> None:
        board = Board(lease_seconds=5)
        merge = asyncio.create_task(board.run("r", 0, work_))
        job = await board.take("a", wait=5)
        held = await board.take("b", wait=5)
        assert job is not None and held is not None
        board.done(job.lease, Done(reducer="a", seconds=0, bytes=0, error=error, detail="tensor 'w'"))
        with pytest.raises(raised, match="reducer a: tensor 'w'"):
            await asyncio.wait_for(merge, 5)
        with pytest.raises(LeaseLost):  # the round moved on without it
            board.done(held.lease, Done(reducer="b", seconds=0, bytes=0))
        assert await board.take("c", wait=0.05) is None

    asyncio.run(scenario())


# ---- real reducer processes against a real hub ----------------------------------------------------

ADMIN, TOKEN = "admin-secret", "hub-secret"
RUNS = {  # run -> (SyncClient options, sequential syncs)
    "barrier": ({"codec": "int8", "outer": "diloco"}, False),
    "samples": ({"codec": "topk", "outer": "avg", "policy": "samples", "round_samples": 9}, False),
    "async": ({"codec": "fp32", "outer": "diloco", "policy": "async", "round_samples": 9}, True),
}


def _train(
    url: str,
    run: str,
    rounds: int = 3,
    names: tuple[str, ...] = ("a", "b"),
    spec: tuple[dict[str, object], bool] | None = None,
) -> dict[str, str]:
    """Peers ``names``, ``rounds`` syncs of seeded perturbations, the last one final; the sha-256
    of every round's result file and of the latest model, as the hub serves them. ``spec``:
    the SyncClient's options and whether the peers sync one after the other (the fold order is
    the acknowledgement order), else ``RUNS[run]``."""
    options, sequential = spec if spec is not None else RUNS[run]
    peers = Peers(url, run, list(names), token=TOKEN, min_peers=len(names), **options)
    peers.join()

    def sync(name: str, r: int) -> None:
        client, model = peers.clients[name], peers.models[name]
        perturb(model, 10 * r + names.index(name), client.version)
        client.sync(model, samples=4 + names.index(name), final=r == rounds - 1)

    for r in range(rounds):
        if sequential:
            for name in names:
                sync(name, r)
        else:
            peers.parallel(list(names), lambda n, r=r: sync(n, r))
    peers.close()
    return _digests(url, run)


#: every update is folded ahead as it is acknowledged; fp32 and DiLoCo on top
FP32_IN_ORDER: dict[str, object] = {"codec": "fp32", "outer": "diloco"}


def _train_in_order(
    url: str, run: str, options: dict[str, object], rounds: int, names: tuple[str, ...]
) -> dict[str, str]:
    """A barrier run whose peers upload one after the other, each once the hub acknowledged the
    one before (``sync_async``, applied once all are in): every hub folds the same updates in
    the same order, and with reducers all but the last are folded ahead of the close."""
    peers = Peers(url, run, list(names), token=TOKEN, min_peers=len(names), **options)
    peers.join()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for r in range(rounds):
        pending = []
        for name in names:
            client, model = peers.clients[name], peers.models[name]
            perturb(model, 10 * r + names.index(name), client.version)
            pending.append((name, client.sync_async(model, samples=4 + names.index(name))))

            def acked(name: str = name, r: int = r) -> bool:
                try:
                    state = HTTP.get(f"{url}/v1/runs/{run}", headers=auth).json()
                except httpx.HTTPError:  # a hub that a test killed, restarting
                    return False
                return state["version"] > r or name in state["open_round"]["submitted"]

            wait_for(acked, f"{name}'s update of round {r} to be acknowledged")
        for name, sync in pending:
            sync.apply(peers.models[name])
    peers.close()
    return _digests(url, run)


def _digests(url: str, run: str) -> dict[str, str]:
    """The sha-256 of every round's result file and of the latest model, as the hub serves them."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # follow_redirects: a hub with a store sends downloads there (httpx drops the token on the way)
    model = HTTP.get(f"{url}/v1/runs/{run}/model", headers=auth, timeout=60, follow_redirects=True)
    model.raise_for_status()
    version = HTTP.get(f"{url}/v1/runs/{run}", headers=auth).json()["version"]
    results = {}
    for v in range(version):
        r = HTTP.get(f"{url}/v1/runs/{run}/rounds/{v}/result", headers=auth, timeout=60, follow_redirects=True)
        results[f"result {v}"] = hashlib.sha256(r.content).hexdigest() if r.status_code == 200 else str(r.status_code)
    return {"model": hashlib.sha256(model.content).hexdigest(), "version": str(version), **results}


def _reducer(url: str, token: str | None, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    if token:
        env["SYNC_REDUCE_TOKEN"] = token
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "syncserver", "reduce", "--hub", url], env=env, stdout=out, stderr=out
        )


def _reducers(hub: Hub) -> dict[str, dict[str, object]]:
    r = HTTP.get(f"{hub.url}/v1/reduce/reducers", headers={"Authorization": f"Bearer {TOKEN}"})
    r.raise_for_status()
    return {x["name"]: x for x in r.json()}


def test_reducer_processes_give_the_bits_of_the_hub_alone(hub_factory: Callable[..., Hub]) -> None:
    """`serve --reducers 3` (three child processes, leases cut three ways) closes barrier,
    samples and async rounds of int8/DiLoCo, topk and fp32 runs, final rounds included, to the
    bits of a hub that merges alone: every result and the model; /metrics, /v1/reduce/reducers
    and `syncserver status` show the reducers and their leases; one killed is started again;
    they die with the hub."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    alone = hub_factory(env=env)
    shared = hub_factory("--reducers", "3", env=env)
    for run in RUNS:
        expected = _train(alone.url, run)
        assert _train(shared.url, run) == expected, run
        assert int(expected["version"]) >= 3
    assert "work_lease_taken kind=merge" in shared.log() and "work_lease_taken" not in alone.log()
    known = _reducers(shared)
    assert len(known) == 3 and sum(int(r["leases"]) for r in known.values()) >= 9  # type: ignore[call-overload]
    page = HTTP.get(f"{shared.url}/v1/dashboard", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert {r["name"] for r in page["reducers"]} == set(known)
    samples = scrape(shared, TOKEN)
    assert samples["weightsync_reducers", ()] == 3
    for name, r in known.items():
        assert samples["weightsync_reducer_leases_total", (("reducer", name),)] == r["leases"]
        assert samples["weightsync_reducer_lease_seconds_total", (("reducer", name),)] == pytest.approx(r["seconds"])
    shown = subprocess.run(
        [sys.executable, "-m", "syncserver", "status", shared.url, "--token", TOKEN],
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "reducers" in shown.stdout and all(name in shown.stdout for name in known), shown.stdout + shown.stderr
    pids = [int(name.rsplit("-", 1)[1]) for name in known]
    os.kill(pids[0], signal.SIGKILL)  # a local reducer dies: the hub starts another
    wait_for(lambda: set(_pids(shared)) - set(pids), "a reducer started in place of the killed one", timeout=60)
    pids = [pid for pid in _pids(shared) if _alive(pid)]
    assert len(pids) == 3
    shared.kill()  # SIGKILL: the kernel takes the reducers with it
    wait_for(lambda: not any(_alive(pid) for pid in pids), "the reducers to die with their hub")


def _pids(hub: Hub) -> list[int]:
    return [int(name.rsplit("-", 1)[1]) for name in _reducers(hub)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_reducer_killed_mid_lease_loses_it_and_another_redoes_it(
    hub_factory: Callable[..., Hub], tmp_path: Path
) -> None:
    """A reducer whose report never arrives, then SIGKILLed, holds its lease no more once
    it expires: another reducer (or the hub, while none polls) redoes it, to the same bits; the
    lease's late report is refused (409) and changes nothing."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    alone = hub_factory(env=env)
    expected = _train(alone.url, "barrier", rounds=2)
    # one lease per merge and per fold step: the cut one is the only one of its batch, so the close
    # waits for it to expire (*was*: K = 2, and the close withdrew a fold step whose other lease was
    # still on offer, the doomed one with it, unexpired, when the doomed reducer was killed before
    # taking another lease; it failed so on a loaded machine, before and after the one board)
    hub = hub_factory("--reducers", "1", "--local-reducers", "0", "--reduce-lease-seconds", "1.5", env=env)
    with FaultProxy(hub.port) as proxy:
        proxy.cut(after=0, match="/done")  # its first report dies on the way: the hub never hears it
        doomed = _reducer(proxy.url, ADMIN, tmp_path / "doomed.log")
        wait_for(lambda: len(_reducers(hub)) == 1, "the first reducer to ask for a lease")
        peers = threading.Thread(target=lambda: results.append(_train(hub.url, "barrier", rounds=2)))
        results: list[dict[str, str]] = []
        peers.start()
        wait_for(lambda: any(r.fault == "cut" for r in proxy.matching("/done")), "a lease's report to be cut")
        # dead before its lease expires: alive, it could take that lease again once it is offered
        # (*was*: killed only once the rescuer had started, which a loaded machine can make slower
        # than the 1.5 s lease: the doomed one could take the lease again and the rest of the run,
        # and the rescuer none; it failed so twice on a loaded machine)
        doomed.kill()
        doomed.wait()
        rescuer = _reducer(hub.url, ADMIN, tmp_path / "rescuer.log")
        wait_for(lambda: f"{_host()}-{rescuer.pid}" in _reducers(hub), "the second reducer to ask for a lease")
        late = next(r for r in proxy.matching("/done") if r.fault == "cut")
        try:
            peers.join(120)
            assert results == [expected]
        finally:
            rescuer.kill()
            rescuer.wait()
    known = _reducers(hub)
    assert int(known[f"{_host()}-{doomed.pid}"]["expired"]) >= 1  # type: ignore[call-overload]
    # redone by the rescuer, or by the hub itself if the rescuer was not polling yet for a lease
    # length (a loaded machine can start a process that slowly): never by the dead one
    redone = int(known[f"{_host()}-{rescuer.pid}"]["leases"]) >= 1  # type: ignore[call-overload]
    assert redone or "work_lease_worked_by_hub" in hub.log(), hub.log()[-3000:]
    assert "work_lease_expired" in hub.log()
    report = {"reducer": f"{_host()}-{doomed.pid}", "seconds": 0.1, "bytes": 1}
    r = HTTP.post(f"{hub.url}{late.target}", json=report, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 409 and r.json()["error"] == "lease_lost", r.text
    assert _train_digest(hub) == expected["model"]  # nothing changed


def test_with_no_reducer_left_the_hub_works_the_leases_itself(hub_factory: Callable[..., Hub]) -> None:
    """`--local-reducers 0` and no `syncserver reduce`: after a lease length with nobody asking,
    the hub works each lease itself (the same function, the same files): same bits."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    expected = _train(hub_factory(env=env).url, "barrier", rounds=2)
    hub = hub_factory("--reducers", "2", "--local-reducers", "0", "--reduce-lease-seconds", "0.5", env=env)
    assert _train(hub.url, "barrier", rounds=2) == expected
    assert "work_lease_worked_by_hub kind=merge" in hub.log()
    assert int(_reducers(hub)["hub"]["leases"]) >= 2  # type: ignore[call-overload]


def test_reducers_merge_updates_that_peers_uploaded_to_the_bucket(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS
) -> None:
    """With SYNC_STORE the peers' updates go to the bucket; `--store ... --reducers 2`: the local
    reducers read them there (the store from serve, the credentials from the environment), fold
    the updates ahead as they are acknowledged into a mean held in their memory, and close every
    round to the bits of a hub without a store merging alone; no mean goes to the bucket."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    options, names = FP32_IN_ORDER, ("a", "b", "c")
    expected = _train_in_order(hub_factory(env=env).url, "barrier", options, 2, names)
    stored = hub_factory(
        "--store", f"s3://{seaweedfs.bucket}/reducers", "--reducers", "2", env={**env, **seaweedfs.env()}
    )
    assert _train_in_order(stored.url, "barrier", options, 2, names) == expected
    assert "work_lease_taken kind=fold" in stored.log()  # a, then b (unless c's close came before a reducer took it)
    assert not [o for o in seaweedfs.store("reducers/").list("runs/barrier/") if "/partials/" in o.name]
    samples = scrape(stored, TOKEN)
    assert samples["weightsync_upload_bytes_total", (("run", "barrier"), ("via", "store"))] > 0
    assert samples.get(("weightsync_upload_bytes_total", (("run", "barrier"), ("via", "hub"))), 0) == 0
    assert sum(int(r["leases"]) for r in _reducers(stored).values()) >= 2  # type: ignore[call-overload]


def _host() -> str:
    return socket.gethostname()


def _train_digest(hub: Hub) -> str:
    r = HTTP.get(f"{hub.url}/v1/runs/barrier/model", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    return hashlib.sha256(r.content).hexdigest()


def test_a_hub_told_to_stop_answers_a_waiting_lease_poll_at_once(hub_factory: Callable[..., Hub]) -> None:
    """SIGTERM while a reducer long-polls for a lease (60 s here): the poll gets its 204 (no lease)
    and the hub exits without waiting it out (``Board.end_polls``); the reducers' 5 s polls held
    every `serve --reducers K` hub's stop before (uvicorn lets the requests in flight end first)."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    hub = hub_factory("--reducers", "1", "--local-reducers", "0", env=env)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with ThreadPoolExecutor(1) as pool:
        poll = pool.submit(
            httpx.post, f"{hub.url}/v1/reduce/lease", json={"reducer": "r", "wait": 60}, headers=admin, timeout=120
        )
        wait_for(lambda: "r" in _reducers(hub), "the reducer's poll to reach the hub")
        assert hub.server.proc is not None
        started = time.monotonic()
        hub.server.proc.terminate()
        assert poll.result().status_code == 204
        hub.server.proc.wait(60)
        assert time.monotonic() - started < 30, "the hub waited out the poll"


def test_bad_reducer_requests_get_a_json_reason_and_bad_hubs_a_one_line_error(
    hub_factory: Callable[..., Hub], tmp_path: Path
) -> None:
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    hub = hub_factory("--reducers", "1", "--local-reducers", "0", env=env)
    alone = hub_factory(env={"SYNC_TOKEN": TOKEN})
    admin = {"Authorization": f"Bearer {ADMIN}"}
    lease = f"{hub.url}/v1/reduce/lease"
    some = "0" * 32
    done, ok = f"{hub.url}/v1/reduce/leases/{some}/done", {"reducer": "r", "seconds": 1, "bytes": 1}
    for url, body, headers, status, code in [
        (lease, {"reducer": "r"}, {}, 401, "unauthorized"),
        (lease, {"reducer": "r"}, {"Authorization": f"Bearer {TOKEN}"}, 401, "unauthorized"),  # admin only
        (lease, {"reducer": "r", "wait": -1}, admin, 422, "invalid_request"),
        (lease, {"reducer": "no spaces"}, admin, 422, "invalid_request"),
        (lease, {"wait": 0}, admin, 422, "invalid_request"),
        (f"{hub.url}/v1/reduce/leases/{some}/renew", {"reducer": "r"}, admin, 404, "not_found"),
        (f"{hub.url}/v1/reduce/leases/xyz/renew", {"reducer": "r"}, admin, 422, "invalid_request"),
        (done, ok, admin, 404, "not_found"),
        (done, {**ok, "seconds": -1}, admin, 422, None),
        (done, {**ok, "error": "oops"}, admin, 422, None),
        (done, {**ok, "extra": 1}, admin, 422, None),
        (f"{alone.url}/v1/reduce/lease", {"reducer": "r"}, {"Authorization": f"Bearer {TOKEN}"}, 409, "conflict"),
    ]:
        r = HTTP.post(url, json=body, headers=headers)
        assert r.status_code == status, (url, body, r.text)
        assert r.json()["error"] == (code or "invalid_request") and r.json()["detail"], r.text
    r = HTTP.post(lease, json={"reducer": "r", "wait": 0}, headers=admin)
    assert r.status_code == 204  # nothing to merge yet
    env_ = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    clis = [
        (
            said,
            subprocess.Popen(
                [sys.executable, "-m", "syncserver", "reduce", "--hub", url, "--token", token],
                env=env_,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for url, token, said in [
            ("http://127.0.0.1:9", ADMIN, "cannot reach the hub"),
            (hub.url, "wrong", "401"),
            (alone.url, TOKEN, "merges in its own threads"),
        ]
    ]
    for said, proc in clis:  # at once: each is a Python start-up
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, (said, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and said in lines[0], err


def test_a_hub_killed_mid_fold_loses_no_acknowledged_update_and_gives_the_same_bits(
    hub_factory: Callable[..., Hub], tmp_path: Path
) -> None:
    """Four peers one after the other, no reducer yet: the first updates' fold ahead waits on the
    board; the hub is SIGKILLed once two are acknowledged, restarted, a reducer comes, and the
    round closes with all four updates, folded again from the records, to the bits of a hub
    merging alone."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    options, names = FP32_IN_ORDER, ("a", "b", "c", "d")
    expected = _train_in_order(hub_factory(env=env).url, "barrier", options, 1, names)
    hub = hub_factory("--reducers", "2", "--local-reducers", "0", env=env)
    results: list[dict[str, str]] = []
    peers = threading.Thread(target=lambda: results.append(_train_in_order(hub.url, "barrier", options, 1, names)))
    peers.start()

    def two_acked() -> bool:
        state = HTTP.get(f"{hub.url}/v1/runs/barrier", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        return len((state.get("open_round") or {}).get("submitted", [])) >= 2  # null before the start

    wait_for(two_acked, "two updates acknowledged, their fold waiting on the board")
    _restart_then_a_reducer(hub, tmp_path, peers, results, expected)


def test_a_hub_killed_while_its_leases_wait_closes_the_round_again_after_a_restart(
    hub_factory: Callable[..., Hub], tmp_path: Path
) -> None:
    """No reducer connected: the round's leases wait on the board with its outputs staged; the
    hub is SIGKILLed then restarted, a reducer comes, and the round closes from the acknowledged
    updates to the bits of a hub merging alone (the staged files of the killed hub are gone)."""
    env = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
    expected = _train(hub_factory(env=env).url, "barrier", rounds=2)
    hub = hub_factory("--reducers", "2", "--local-reducers", "0", env=env)
    results: list[dict[str, str]] = []
    peers = threading.Thread(target=lambda: results.append(_train(hub.url, "barrier", rounds=2)))
    peers.start()
    staged = hub.data_dir / "runs" / "barrier" / "rounds" / "00000000"
    wait_for(lambda: list(staged.glob(".result.safetensors.*.tmp")), "round 0's result to be staged for leases")
    _restart_then_a_reducer(hub, tmp_path, peers, results, expected)
    assert not list(staged.glob("*.tmp"))


def _restart_then_a_reducer(
    hub: Hub, tmp_path: Path, peers: threading.Thread, results: list[dict[str, str]], expected: dict[str, str]
) -> None:
    """SIGKILL the hub, restart it on its data, start a reducer: the peers (riding through on
    their retries) end on ``expected``, the bits of a hub merging alone."""
    hub.kill()
    hub.start()
    reducer = _reducer(hub.url, ADMIN, tmp_path / "reducer.log")
    try:
        peers.join(120)
        assert results == [expected]
    finally:
        reducer.kill()
        reducer.wait()


def test_a_process_keeps_only_the_means_its_leases_still_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice of a mean is taken once (then the lease folds into it); a lease that starts on a
    mean drops the run's other means (superseded) but not other runs' in use, and any mean no
    lease started on for MEAN_IDLE_SECONDS."""
    means = Means()
    for run, mean in (("r", "old"), ("r", "new"), ("s", "other")):
        means.put(run, mean, "w", 0, np.ones(4, np.float32))
    means.start("s", ["other"])
    taken = means.take("new", "w", 0)
    assert taken is not None and means.take("new", "w", 0) is None  # taken once
    means.put("r", "new", "w", 0, taken)
    means.start("r", ["new"])
    assert not means.has("old", "w", 0) and means.has("new", "w", 0) and means.has("other", "w", 0)
    assert means.nbytes() == 32
    monkeypatch.setattr(syncserver.reduce.lease, "MEAN_IDLE_SECONDS", -1.0)
    means.start("r", ["new"])  # "other" was last started on before now: idle
    assert not means.has("other", "w", 0) and means.has("new", "w", 0)
