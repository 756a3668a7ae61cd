"""The run settings are written once (``syncwire.runsettings``), and the peer's checks and the
hub's models (its join request, its settings, the run's config) are made from that table. These
tests hold what is made together: the same names, and the same values accepted and refused,
probed at and around every bound; and ``SyncClient`` takes exactly those keywords and refuses a
bad value before it talks to a hub."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import pytest
from pydantic import ValidationError

from syncclient import SyncClient
from syncclient.hooks.settings import name_problem
from syncserver.api.routes import JoinRequest
from syncserver.api.schemas import RunConfig as ConfigAnswer
from syncserver.core.state import RunConfig
from syncserver.names import is_name
from syncserver.settings import HubSettings
from syncwire.runsettings import RUN_SETTINGS, RunSetting, check_run_settings

NAMES = [s.name for s in RUN_SETTINGS]

#: numbers near every bound either side has (limits.py's and runconfig's), and the odd ones
PROBES: list[float] = [-1, 0, 0.5, 0.999, 1, 1.001, 1.5, 2, 9.999, 10, 10.001, 100_000, 100_001, 1e6, 1e6 + 1]
PROBES += [2**13, 2**13 + 1, 2**40, 2**40 + 1, 7 * 24 * 3600, 7 * 24 * 3600 + 1, math.nan, math.inf]
WORDS = [
    "fp32",
    "int8:block=64",
    "topk",
    "zip",
    "x" * 65,
    "",
    "avg",
    "diloco",
    "adam",
    *("barrier", "samples", "async"),
]


def hub_accepts(name: str, value: Any) -> bool:
    try:
        JoinRequest(peer="p", **{name: value})
    except ValidationError:
        return False
    return True


def probes(setting: RunSetting) -> list[Any]:
    if setting.kind is str:
        return WORDS
    numbers = [p for p in PROBES if setting.kind is float or (math.isfinite(p) and float(p).is_integer())]
    return [setting.kind(p) for p in numbers]


def test_the_same_settings_on_both_sides() -> None:
    assert list(JoinRequest.model_fields) == ["peer", *NAMES, "group_size"]  # the wire's order
    assert list(ConfigAnswer.model_fields) == NAMES == [f.name for f in dataclasses.fields(RunConfig)]
    assert set(NAMES) <= set(HubSettings.model_fields)  # each has the hub's default
    assert {n: HubSettings.model_fields[n].default for n in NAMES} == {s.name: s.default for s in RUN_SETTINGS}
    keywords = set(inspect.signature(SyncClient).parameters)
    fixed = {"hub", "run", "peer", "token", "sync_every", "verify", "timeout", "retry_seconds", "group"}
    fixed |= {"preemption", "metadata_url"}  # the machine's own (syncclient.preemption)
    assert keywords - fixed == set(NAMES)


@pytest.mark.parametrize("setting", RUN_SETTINGS, ids=NAMES)
def test_the_same_values_accepted_on_both_sides(setting: RunSetting) -> None:
    for value in probes(setting):
        assert (setting.problem(value) is None) == hub_accepts(setting.name, value), (setting.name, value)


def test_the_same_names_on_both_sides() -> None:
    for name in ["a", "A.b_c-9", "9", "x" * 64, "x" * 65, ".hidden", "-x", "a/b", "a b", "a\n", "", "é"]:
        assert (name_problem(name) is None) == is_name(name), name


def test_sync_client_refuses_a_bad_setting_before_it_talks_to_a_hub() -> None:
    with pytest.raises(ValueError, match=r"^outer_lr: must be > 0 and <= 10, got 100$"):
        SyncClient("http://127.0.0.1:9", run="r", outer_lr=100)
    with pytest.raises(ValueError, match=r"^min_peers: expected an integer, got True$"):
        SyncClient("http://127.0.0.1:9", run="r", min_peers=True)
    with pytest.raises(ValueError, match=r"^round_samples goes with policy samples or async, not barrier"):
        SyncClient("http://127.0.0.1:9", run="r", policy="barrier", round_samples=8)


def test_check_run_settings_keeps_what_was_given() -> None:
    given = {"min_peers": 2, "outer": "diloco", "outer_lr": None}
    assert check_run_settings(given) == {"min_peers": 2, "outer": "diloco"}
    with pytest.raises(ValueError, match="no run setting 'min_peer'"):
        check_run_settings({"min_peer": 2})


def test_a_run_recorded_before_the_newer_settings_loads_as_it_ran() -> None:
    old = {"codec": "fp32", "outer": "avg", "outer_lr": 0.7, "outer_momentum": 0.9, "min_peers": 2, "round_timeout": 60}
    config = RunConfig.load(old)
    assert (config.policy, config.outer_warmup, config.min_merge_peers, config.norm_guard) == ("barrier", 0, 1, None)
    assert config.__dict__ == RunConfig(**config.__dict__).__dict__ and config.min_peers == 2


def test_the_rules_between_settings_are_one_function_for_every_side() -> None:
    """A sample target alone implies policy samples; the other rules refuse, naming each side's way."""
    hub = HubSettings(round_samples=64)
    assert hub.policy == "samples" and HubSettings(round_samples=64, policy="async").policy == "async"
    with pytest.raises(ValidationError, match="min_merge_peers 3 is over min_peers 2"):
        HubSettings(min_peers=2, min_merge_peers=3)
    with pytest.raises(ValueError, match=r"^min_merge_peers 3 is over min_peers 2"):
        SyncClient("http://127.0.0.1:9", run="r", min_peers=2, min_merge_peers=3)
    check_run_settings({"policy": "samples"})  # round_samples unknown here: the hub's default may give it
