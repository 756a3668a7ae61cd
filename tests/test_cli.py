"""``syncserver serve``'s flags, generated from ``HubSettings``: one flag per field,
flag over variable over default, one-line errors. In-process where nothing needs a server."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from syncserver.cli import SettingsInputError, app, env_name, flag_name, hub_settings
from syncserver.settings import HubSettings

COMMANDS: dict[str, Any] = typer.main.get_command(app).commands  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def no_sync_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tester's own SYNC_* variables must not leak into these checks."""
    for name in list(os.environ):
        if name.startswith("SYNC_"):
            monkeypatch.delenv(name)


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **(env or {})})


def test_every_setting_has_a_flag() -> None:
    options = {opt for param in COMMANDS["serve"].params for opt in param.opts}
    missing = [flag_name(name) for name in HubSettings.model_fields if flag_name(name) not in options]
    assert not missing
    assert {"--host", "--port", "--ssl-certfile", "--ssl-keyfile", "--log-level", "--ready-file"} <= set(
        {opt for param in COMMANDS["serve"].params for opt in param.opts}
    )


def test_help_shows_each_default_once_and_no_secret() -> None:
    out = invoke("serve", "--help", env={"SYNC_TOKEN": "s3cret-hub", "SYNC_ADMIN_TOKEN": "s3cret-admin"}).output
    flat = " ".join(out.replace("│", " ").split())  # rich wraps the help in a box
    assert "s3cret" not in flat
    for name, field in HubSettings.model_fields.items():
        assert env_name(name) in flat, name
        default = field.get_default(call_default_factory=True)
        if default not in (None, {}):
            assert flat.count(f"{env_name(name)}, default: {default}]") == 1, name
    assert "default: None" not in flat


def test_flag_beats_variable_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub_settings({}).keep_versions == HubSettings.model_fields["keep_versions"].default
    monkeypatch.setenv("SYNC_KEEP_VERSIONS", "4")
    monkeypatch.setenv("SYNC_MIN_PEERS", "3")
    settings = hub_settings({"keep_versions": "5", "run_tokens": '{"r1": "t"}'}, min_peers=2, lease_seconds=9.0)
    assert settings.keep_versions == 5  # the flag
    assert settings.min_peers == 3  # the variable, over the command's own default
    assert settings.lease_seconds == 9.0  # the command's default, where neither is given
    assert settings.run_tokens["r1"].get_secret_value() == "t"


def test_through_the_command_a_flag_hides_a_bad_variable() -> None:
    # The variable is bad but the flag replaces it, so only the other bad flag is reported.
    result = invoke("serve", "--keep-versions", "5", "--lease-seconds", "-1", env={"SYNC_KEEP_VERSIONS": "0"})
    assert result.exit_code == 2
    assert result.output.strip() == "error: --lease-seconds: Input should be greater than 0"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--keep-versions", "0"], {}, "error: --keep-versions: Input should be greater than or equal to 1"),
        ([], {"SYNC_KEEP_VERSIONS": "many"}, "error: SYNC_KEEP_VERSIONS: Input should be a valid integer"),
        (["--fold-threads", "0"], {}, "error: --fold-threads: Input should be greater than or equal to 1"),
        ([], {"SYNC_FOLD_THREADS": "all"}, "error: SYNC_FOLD_THREADS: Input should be a valid integer"),
        (["--outer", "sgd"], {}, "error: --outer: Input should be 'avg' or 'diloco'"),
        (["--codec", "zip"], {}, "error: --codec: unknown codec 'zip'"),
        (["--run-tokens", "{no"], {}, "error: --run-tokens: not JSON"),
        (["--view-token", "v"], {}, "error: SYNC_VIEW_TOKEN is set but SYNC_TOKEN is not"),
    ],
)
def test_bad_value_is_one_line_naming_its_source(args: list[str], env: dict[str, str], message: str) -> None:
    result = invoke("serve", *args, env=env)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith(message), result.output


def test_bad_value_from_a_real_process_has_no_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    proc = subprocess.run(
        [sys.executable, "-m", "syncserver", "serve", "--norm-guard", "0.5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --norm-guard: Input should be greater than 1"


def test_hub_settings_names_a_bad_flag() -> None:
    with pytest.raises(SettingsInputError, match=r"^--min-peers: "):
        hub_settings({"min_peers": "zero"})


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        ({"min_merge_peers": "3"}, "min_merge_peers 3 is over min_peers 1"),
        ({"disconnect_grace": "0"}, "--disconnect-grace: Input should be greater than 0"),
    ],
)
def test_a_merge_floor_or_grace_that_cannot_hold_is_one_line(flags: dict[str, str], reason: str) -> None:
    with pytest.raises(SettingsInputError, match=reason):
        hub_settings(flags)
