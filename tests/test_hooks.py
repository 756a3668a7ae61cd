"""The parts of weightsync-run's hooks that decide alone: which model an optimizer trains, each
peer's share of the data, the settings and their one-line errors, the post-import hooks, the
launcher's path rewriting. In this process where nothing is patched; in a fresh one where
something would be (tests/test_zero_code.py runs the whole thing)."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from syncclient import SyncClient
from syncclient.hooks import SITE, plain
from syncclient.hooks.model import AmbiguousModel, find_model
from syncclient.hooks.plain import PlainLoop
from syncclient.hooks.settings import DEFAULT_SYNC_EVERY, HookSettings, SettingsError
from syncclient.hooks.shard import ShardSampler
from syncclient.peerlr import DEFAULT_PEER_LR, PeerLR
from syncclient.schedule import SyncSchedule
from syncwire.runsettings import RUN_SETTINGS
from tests.conftest import Hub
from weightsync_run import cli as launcher
from weightsync_run.cli import build_parser, main

# -- which model ------------------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        self.norm = torch.nn.BatchNorm1d(4)


class Wrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_the_model_is_the_root_that_owns_the_parameters() -> None:
    net = Net()
    assert find_model(net.parameters()) is net
    assert find_model(net.head.parameters()) is net  # the head's optimizer: the whole model is synced


def test_a_wrapper_is_the_root() -> None:
    net = Net()
    wrapped = Wrapper(net)  # as torch.compile and DDP do: the SDK unwraps it
    assert find_model(net.parameters()) is wrapped


def test_one_model_inside_two_wrappers_is_that_model() -> None:
    net = Net()
    first, second = Wrapper(net), Wrapper(net)
    assert find_model(net.parameters()) is net
    del first, second


def test_two_models_are_refused() -> None:
    a, b = Net(), torch.nn.Linear(2, 2)
    with pytest.raises(AmbiguousModel, match=r"2 models that share no root module \((Net, Linear|Linear, Net)\)"):
        find_model([*a.parameters(), *b.parameters()])


def test_tensors_of_no_module_are_refused() -> None:
    net, loose = Net(), torch.zeros(3, requires_grad=True)
    with pytest.raises(AmbiguousModel, match=r"^1 of the optimizer's 7 tensors belong to no torch.nn.Module"):
        find_model([*net.parameters(), loose])
    with pytest.raises(AmbiguousModel, match=r"^1 of the optimizer's 1 tensors"):
        find_model([loose])


def test_a_dropped_wrapper_is_not_the_model() -> None:
    net = Net()
    wrapper = Wrapper(net)
    wrapper.cycle = [wrapper]  # type: ignore[assignment]  # only the garbage collector frees it
    del wrapper
    assert find_model(net.parameters()) is net


# -- each peer's share -------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_shares_are_disjoint_equal_and_follow_the_inner_order(world: int) -> None:
    n = 10
    shares = [list(ShardSampler(torch.utils.data.SequentialSampler(range(n)), n, rank, world)) for rank in range(world)]
    assert all(len(s) == n // world for s in shares)
    assert sorted(i for s in shares for i in s) == list(range(n // world * world))
    assert shares[1] == list(range(1, n // world * world, world))
    gen = torch.Generator().manual_seed(0)
    shuffled = ShardSampler(torch.utils.data.RandomSampler(range(n), generator=gen), n, 0, world)
    first, second = list(shuffled), list(shuffled)
    assert sorted(first) == sorted(second) == shares[0] and len(shuffled) == n // world


# -- settings ------------------------------------------------------------------------------------------


def test_settings_round_trip_through_variables() -> None:
    settings = HookSettings.resolve({"hub": "http://hub:8000/", "run": "r", "round_samples": "64", "shard": "0"}, {})
    assert (settings.hub, settings.sync_every, settings.config, settings.shard) == (
        "http://hub:8000",
        None,
        {"round_samples": 64},
        False,
    )
    assert HookSettings.from_env(settings.to_env()) == settings
    assert HookSettings.resolve({"hub": "http://h:1", "run": "r"}, {}).sync_every == DEFAULT_SYNC_EVERY
    default = HookSettings.resolve({"hub": "http://h:1", "run": "r"}, {})
    assert default.peer_lr == PeerLR(DEFAULT_PEER_LR.scaling, DEFAULT_SYNC_EVERY)  # warm-up: one round
    scaled = HookSettings.resolve({"hub": "http://h:1", "run": "r"}, {"WEIGHTSYNC_LR_SCALING": "linear"})
    assert (scaled.lr_scaling, scaled.lr_scaling_warmup) == ("linear", None)
    assert HookSettings.from_env(scaled.to_env()) == scaled
    scaled = HookSettings.resolve(
        {"hub": "http://h:1", "run": "r", "lr_scaling_warmup": "7"}, {"WEIGHTSYNC_LR_SCALING_WARMUP": "3"}
    )
    assert scaled.peer_lr == PeerLR(DEFAULT_PEER_LR.scaling, 7)  # the flag beats its variable
    assert HookSettings.from_env(scaled.to_env()) == scaled
    assert scaled.callback_kwargs()["lr_scaling_warmup"] == 7
    machine = {"WEIGHTSYNC_PREEMPTION": "gcp", "WEIGHTSYNC_METADATA_URL": "http://127.0.0.1:9"}
    notices = HookSettings.resolve({"hub": "http://h:1", "run": "r", "preemption": "aws"}, machine)
    assert (notices.preemption, notices.metadata_url) == ("aws", "http://127.0.0.1:9")  # the flag beats its variable
    assert HookSettings.from_env(notices.to_env()) == notices
    assert notices.client_kwargs()["preemption"] == "aws"


#: every run setting, given as a flag, and what SyncClient is given
EVERY_RUN_SETTING = {
    "min_peers": ("2", 2),
    "min_merge_peers": ("2", 2),
    "policy": ("async", "async"),
    "round_samples": ("64", 64),
    "codec": ("int8:block=64", "int8:block=64"),
    "outer": ("diloco", "diloco"),
    "outer_lr": ("0.5", 0.5),
    "outer_momentum": ("0", 0.0),
    "outer_warmup": ("0", 0),
    "round_timeout": ("30.5", 30.5),
    "norm_guard": ("10", 10.0),
    "max_staleness": ("4", 4),
}
#: the interval's settings, which go with a barrier or samples run (not the async run above)
INTERVAL_SETTINGS = {"utilization": ("0.9", 0.9), "sync_min": ("20", 20), "sync_max": ("400", 400)}


def test_every_run_setting_reaches_the_client_through_a_flag_or_its_variable() -> None:
    assert set(EVERY_RUN_SETTING) | set(INTERVAL_SETTINGS) == {s.name for s in RUN_SETTINGS}
    flags = {name: raw for name, (raw, _) in INTERVAL_SETTINGS.items()}
    auto = HookSettings.resolve({"hub": "http://h:1", "run": "r", "sync_every": "auto", **flags}, {})
    assert auto.client_kwargs() == {"run": "r", "peer": None, "token": None, "sync_every": "auto",
                                    "preemption": None, "metadata_url": None,
                                    **{name: value for name, (_, value) in INTERVAL_SETTINGS.items()}}  # fmt: skip
    assert HookSettings.from_env(auto.to_env()) == auto
    SyncClient("http://h:1", **auto.client_kwargs()).close()
    flags = {name: raw for name, (raw, _) in EVERY_RUN_SETTING.items()}
    settings = HookSettings.resolve({"hub": "http://h:1", "run": "r", "peer": "gpu-1", "sync_every": "5", **flags}, {})
    wanted = {name: value for name, (_, value) in EVERY_RUN_SETTING.items()}
    machine = {"preemption": None, "metadata_url": None}  # the machine's own (syncclient.preemption)
    own = {"run": "r", "peer": "gpu-1", "token": None, "sync_every": 5}
    assert settings.client_kwargs() == {**own, **machine, **wanted}
    assert settings.sync_every == 5  # an async run takes both: when to send, and the size of an outer step
    env = settings.to_env()
    assert env["WEIGHTSYNC_MIN_PEERS"] == "2" and env["WEIGHTSYNC_OUTER_LR"] == "0.5"
    assert HookSettings.from_env(env) == settings
    SyncClient("http://h:1", **settings.client_kwargs()).close()  # every keyword is one SyncClient takes


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"sync_every": "0"}, {}, "--sync-every: must be >= 1, got 0"),
        ({}, {"WEIGHTSYNC_SYNC_EVERY": "often"}, "WEIGHTSYNC_SYNC_EVERY: expected an integer, got 'often'"),
        ({"hub": "hub:8000"}, {}, "--hub: expected an http:// or https:// URL"),
        ({"codec": "zip"}, {}, "--codec: unknown codec 'zip'"),
        ({"round_samples": "8"}, {"WEIGHTSYNC_SYNC_EVERY": "4"}, "WEIGHTSYNC_SYNC_EVERY and --round-samples exclude"),
        ({}, {"WEIGHTSYNC_RANK": "2", "WEIGHTSYNC_WORLD_SIZE": "2"}, "WEIGHTSYNC_RANK and WEIGHTSYNC_WORLD_SIZE go"),
        ({}, {"WEIGHTSYNC_MIN_PEERS": "two"}, "WEIGHTSYNC_MIN_PEERS: expected an integer, got 'two'"),
        ({}, {"WEIGHTSYNC_OUTER_LR": "nan"}, "WEIGHTSYNC_OUTER_LR: expected a finite number, got nan"),
        ({"policy": "barrier"}, {"WEIGHTSYNC_ROUND_SAMPLES": "8"}, "WEIGHTSYNC_ROUND_SAMPLES goes with --policy"),
    ],
)
def test_a_bad_setting_names_its_source(flags: dict[str, str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        HookSettings.resolve({"hub": "http://h:1", "run": "r", **flags}, env)
    assert str(caught.value).startswith(message), caught.value


def test_the_launcher_says_a_bad_setting_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--hub", "http://h:1", "--run", "r", "--sync-every", "0", "--", "python", "x.py"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "weightsync-run: error: --sync-every: must be >= 1, got 0\n"
    with pytest.raises(SystemExit):
        main(["--run", "r", "--", "python", "x.py"])
    assert "give the hub: --hub URL" in capsys.readouterr().err


def closed_port() -> int:
    with socket.socket() as sock:  # bound, never listening: a connection there is refused
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: a bad value of each flag the launcher has for the run (one per run setting at least: checked),
#: and the line it gets
BAD_VALUES = {
    "--run": ("a/b", "--run: expected 1-64 letters, digits, '.', '_', '-', starting with a letter or digit, got 'a/b'"),
    "--peer": ("gpu 1", "--peer: expected 1-64 letters, digits"),
    "--min-peers": ("0", "--min-peers: must be >= 1 and <= 8192, got 0"),
    "--min-merge-peers": ("0", "--min-merge-peers: must be >= 1 and <= 8192, got 0"),
    "--policy": ("sometimes", "--policy: expected one of barrier, samples, async, got 'sometimes'"),
    "--round-samples": ("1.5", "--round-samples: expected an integer, got '1.5'"),
    "--codec": ("zip", "--codec: unknown codec 'zip'"),
    "--outer": ("adam", "--outer: expected one of avg, diloco, got 'adam'"),
    "--outer-lr": ("11", "--outer-lr: must be > 0 and <= 10, got 11.0"),
    "--outer-momentum": ("1", "--outer-momentum: must be >= 0 and < 1, got 1.0"),
    "--outer-warmup": ("-1", "--outer-warmup: must be >= 0 and <= 1000000, got -1"),
    "--round-timeout": ("inf", "--round-timeout: expected a finite number, got inf"),
    "--norm-guard": ("1", "--norm-guard: must be > 1 and <= 1000000, got 1.0"),
    "--max-staleness": ("soon", "--max-staleness: expected an integer, got 'soon'"),
    "--utilization": ("1", "--utilization: must be > 0 and < 1, got 1.0"),
    "--sync-min": ("0", "--sync-min: must be >= 1 and <= 1099511627776, got 0"),
    "--sync-max": ("x", "--sync-max: expected an integer, got 'x'"),
    "--lr-scaling": ("cube", "--lr-scaling: lr_scaling must be one of none, sqrt, linear, got 'cube'"),
    "--lr-scaling-warmup": ("-1", "--lr-scaling-warmup: must be >= 0, got -1"),
}


def test_every_run_setting_has_its_bad_value_case() -> None:
    assert {f"--{s.name.replace('_', '-')}" for s in RUN_SETTINGS} <= set(BAD_VALUES)


def test_help_groups_the_run_settings_each_with_its_variable() -> None:
    text = build_parser().format_help()
    group = text[text.index("run settings:") : text.index("on this machine:")]
    for setting in RUN_SETTINGS:
        assert f"--{setting.name.replace('_', '-')} " in group and f"[WEIGHTSYNC_{setting.name.upper()}]" in group


@pytest.mark.parametrize(
    ("argv", "code", "line"),
    [
        (["--bogus", "--", "python", "x.py"], 2, "unrecognized arguments: --bogus (see weightsync-run --help)"),
        (
            ["--hub", "http://h:1", "--run", "r", "--sync-every", "2", "--round-samples", "8", "--", "python"],
            2,
            "--sync-every and --round-samples exclude each other",
        ),
        (
            ["--local-peers", "2", "--min-peers", "3", "--", "python", "-c", "pass"],
            2,
            "--min-peers: --local-peers names its peers and waits for all K",
        ),
        (["--hub", "http://h:1", "--run", "r", "--", "python", "-u", "no_such.py"], 2, "no such script: no_such.py"),
        (["--local-peers", "2", "--", "python3.11", "-W", "ignore", "nope.py", "x.py"], 2, "no such script: nope.py"),
        (["--run", "r", "--", "python", "-c", "pass"], 2, "give the hub: --hub URL"),
        (["--hub", "http://127.0.0.1:{port}", "--run", "r", "--", "python", "-c", "pass"], 3, "no hub at http://"),
        (["--hub", "http://h:1", "--run", "r"], 2, "give the program to run after --"),
        *(
            (["--hub", "http://h:1", "--run", "r", flag, value, "--", "python", "-c", "pass"], 2, line)
            for flag, (value, line) in BAD_VALUES.items()
        ),
    ],
)
def test_bad_input_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], code: int,
    line: str,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("WEIGHTSYNC_")]:
        monkeypatch.delenv(name)
    # Two looks at the closed port, half a second apart, not the launcher's 5 s of them for a hub
    # that starts slowly: a refused connection stays refused, and the line is the same.
    monkeypatch.setattr(launcher, "hub_problem", functools.partial(launcher.hub_problem, wait=0.2))
    port = closed_port()
    with pytest.raises(SystemExit) as exited:
        main([word.format(port=port) for word in argv])
    err = capsys.readouterr().err
    assert exited.value.code == code and err.count("\n") == 1, err
    assert err.startswith(f"weightsync-run: error: {line}"), err


# -- in a fresh interpreter ----------------------------------------------------------------------------


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env}, timeout=120
    )


def test_a_post_import_hook_runs_once_after_the_module() -> None:
    done = python(
        "import sys\n"
        "from syncclient.hooks.imports import when_imported\n"
        "seen = []\n"
        "when_imported('wave', lambda m: seen.append((m.__name__, hasattr(m, 'open'), type(m.__loader__).__name__)))\n"
        "assert 'wave' not in sys.modules and not seen\n"
        "import wave, wave\n"
        "print(seen)\n"
    )
    assert done.stdout.strip() == "[('wave', True, 'SourceFileLoader')]", done.stderr


def test_the_hooks_import_nothing_heavy_and_run_a_hidden_sitecustomize(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['HIDDEN_SITECUSTOMIZE'] = 'ran'\n")
    env = {"PYTHONPATH": os.pathsep.join([SITE, str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code = (
        "import os, sys\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'lightning', 'httpx', 'numpy') if m in sys.modules)\n"
        "print(heavy, 'syncclient.hooks' in sys.modules, os.environ.get('HIDDEN_SITECUSTOMIZE'))\n"
    )
    done = python(code, WEIGHTSYNC_HUB="http://127.0.0.1:9", WEIGHTSYNC_RUN="r", **env)
    assert done.stdout.strip() == "[] True ran", done.stderr
    assert "found nothing to sync" in done.stderr


@pytest.mark.parametrize(
    ("shard", "seen"), [("1", "[1, 3, 5, 7, 9] [1, 3, 5, 7, 9]"), ("0", "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10] 11")]
)
def test_a_dataloader_is_sharded_by_rank_unless_told_not_to(shard: str, seen: str) -> None:
    """Rank 1 of 2 reads every other sample of the first 10 of 11 (shuffled or not); with
    WEIGHTSYNC_SHARD=0 it reads them all. No optimizer steps: no hub is needed."""
    code = (
        "import torch\n"
        "from torch.utils.data import DataLoader\n"
        "data = list(range(11))\n"
        "plain = [int(x) for x in DataLoader(data, batch_size=1)]\n"
        "shuffled = sorted(int(i) for batch in DataLoader(data, batch_size=2, shuffle=True) for i in batch)\n"
        "print(plain, shuffled if len(shuffled) < 11 else len(shuffled))\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([SITE, os.environ.get("PYTHONPATH", "")])}
    done = python(code, WEIGHTSYNC_HUB="http://127.0.0.1:9", WEIGHTSYNC_RUN="r", WEIGHTSYNC_RANK="1",
                  WEIGHTSYNC_WORLD_SIZE="2", WEIGHTSYNC_SHARD=shard, **env)  # fmt: skip
    assert done.stdout.strip() == seen, done.stderr
    assert ("rank 1 of 2 takes 5 of them" in done.stderr) == (shard == "1"), done.stderr


def test_a_program_python_cannot_start_gets_no_note_from_the_hooks(tmp_path: Path) -> None:
    """``python -m no_such_module``: Python's own line is the only one; the hooks found nothing
    because nothing ran, and do not say otherwise."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")},
        "PYTHONPATH": os.pathsep.join([SITE, os.environ.get("PYTHONPATH", "")]),
        "WEIGHTSYNC_HUB": "http://127.0.0.1:9",
        "WEIGHTSYNC_RUN": "r",
    }
    done = subprocess.run(
        [sys.executable, "-m", "no_such_module_here"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"{sys.executable}: No module named no_such_module_here"]


# -- when a plain loop syncs ---------------------------------------------------------------------------


class RecordingClient(SyncClient):
    """A real SyncClient that also notes what the plain loop asked of it (the rounds it made), in
    order with the loop's own events."""

    def __init__(self, *args: Any, events: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events = events

    def sync(self, model: torch.nn.Module, *, samples: int, metrics: Any = None, final: bool = False) -> Any:
        self.events.append(f"{'final ' if final else ''}sync {int(metrics['step'])}")
        return super().sync(model, samples=samples, metrics=metrics, final=final)

    def flush(self, model: torch.nn.Module, *, samples: int | None = None) -> Any:
        result = super().flush(model, samples=samples)
        if result is not None:
            self.events.append("flush")
        return result

    def leave(self) -> None:
        self.events.append("leave")
        super().leave()


def joined_loop(hub: Hub, run: str, sync_every: str, events: list[str], lead: Any, net: Net) -> PlainLoop:
    """A plain loop as the hooks leave it once joined (int8: a lossy codec, whose residual flushes)."""
    loop = PlainLoop(HookSettings.resolve({"hub": hub.url, "run": run, "sync_every": sync_every}, {}))
    client = RecordingClient(hub.url, run=run, codec="int8", sync_every=loop.settings.sync_every, events=events)
    client.join(net)
    client.count_from(0)
    loop.model, loop.client, loop._lead = net, client, weakref.ref(lead)
    plain._watch_state_reads(loop)
    return loop


def test_a_plain_loop_syncs_after_the_iterations_last_optimizer_and_at_a_read_once_a_window(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two optimizers over one model (Muon + AdamW's shape), sync every 2: the sync due after the
    lead's 2nd step is made after the other optimizer's step of that iteration; a read of the
    model's state just after it flushes the residual, which takes the round of steps 3-4 (no
    sync at 4); a read after step 7 syncs it, final; at exit only the leave is left. Reading a
    submodule's state syncs nothing."""
    monkeypatch.setattr(torch.nn.Module, "state_dict", torch.nn.Module.state_dict)  # put back after
    net = Net()
    matrices = [p for p in net.parameters() if p.dim() == 2]
    lead = torch.optim.SGD(matrices, lr=0.1)
    other = torch.optim.SGD([p for p in net.parameters() if p.dim() == 1], lr=0.1)
    events: list[str] = []
    loop = joined_loop(hub, "windows", "2", events, lead, net)
    try:
        for step in range(1, 8):
            for name, optimizer in (("lead", lead), ("other", other)):
                events.append(f"{name} {step}")
                loop._after_step(optimizer, (), {})
            if step == 2:
                net.state_dict()
            net.body.state_dict()
        net.state_dict()
        loop._at_exit()
    finally:
        loop.stop()
    steps = [e for e in events if not e.startswith(("lead", "other"))]
    assert steps == ["sync 2", "flush", "sync 6", "final sync 7", "leave"]
    assert events[events.index("sync 2") - 1] == "other 2" and events[events.index("sync 6") - 1] == "other 6"


def test_a_plain_loop_follows_a_sync_schedule(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--sync-every 1:3,2``: every step until step 3, then every 2 (5, 7, ...); a read after
    step 4 syncs it, final, which takes the round of steps 4-5 and its flush that of 6-7: none is
    due before the last sync at exit."""
    monkeypatch.setattr(torch.nn.Module, "state_dict", torch.nn.Module.state_dict)
    net = Net()
    lead = torch.optim.SGD(net.parameters(), lr=0.1)
    events: list[str] = []
    loop = joined_loop(hub, "schedule", "1:3,2", events, lead, net)
    assert loop.settings.sync_every == SyncSchedule(((1, 3),), 2)
    assert HookSettings.from_env(loop.settings.to_env()) == loop.settings  # WEIGHTSYNC_SYNC_EVERY=1:3,2
    try:
        for step in range(1, 7):
            loop._after_step(lead, (), {})
            if step == 4:
                net.state_dict()
        loop._at_exit()
    finally:
        loop.stop()
    assert events == ["sync 1", "sync 2", "sync 3", "final sync 4", "final sync 6", "leave"]


# -- seeds, loops that step by hand, torch.save(model) ---------------------------------------------------

SEEDS = """
import random, numpy, torch
torch.manual_seed(5); numpy.random.seed(5); random.seed(5)
own = torch.Generator().manual_seed(5)
print(torch.rand(1).item(), numpy.random.rand(), random.random(), torch.rand(1, generator=own).item())
"""


@pytest.mark.parametrize("seed", ["1", "0"])
def test_a_constant_seed_gets_the_rank_unless_told_not_to(seed: str) -> None:
    """Rank 1 of 2: the process-wide streams start from seed + 1; a generator of the program's own
    keeps its seed (a train/validation split that must agree); WEIGHTSYNC_SEED=0 keeps them all."""
    env = {"PYTHONPATH": os.pathsep.join([SITE, os.environ.get("PYTHONPATH", "")])}
    done = python(SEEDS, WEIGHTSYNC_HUB="http://127.0.0.1:9", WEIGHTSYNC_RUN="r", WEIGHTSYNC_RANK="1",
                  WEIGHTSYNC_WORLD_SIZE="2", WEIGHTSYNC_SEED=seed, **env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    import random

    import numpy

    # what those seeds give, from generators of the test's own: the process-wide streams here are
    # shared with other threads of this worker (a retry's jitter draws from random)
    mine = 5 + int(seed)
    streams = [torch.rand(1, generator=torch.Generator().manual_seed(mine)).item(),
               numpy.random.RandomState(mine).rand(), random.Random(mine).random(),
               torch.rand(1, generator=torch.Generator().manual_seed(5)).item()]  # fmt: skip
    assert done.stdout.split() == [str(v) for v in streams]
    said = "the seeds the program sets get + 1 (its rank): each peer draws its own batches (--same-seed keeps them)"
    assert (said in done.stderr) == (seed == "1"), done.stderr


LOOP = """
import sys, torch
mode = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if mode != "hand" else None
x = torch.randn(32, 4)
y = x.sum(1, keepdim=True)
for step in range(1, 9):
    for micro in range(2 if mode == "accumulate" else 1):
        model(x[:2]).detach()  # a forward that is not training: no step
        ((model(x) - y) ** 2).mean().backward()
    if optimizer is None:
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.05)
            p.grad = None
    else:
        optimizer.step()
        optimizer.zero_grad()
torch.save(model, sys.argv[2])
"""


def test_a_loop_that_steps_by_hand_syncs_as_one_with_an_optimizer(tmp_path: Path, hub: Hub) -> None:
    """Sync every 3 steps, 8 steps, then ``torch.save(model)``: rounds after steps 3 and 6, and the
    save syncs steps 7-8 first (pickling the module reads no state), so the file holds the run's
    last version. A loop that steps by hand does so through its backward passes; two backward
    passes per optimizer step (gradient accumulation) are still the optimizer's one step. The
    three run side by side, each a run of its own."""
    (tmp_path / "loop.py").write_text(LOOP)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    env = clean | {"PYTHONPATH": os.pathsep.join([SITE, os.environ.get("PYTHONPATH", "")]),
                   "WEIGHTSYNC_HUB": hub.url, "WEIGHTSYNC_SYNC_EVERY": "3"}  # fmt: skip
    modes = ("hand", "optimizer", "accumulate")
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "loop.py", mode, f"{mode}.pt"],
            cwd=tmp_path,
            text=True,
            stderr=subprocess.PIPE,
            env=env | {"WEIGHTSYNC_RUN": mode},
        )
        for mode in modes
    }
    from syncclient.weights import ModelView
    from syncwire.digest import weights_sha256

    for mode, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        steps = "backward passes" if mode == "hand" else "optimizer steps"
        assert f"in run '{mode}', every 3 {steps}" in err, err
        left = err.strip().splitlines()[-1]
        assert f"left run '{mode}' at version 3;" in left, left
        model = torch.load(tmp_path / f"{mode}.pt", weights_only=False)
        assert not model._forward_pre_hooks  # nothing of weightsync travels with the file
        assert left.endswith(weights_sha256(ModelView(model).export()))
