"""A preempted peer hands in its work and leaves (issue 47; syncclient.preemption).

The clouds' notices come from a fake metadata server on 127.0.0.1 that speaks each provider's
documented format (AWS IMDSv2's token and ``spot/instance-action``, GCP's ``instance/preempted``
with its ``Metadata-Flavor`` header, Azure's scheduled events), refusing a request without the
header the provider requires. SIGTERM is a real one, to a peer process mid-interval.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from syncclient import Preempted, SyncClient
from syncclient.preemption import EXIT_CODE, LEAVE_MARGIN, Notice, Watch
from syncserver.settings import HubSettings
from tests.conftest import REPO, Hub
from tests.harness import round_record, status, wait_for
from tests.models import perturb, tiny_bigram

TOKEN = "imds-token-1"


class FakeMetadata:
    """One cloud's metadata server (``provider``: aws, gcp or azure) on 127.0.0.1; :meth:`preempt`
    posts the notice, ``seconds`` ahead."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.when: datetime.datetime | None = None
        self.requests: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_PUT(self) -> None:
                fake.requests.append(f"PUT {self.path}")
                if fake.provider == "aws" and self.path == "/latest/api/token":
                    if self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                        return self._answer(200, TOKEN)
                    return self._answer(400, "missing ttl")
                self._answer(404, "")

            def do_GET(self) -> None:
                fake.requests.append(f"GET {self.path}")
                when = fake.when
                if fake.provider == "aws" and self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                        return self._answer(401, "")
                    if when is None:
                        return self._answer(404, "Not Found")
                    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
                    return self._answer(200, json.dumps({"action": "terminate", "time": stamp}))
                if fake.provider == "gcp" and self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._answer(403, "Missing Metadata-Flavor:Google header.")
                    return self._answer(200, "FALSE" if when is None else "TRUE", {"Metadata-Flavor": "Google"})
                if fake.provider == "azure" and self.path.startswith("/metadata/scheduledevents?api-version="):
                    if self.headers.get("Metadata") != "true":
                        return self._answer(400, json.dumps({"error": "Bad request. Required metadata header"}))
                    events = [] if when is None else [_azure_event(when)]
                    return self._answer(200, json.dumps({"DocumentIncarnation": 1, "Events": events}))
                self._answer(404, "")

            def _answer(self, code: int, body: str, headers: dict[str, str] | None = None) -> None:
                data = body.encode()
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def preempt(self, seconds: float) -> None:
        self.when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _azure_event(when: datetime.datetime) -> dict[str, Any]:
    return {
        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": ["spot-vm-1"],
        "EventStatus": "Scheduled",
        "NotBefore": email.utils.format_datetime(when, usegmt=True),
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


@pytest.fixture
def metadata() -> Iterator[Callable[[str], FakeMetadata]]:
    made: list[FakeMetadata] = []

    def make(provider: str) -> FakeMetadata:
        made.append(FakeMetadata(provider))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def _closed_port() -> str:
    """A URL on 127.0.0.1 where nothing listens (a machine with no metadata server)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()
    return url


# ---- each provider's notice ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("provider", "mode", "ahead"), [("aws", "aws", 120), ("gcp", "auto", 30), ("azure", "auto", 45)]
)
def test_each_providers_notice_is_heard_with_its_time(
    metadata: Callable[[str], FakeMetadata], provider: str, mode: str, ahead: float
) -> None:
    """The watch finds the provider (``auto`` asks each), hears nothing while there is no notice,
    then the notice with the time the provider gives (GCP gives none: 30 s)."""
    fake = metadata(provider)
    watch = Watch(mode, leave=lambda: None, metadata_url=fake.url)
    try:
        wait_for(lambda: watch.watching == provider, f"the watch finds {provider}", 10)
        looked = len(fake.requests)
        wait_for(lambda: len(fake.requests) > looked, "a look for a notice", 10)
        assert watch.notice is None
        fake.preempt(ahead)
        wait_for(lambda: watch.notice is not None, "the notice", 10)
        assert watch.notice is not None and watch.notice.source == provider
        assert ahead - 5 < watch.notice.left() <= ahead + 1
    finally:
        watch.stop()


def test_no_metadata_server_leaves_sigterm_alone(caplog: pytest.LogCaptureFixture) -> None:
    """``auto`` with no metadata server is quiet; a provider asked for by name says it is not there."""
    url = _closed_port()
    with caplog.at_level(logging.INFO, logger="syncclient.preemption"):
        quiet, named = Watch("auto", lambda: None, url), Watch("gcp", lambda: None, url)
        try:
            wait_for(lambda: "no gcp metadata server answers" in caplog.text, "the named provider's line", 10)
            assert quiet.watching is None and named.watching is None
            assert "no auto" not in caplog.text
        finally:
            quiet.stop()
            named.stop()


def test_a_notice_nobody_claims_leaves_for_the_peer() -> None:
    """The training thread never steps (a long evaluation): the watch leaves just before the notice runs out."""
    left = threading.Event()
    watch = Watch("sigterm", left.set)
    try:
        watch.heard(Notice("aws", time.monotonic() + LEAVE_MARGIN + 0.2, "test"))
        assert left.wait(10)
        assert watch.abandoned and watch.claim() is None
    finally:
        watch.stop()


def test_bad_preemption_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preemption must be one of auto, aws, gcp, azure, sigterm, off"):
        SyncClient("http://127.0.0.1:9", run="r", sync_every=5, preemption="spot")
    with pytest.raises(ValueError, match="the metadata server must be an http:// URL"):
        SyncClient("http://127.0.0.1:9", run="r", sync_every=5, metadata_url="169.254.169.254")
    for flags, said in [
        (["--preemption", "spot"], "--preemption: preemption must be one of"),
        (["--metadata-url", "169.254.169.254"], "--metadata-url: the metadata server must be an http:// URL"),
    ]:
        cmd = [sys.executable, "-m", "weightsync_run", "--hub", "http://127.0.0.1:9", "--run", "r", *flags, "--", "x"]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert done.returncode == 2, done.stderr
        assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


# ---- a peer process, preempted mid-interval ------------------------------------------------------


def _peer(hub: Hub, run: str, name: str, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(REPO / "tests" / "stepping_proc.py"), "--hub", hub.url, "--run", run]
    cmd += ["--peer", name, "--sync-every", "100000", "--out", str(out), *extra]
    return subprocess.Popen(cmd, stderr=open(out / f"{name}.log", "wb"))


def _steps(out: Path, name: str) -> int:
    path = out / f"{name}.steps"
    return len(path.read_text().split()) if path.exists() else 0


@pytest.mark.parametrize("how", ["sigterm", "aws"])
def test_a_preempted_peer_hands_in_and_the_round_closes_without_it(
    hub_factory: Callable[..., Hub], metadata: Callable[[str], FakeMetadata], tmp_path: Path, how: str
) -> None:
    """Peer b (a process) trains round 0 and is preempted mid-interval, by SIGTERM or an AWS notice:
    it hands in its steps as its update of round 0 (acknowledged, with all its samples), leaves and
    exits 143. Peer a syncs later: round 0 closes with both updates at once (nobody waits for b),
    and round 1 with a alone."""
    hub = hub_factory("--min-peers", "2")
    run, out = f"preempt-{how}", tmp_path / "peers"
    out.mkdir()
    extra = ["--preemption", "sigterm"]
    if how == "aws":
        fake = metadata("aws")
        extra = ["--preemption", "aws", "--metadata-url", fake.url]
    proc = _peer(hub, run, "b", out, *extra)
    with contextlib.ExitStack() as stack:
        stack.callback(proc.kill)  # (a no-op once it exited)
        a = SyncClient(hub.url, run=run, peer="a", sync_every=1000, preemption="off", timeout=10)
        stack.callback(a.close)
        model = tiny_bigram(0)
        a.join(model)
        wait_for(lambda: _steps(out, "b") >= 5, "b trains", 60)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            wait_for(lambda: any("instance-action" in r for r in fake.requests), "b watches AWS", 30)
            fake.preempt(120)
        assert proc.wait(60) == EXIT_CODE, (out / "b.log").read_text()
        end = json.loads((out / "b.end").read_text())
        assert end["source"] == how and end["round"] == 0 and end["handed_in"] == 4 * end["step"]
        assert "preempted (" in (out / "b.log").read_text()
        peers = {p["peer"]: p for p in status(hub, run)["peers"]}
        assert peers["b"]["state"] == "left"
        perturb(model, seed=1, round_=0)
        result = a.sync(model, samples=10)
        assert result.version == 1 and not result.caught_up
        record = round_record(hub, run, 0)
        assert sorted(record["participants"]) == ["a", "b"] and record["dropped"] == []
        assert record["samples"] == 10 + end["handed_in"]  # all of b's steps: none lost
        perturb(model, seed=1, round_=1)
        assert a.sync(model, samples=10).version == 2  # round 1: a alone, nobody waited for
        assert round_record(hub, run, 1)["participants"] == ["a"]


def test_a_peer_that_never_steps_again_is_left_for_and_ends_at_its_next_step(
    hub_factory: Callable[..., Hub], tmp_path: Path
) -> None:
    """SIGTERM-like notice in-process, with the grace nearly over and no step: the watch tells the
    hub the peer left; its next step ends the program with nothing handed in."""
    hub = hub_factory("--min-peers", "1")
    client = SyncClient(hub.url, run="never-steps", peer="p", sync_every=100, preemption="sigterm", timeout=10)
    model = tiny_bigram(0)
    client.join(model)
    client.count_from(0)
    client.progress(4)
    assert client._watch is not None
    client._watch.heard(Notice("sigterm", time.monotonic() + LEAVE_MARGIN + 0.3, "SIGTERM"))
    wait_for(lambda: status(hub, "never-steps")["peers"][0]["state"] == "left", "the hub hears p left", 20)
    with pytest.raises(Preempted) as ended:
        client.progress(4)
    assert ended.value.handed_in == 0 and ended.value.code == EXIT_CODE
    assert client.closed
    assert HubSettings().lease_seconds > LEAVE_MARGIN  # (the watch's leave beats the lease)


def test_an_overlapped_sync_in_flight_is_applied_before_the_hand_in(
    hub_factory: Callable[..., Hub],
) -> None:
    """a's overlapped sync of round 0 is in flight when the notice comes: a's next step waits for
    round 0's result (b's sync closes it), applies it, and hands in the steps since the snapshot
    as its update of round 1, which b's next sync closes with both."""
    hub = hub_factory("--min-peers", "2")
    run = "preempt-overlap"
    a = SyncClient(hub.url, run=run, peer="a", sync_every=1000, preemption="sigterm", timeout=10)
    b = SyncClient(hub.url, run=run, peer="b", sync_every=1000, preemption="off", timeout=10)
    ma, mb = tiny_bigram(0), tiny_bigram(0)
    try:
        joining = threading.Thread(target=b.join, args=(mb,))
        joining.start()
        a.join(ma)
        joining.join(30)
        a.count_from(0)
        perturb(ma, seed=1, round_=0)
        a.progress(4)
        pending = a.sync_async(ma, samples=4)
        perturb(ma, seed=1, round_=1)  # trained while round 0 is in flight
        assert a._watch is not None
        a._watch.heard(Notice("sigterm", time.monotonic() + 30, "SIGTERM"))
        closing = threading.Thread(target=lambda: (perturb(mb, seed=2, round_=0), b.sync(mb, samples=6)))
        closing.start()
        with pytest.raises(Preempted) as ended:
            a.progress(4)
        closing.join(30)
        assert pending.done() and ended.value.round == 1 and ended.value.handed_in == 4
        perturb(mb, seed=2, round_=1)
        assert b.sync(mb, samples=6).version == 2
        record = round_record(hub, run, 1)
        assert sorted(record["participants"]) == ["a", "b"] and record["samples"] == 10
    finally:
        a.close()
        b.close()


FOREVER = """
import sys, time, torch

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
steps = 0
while True:
    optimizer.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    steps += 1
    with open(sys.argv[1], "w") as f:
        f.write(str(steps))
    time.sleep(0.01)
"""


def test_a_zero_code_peer_hands_in_on_sigterm(hub_factory: Callable[..., Hub], tmp_path: Path) -> None:
    """``weightsync-run --preemption sigterm -- python loop.py`` (a loop that never ends), SIGTERM
    mid-interval: the program ends with 143 and one line; round 0 holds every step it took."""
    hub = hub_factory()
    (tmp_path / "loop.py").write_text(FOREVER)
    steps = tmp_path / "steps"
    cmd = [sys.executable, "-m", "weightsync_run", "--hub", hub.url, "--run", "zc", "--sync-every", "100000"]
    cmd += ["--preemption", "sigterm", "--", sys.executable, "loop.py", str(steps)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "WEIGHTSYNC_"))}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: steps.exists() and int(steps.read_text() or 0) >= 5, "the loop steps", 60)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_CODE, err
    assert "preempted (sigterm: SIGTERM): handed in" in err and "Traceback" not in err, err
    wait_for(lambda: any(r["round"] == 0 for r in status(hub, "zc")["rounds"]), "round 0 closes", 30)
    assert round_record(hub, "zc", 0)["samples"] >= int(steps.read_text())  # one sample a step: no DataLoader


HELD = """
import os, signal, sys, time
from syncclient.preemption import Watch

left = []
watch = Watch("sigterm", lambda: left.append(1))
os.kill(os.getpid(), signal.SIGTERM)  # the notice: held, the process goes on
while watch.notice is None:
    time.sleep(0.01)
print("held", flush=True)
watch._too_late()  # what the watch's timer does just before the 30 s run out, nobody having stepped
print("still here", flush=True)
"""


def test_a_held_sigterm_ends_the_process_once_the_watch_left_for_it(tmp_path: Path) -> None:
    """A program that never steps (nothing calls progress): the SIGTERM the watch held ends it after
    all, once the watch left the run for it, as SIGTERM would without weightsync."""
    (tmp_path / "held.py").write_text(HELD)
    done = subprocess.run([sys.executable, "held.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and done.stdout == "held\n", (done.stdout, done.stderr)
