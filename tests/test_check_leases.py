"""The body check of an update uploaded to the bucket as a lease (SYNC_STORE + SYNC_REDUCERS):
reducers stream and check the bodies, the hub reads none; a lie gets the answer it gets from a
hub that checks alone; a reducer killed holding a check lease costs that lease, not the upload.
Real hub and reducer processes, the session's SeaweedFS (tests/test_store_uploads.py's setup)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from syncserver.core.leases import CHECK_TRIES, Board
from syncserver.errors import LeaseLost, NotFound
from syncserver.reduce.check import UpdateRules
from syncserver.reduce.checklease import CheckJob, CheckReport, CheckRules, accept
from syncserver.reduce.lease import Done
from syncwire import get_codec, wire_layout
from tests.conftest import Hub
from tests.faultproxy import FaultProxy
from tests.harness import HTTP, Peers, wait_for
from tests.s3server import SeaweedFS
from tests.test_metrics import scrape
from tests.test_reducers import ADMIN, _host, _reducers, _train
from tests.test_store_uploads import body, linear, presign, put_parts, uploaded
from tests.test_store_wire import TOKEN, metric

ENV = {"SYNC_TOKEN": TOKEN, "SYNC_ADMIN_TOKEN": ADMIN}
READ = "weightsync_store_read_bytes_total"


def _job(norm: bool = True, size: int = 100) -> CheckJob:
    codec = get_codec("int8")
    schema = {"w": (3, 4)}
    rules = UpdateRules(wire_layout(codec, schema), schema, codec, 1000, norm)
    job = CheckJob(
        lease="",
        run="r",
        round=0,
        peer="p",
        seconds=1,
        object="o",
        size=size,
        digest="0" * 64,
        rules=CheckRules.of(rules),
    )
    assert job.rules.rules() == rules  # JSON there and back gives the run's rules
    return CheckJob.model_validate_json(job.model_dump_json())


def test_the_hub_takes_from_a_report_only_what_holds_up() -> None:
    """Only a pass that holds up is taken. A refusal is never taken on a reducer's word (the hub
    checks the body itself: no reducer alone turns an update away); nor is a report whose size is
    not the object's, whose norm is missing, extra or not finite, nor a failure."""
    job = _job()

    def report(**outcome: Any) -> CheckReport:
        return CheckReport.model_validate({"reducer": "x", "seconds": 0.1} | outcome)

    taken = accept(report(digest="a" * 64, nbytes=100, norm=2.5), job)
    assert taken is not None and (taken.digest, taken.nbytes, taken.norm) == ("a" * 64, 100, 2.5)
    untrue = [
        report(refused={"status": 400, "error": "bad_request", "detail": "the reason"}),
        report(refused={"status": 422, "error": "invalid_update", "detail": "the reason"}),
        report(digest="a" * 64, nbytes=99, norm=2.5),  # not the object's size
        report(digest="a" * 64, nbytes=100),  # the rules ask for a norm
        report(digest="a" * 64, nbytes=100, norm=math.inf),
        report(digest="a" * 64, nbytes=100, norm=-1.0),
        report(refused={"status": 500, "error": "internal", "detail": "no check gives this"}),
        report(refused={"status": 400, "error": "invalid_update", "detail": "the wrong status"}),
        report(failed="the store was down"),
    ]
    assert [accept(r, job) for r in untrue] == [None] * len(untrue)
    assert accept(report(digest="a" * 64, nbytes=100, norm=1.0), _job(norm=False)) is None
    with pytest.raises(ValueError, match="one thing"):
        report(digest="a" * 64, nbytes=100, failed="both")


def test_the_board_offers_a_check_again_then_gives_it_back_to_the_hub() -> None:
    """In-process board: a check taken and not renewed is offered again under a new id, and the
    late report is refused (409); lost CHECK_TRIES times, or with no reducer alive, the board
    answers None (the hub checks the body itself); a report answers the waiting upload."""

    async def scenario() -> None:
        board = Board(lease_seconds=0.2)
        board._active -= 10  # no reducer heard from: the hub checks at once
        assert await board.check(_job()) is None
        waiting = asyncio.create_task(board.check(_job()))  # a reducer is polling: it waits
        taken = await board.take("r1", wait=5)
        await asyncio.sleep(0)
        ids = []
        for _ in range(CHECK_TRIES):  # taken, never reported, expired: offered again
            assert isinstance(taken, CheckJob) and taken.lease not in ids
            ids.append(taken.lease)
            if len(ids) < CHECK_TRIES:
                taken = await board.take("r1", wait=5)
        assert await asyncio.wait_for(waiting, 10) is None  # lost 3 times: the hub's
        late = CheckReport(reducer="r1", seconds=0.1, failed="late")
        with pytest.raises(LeaseLost):
            board.checked(ids[0], late)
        with pytest.raises(NotFound):
            board.checked("f" * 32, late)
        answered = asyncio.create_task(board.check(_job()))
        taken = await board.take("r2", wait=5)
        assert isinstance(taken, CheckJob)
        assert board.renew(taken.lease, "r2") == 0.2
        with pytest.raises(NotFound):  # a check lease is reported to /checked, not /done
            board.done(taken.lease, Done(reducer="r2", seconds=0.1, bytes=1))
        report = CheckReport(reducer="r2", seconds=0.1, digest="a" * 64, nbytes=100, norm=1.0)
        board.checked(taken.lease, report)
        assert await asyncio.wait_for(answered, 10) == report
        assert board.reducers["r2"].checks == 1 and board.reducers["r1"].expired == CHECK_TRIES
        assert await board.take("r3", wait=0) is None  # nothing left on the board
        with pytest.raises(LeaseLost):  # reported: gone
            board.renew(taken.lease, "r2")

    asyncio.run(scenario())


def _store_hub(hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, prefix: str, *args: str) -> Hub:
    return hub_factory("--store", f"s3://{seaweedfs.bucket}/{prefix}", *args, env={**ENV, **seaweedfs.env()})


def _lies(hub: Hub) -> list[tuple[int, dict[str, Any]]]:
    """Each lie uploaded and reported, as in tests/test_store_uploads.py: the hub's answers."""
    good = body()
    lies: list[tuple[str, bytes, dict[str, Any]]] = [
        ("trailing", good + b"\0" * 4, {}),
        ("digest", good, {"digest": "0" * 64}),
        ("nan", body(bias=np.array([0, np.nan, 0], np.float32)), {}),
        ("inf", body(weight=np.full((3, 4), np.inf, np.float32)), {}),
        ("layout", body(extra=np.zeros(2, np.float32)), {}),
    ]
    answers = []
    for name, data, lie in lies:
        key = f"lie-{name}".ljust(16, "x")
        plan = presign(hub, key, len(data)).json()
        answer = uploaded(hub, key, data, put_parts(plan, data), **lie)
        answers.append((answer.status_code, answer.json()))
    return answers


def test_lies_get_the_same_answers_from_reducers_and_the_hub_reads_no_body(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS
) -> None:
    """Every lie (trailing bytes, digest, NaN, Inf, the wrong tensors) gets the very status, code
    and reason from a hub whose reducer checks the bodies as from a hub that checks them itself,
    and nothing is recorded: the reducer finds each, and the hub, which refuses no peer on a
    reducer's word, checks those bodies itself and agrees (no failure counted). The true update
    is acknowledged on the reducer's pass: the hub reads no byte of it."""
    alone = _store_hub(hub_factory, seaweedfs, "checks-alone")
    shared = _store_hub(hub_factory, seaweedfs, "checks-shared", "--reducers", "1")
    wait_for(lambda: len(_reducers(shared)) == 1, "the local reducer to ask for a lease")
    answers = []
    for hub in (alone, shared):
        peers = Peers(hub.url, "r", ["p", "q"], model=linear, token=TOKEN, min_peers=2)
        peers.join()
        with contextlib.closing(peers):
            answers.append(_lies(hub))
            good = body()
            read = metric(scrape(hub, TOKEN), READ)
            ack = uploaded(
                hub, "the-true-update1", good, put_parts(presign(hub, "the-true-update1", len(good)).json(), good)
            )
            assert ack.status_code == 200 and not ack.json()["repeat"], ack.text
            if hub is shared:
                assert metric(scrape(hub, TOKEN), READ) == read  # the reducer's pass is taken
            state = HTTP.get(f"{hub.url}/v1/runs/r", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            assert len(state["updates"]) == 1, state
    assert answers[0] == answers[1]
    assert [status for status, _ in answers[0]] == [400, 400, 422, 422, 422]
    assert metric(scrape(alone, TOKEN), READ) > 0
    assert shared.log().count("work_lease_taken kind=check") == len(answers[1]) + 1
    (reducer,) = _reducers(shared).values()
    assert reducer["checks"] == len(answers[1]) + 1 and float(reducer["check_seconds"]) > 0  # type: ignore[arg-type]
    assert reducer["check_failures"] == 0 and "check_report_not_taken" not in shared.log()
    samples = scrape(shared, TOKEN)
    assert metric(samples, "weightsync_reducer_checks_total", reducer=str(reducer["name"])) == reducer["checks"]
    for hub in (alone, shared):
        assert " 500 " not in hub.log() and "Traceback" not in hub.log()


def test_a_round_checked_and_merged_by_reducers_is_bit_identical(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS
) -> None:
    """2 peers, `--store --reducers 2`: the reducers check every upload and merge every round, to
    the bits of a hub without a store merging alone; the hub read no byte from the store (it
    names the updates in the leases without opening them)."""
    expected = _train(hub_factory(env=ENV).url, "barrier", rounds=2)
    hub = _store_hub(hub_factory, seaweedfs, "checks-round", "--reducers", "2")
    wait_for(lambda: len(_reducers(hub)) == 2, "the local reducers to ask for leases")
    assert _train(hub.url, "barrier", rounds=2) == expected
    samples = scrape(hub, TOKEN)
    updates = 2 * int(expected["version"])  # 2 peers in every round
    assert metric(samples, READ) == 0
    assert metric(samples, "weightsync_upload_bytes_total", run="barrier", via="store") > 0
    assert hub.log().count("work_lease_taken kind=check") == updates
    assert "work_lease_worked_by_hub" not in hub.log()


def _reducer(url: str, seaweedfs: SeaweedFS, prefix: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    env |= seaweedfs.env() | {"SYNC_STORE": f"s3://{seaweedfs.bucket}/{prefix}", "SYNC_REDUCE_TOKEN": ADMIN}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "syncserver", "reduce", "--hub", url], env=env, stdout=out, stderr=out
        )


def test_a_reducer_killed_holding_a_check_lease_loses_it_and_the_peer_is_acknowledged(
    hub_factory: Callable[..., Hub], seaweedfs: SeaweedFS, tmp_path: Path
) -> None:
    """The only reducer checks a body, its report is cut on the way and it is SIGKILLed: the
    lease expires and is offered again, a new reducer checks the body, and the peer's
    `/uploaded`, waiting all along, gets its acknowledgement; the hub read no body."""
    hub = _store_hub(
        hub_factory, seaweedfs, "checks-kill", "--reducers", "1", "--local-reducers", "0", "--reduce-lease-seconds", "3"
    )
    peers = Peers(hub.url, "r", ["p", "q"], model=linear, token=TOKEN, min_peers=2)
    peers.join()
    with FaultProxy(hub.port) as proxy, contextlib.closing(peers):
        proxy.cut(after=0, match="/checked")
        doomed = _reducer(proxy.url, seaweedfs, "checks-kill", tmp_path / "doomed.log")
        wait_for(lambda: len(_reducers(hub)) == 1, "the first reducer to ask for a lease")
        good = body()
        answers: list[httpx.Response] = []
        etags = put_parts(presign(hub, "the-true-update1", len(good)).json(), good)
        upload = threading.Thread(target=lambda: answers.append(uploaded(hub, "the-true-update1", good, etags)))
        upload.start()
        wait_for(lambda: any(r.fault == "cut" for r in proxy.matching("/checked")), "the check's report to be cut")
        # started before the kill: with no reducer heard from lately, the hub would check the body itself
        rescuer = _reducer(hub.url, seaweedfs, "checks-kill", tmp_path / "rescuer.log")
        doomed.kill()
        doomed.wait()
        try:
            wait_for(lambda: f"{_host()}-{rescuer.pid}" in _reducers(hub), "the rescuer to ask for a lease")
            upload.join(120)
            assert len(answers) == 1 and answers[0].status_code == 200, answers[0].text
            assert not answers[0].json()["repeat"]
        finally:
            rescuer.kill()
            rescuer.wait()
    log = hub.log()
    assert "work_lease_expired kind=check" in log and f"reducer={_host()}-{rescuer.pid}" in log
    assert metric(scrape(hub, TOKEN), READ) == 0
    # one attempt, one object: the one the record names, holding the bytes checked
    with seaweedfs.store("checks-kill") as bucket:
        (name,) = [info.name for info in bucket.list("runs/r/updates/")]
        assert re.fullmatch(r"runs/r/updates/00000000/p/the-true-update1\.[0-9a-f]{16}\.safetensors", name)
        assert bytes(bucket.read(name)) == good
