"""Hub settings: environment variables with the ``SYNC_`` prefix, or ``syncserver serve`` flags."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin

from pydantic import AfterValidator, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from syncserver.limits import MAX_BYTES, MAX_PEERS, Seconds
from syncserver.names import NAME_RULE, is_name
from syncwire.runsettings import RUN_SETTINGS, Outer, Policy, RunSetting, normal_codec, settle

#: the default lease, from bench/lease.py (bench/RESULTS.md, Leases): see docs/RELIABILITY.md
LEASE_SECONDS = 10.0
#: seconds a dropped heartbeat connection may stay away before its peer is gone: one lost SYN costs
#: Linux 1 s (its initial retransmission timeout) before the SDK's reconnect gets through, plus a
#: round trip (~0.3 s across continents); 1.5 s, not 2, keeps a SIGKILL's cost to the survivors
#: under 2 s (bench/failures.py: the grace + 0.06 s to decide and close)
DISCONNECT_GRACE = 1.5

#: A codec spec, in its one spelling (``int8:block=64`` is ``int8``): runs compare codecs, not strings.
CodecSpec = Annotated[str, AfterValidator(normal_codec)]
_SETTINGS = {setting.name: setting for setting in RUN_SETTINGS}


def run_type(setting: RunSetting, *, checked: bool = True) -> Any:
    """A run setting's type for pydantic, from the table: its kind or choices, None allowed when
    it may be unset; ``checked``: bounded, and the codec in its one spelling (what the hub takes
    in, not what it answers)."""
    kind: Any = Literal[setting.choices] if setting.choices else setting.kind
    if checked:
        kind = CodecSpec if setting.name == "codec" else kind
        kind = Annotated[kind, Field(**_limits(setting))] if setting.bounds else kind
    return kind | None if setting.nullable else kind


def run_default(name: str) -> Any:
    """A ``HubSettings`` field for a run setting: the table's default of new runs, bounds and help."""
    setting = _SETTINGS[name]
    return Field(setting.default, description=setting.hub, **_limits(setting))


def _limits(setting: RunSetting) -> dict[str, Any]:
    """The setting's bounds as pydantic takes them; a float is finite (JSON's 1e999 is Inf)."""
    return {**setting.bounds, **({"allow_inf_nan": False} if setting.kind is float else {})}


def default_fold_threads() -> int:
    """The cores, at most 4: the hub is meant for a small VM, whose cores its receiving threads and
    event loop need too; a bigger hub can ask for more (``SYNC_FOLD_THREADS``)."""
    return min(4, os.cpu_count() or 1)


class HubSettings(BaseSettings):
    """Everything the hub can be told. Per-run values (codec, outer optimizer, min_peers,
    round timeout) are only defaults: the first peer of a run may choose its own."""

    # hide_input_in_errors: a bad setting must not print the tokens beside it (SYNC_RUN_TOKENS)
    model_config = SettingsConfigDict(env_prefix="SYNC_", extra="ignore", hide_input_in_errors=True)

    data_dir: Path = Field(Path("./syncserver-data"), description="Where versions, updates and state live.")
    token: SecretStr | None = Field(
        None,
        description="Bearer token required on every /v1 call and /metrics (never on /healthz, /docs, /openapi.json "
        "or the dashboard's page, which asks for it). Unset: an open hub.",
    )
    view_token: SecretStr | None = Field(
        None,
        description="Read-only bearer token: run status, the dashboard's data and /metrics accept it, "
        "nothing that changes state or serves weights does. Needs SYNC_TOKEN.",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Operator's bearer token: every endpoint of every run, creating runs, listing "
        "them, /metrics. Lets a hub give its peers run tokens only.",
    )
    run_tokens: dict[str, SecretStr] = Field(
        default_factory=dict,
        description='Per-run bearer tokens, JSON: SYNC_RUN_TOKENS=\'{"imdb-gpt2": "..."}\'. A run token '
        "opens /v1/runs/<its run>/... only (it may create that run), nothing else.",
    )
    min_peers: int = run_default("min_peers")
    min_merge_peers: int = run_default("min_merge_peers")
    round_timeout: float = run_default("round_timeout")
    lease_seconds: Seconds = Field(
        LEASE_SECONDS,
        description="A peer not heard from for this long is gone (a hung or vanished machine); the SDK's "
        "heartbeat asks every third of it.",
    )
    disconnect_grace: Seconds = Field(
        DISCONNECT_GRACE,
        description="A peer whose heartbeat connection dropped (its process died) and did not come back within "
        "this many seconds is gone, without waiting for its lease (one at or over the lease changes nothing).",
    )
    max_body_bytes: int = Field(
        8 * 1024**3, gt=0, le=MAX_BYTES, description="Hard cap on any upload; the run's schema sets a tighter one."
    )
    long_poll_seconds: Seconds = Field(20.0, description="Longest a wait request is held open.")
    max_runs_per_token: int = Field(
        100,
        ge=1,
        le=100_000,
        description="Runs one token may create (runs are kept for the hub's life); then 403 limit_reached. "
        "The admin token has no limit; a run token only ever creates its run.",
    )
    max_peers_per_run: int = Field(
        256, ge=1, le=MAX_PEERS, description="Peers that may join one run; then 403 limit_reached."
    )
    metrics_runs: int = Field(
        50,
        ge=0,
        le=10_000,
        description="Runs that /metrics labels one by one (the first ones seen); the others are summed "
        'under run="_other", so that the metrics stay bounded however many runs there are.',
    )
    header_timeout: Seconds = Field(
        10.0,
        description="Seconds a client has to send a request's line and headers (64 KiB at most), from connecting "
        "or from the end of the previous answer; then 408 and the connection is closed (serve or plain "
        "uvicorn alike).",
    )
    idle_timeout: Seconds = Field(
        5.0, description="An idle keep-alive connection is closed after this many seconds (uvicorn's keep-alive)."
    )
    keep_versions: int = Field(3, ge=1, le=10_000, description="Model versions (and round results) kept on disk.")
    store: str = Field(
        "",
        description="An S3-API bucket that carries round results and model versions to peers (presigned GETs), "
        "s3://bucket/prefix (the prefix optional); endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_REGION. Checked at start. Empty: local disk only.",
        max_length=1024,
    )
    store_url_seconds: int = Field(
        600,
        ge=1,
        le=604_800,
        description="Life of the presigned GETs peers are redirected to (S3 checks it when a request starts; "
        "a peer whose URL expired asks the hub again).",
    )
    store_control_seconds: float = Field(
        5.0,
        gt=0,
        le=30,
        allow_inf_nan=False,
        description="Deadline of the hub's control calls to the store (create, list, complete, abort, delete): to "
        "connect, then to the answer's first byte. A hung store then answers a peer's presign or report 503 "
        "within seconds, and the peer PUTs the update to the hub. Data transfers keep a 30 s read timeout.",
    )
    spare_files: int = Field(
        6,
        ge=0,
        le=64,
        description="Pruned tensor files kept to write new ones over (their pages stay cached: "
        "fresh ones cost ~1 s per 500 MB on some VMs); each costs its size on disk (6 GPT-2 124M files: 3 GB). "
        "0: none.",
    )
    fold_threads: int = Field(
        default_factory=default_fold_threads,
        ge=1,
        le=256,
        description="Threads that decode and fold updates and merge a round's result (default: the cores, at "
        "most 4). A hub on a machine with cores to spare closes int8/int4 rounds of many peers sooner with more.",
    )
    reducers: int = Field(
        0,
        ge=0,
        le=64,
        description="Reducer processes that share each round's merge: syncserver serve starts this many on "
        "this machine (they die with the hub; more may join with syncserver reduce --hub URL). The round's "
        "slices are cut into as many byte-balanced leases. 0: the hub merges in its own threads.",
    )
    local_reducers: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Of those, how many syncserver serve starts on this machine (default: all of them; 0: every "
        "reducer is started apart, with syncserver reduce).",
    )
    reduce_lease_seconds: Seconds = Field(
        30.0,
        description="A reducer that has not renewed its work lease for this long has lost it: it is offered "
        "to another reducer, and its late report is refused.",
    )
    codec: CodecSpec = run_default("codec")
    outer: Outer = run_default("outer")
    outer_lr: float = run_default("outer_lr")
    outer_momentum: float = run_default("outer_momentum")
    outer_warmup: int = run_default("outer_warmup")
    norm_guard: float | None = run_default("norm_guard")
    policy: Policy = run_default("policy")
    round_samples: int | None = run_default("round_samples")
    max_staleness: int = run_default("max_staleness")
    utilization: float | None = run_default("utilization")
    sync_min: int = run_default("sync_min")
    sync_max: int | None = run_default("sync_max")

    @field_validator("run_tokens")
    @classmethod
    def _run_tokens(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for run, token in value.items():
            if not is_name(run):
                raise ValueError(f"SYNC_RUN_TOKENS: {run!r} is not a run name ({NAME_RULE})")
            if not token.get_secret_value():
                raise ValueError(f"SYNC_RUN_TOKENS: the token of run {run!r} is empty")
        return value

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        if value and not value.startswith("s3://"):
            raise ValueError(f"an object store is named s3://bucket[/prefix], not {value[:80]!r}")
        return value

    @property
    def auth_required(self) -> bool:
        """False for an open hub: no token of any kind is set."""
        return self.token is not None or self.admin_token is not None or bool(self.run_tokens)

    @model_validator(mode="after")
    def _hold_together(self) -> HubSettings:
        if self.view_token is not None and not self.auth_required:
            raise ValueError("SYNC_VIEW_TOKEN is set but SYNC_TOKEN is not: an open hub needs no view token")
        if self.local_reducers is not None and self.local_reducers > self.reducers:
            raise ValueError(f"local_reducers {self.local_reducers} is over reducers {self.reducers}")
        if self.min_peers > self.max_peers_per_run:
            raise ValueError(
                f"min_peers {self.min_peers} is over max_peers_per_run {self.max_peers_per_run}: no run could start"
            )
        # the rules between run settings (syncwire.runsettings.settle): a sample target set alone
        # makes the default policy samples
        self.policy = settle({s.name: getattr(self, s.name) for s in RUN_SETTINGS}, self.model_fields_set)["policy"]
        # A peer blocked in a long poll must not look dead: the poll renews its lease, so it has to
        # end well within the lease. (Assigned only when cut: an assignment counts as set.)
        if self.long_poll_seconds > self.lease_seconds / 2:
            self.long_poll_seconds = self.lease_seconds / 2
        return self


# -- from flags and variables: one line naming a bad one ------------------------------------------


class SettingsInputError(ValueError):
    """A hub setting that does not hold: one line naming the flag or variable that gave it."""


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return "SYNC_" + field.upper()


def hub_settings(flags: dict[str, str], **defaults: Any) -> HubSettings:
    """The settings from ``flags``, else ``SYNC_*`` variables, else ``defaults``, else the model's:
    for ``syncserver serve`` and the launcher (:func:`syncserver.local.hub_settings_for`). Flags are
    raw strings by field name, handed to pydantic as a variable's are (the same spellings); a dict
    field (``--run-tokens``) is JSON, as its variable is."""
    given: dict[str, Any] = dict(flags)  # Any: each value goes to the field of its name, pydantic checks it
    for name, raw in flags.items():
        if get_origin(HubSettings.model_fields[name].annotation) is dict:
            try:
                given[name] = json.loads(raw)
            except ValueError:
                raise SettingsInputError(
                    f'{flag_name(name)}: not JSON, expected an object such as \'{{"run": "token"}}\''
                ) from None
    try:
        settings = HubSettings(**given)
        below_env = {k: v for k, v in defaults.items() if k not in settings.model_fields_set}
        return HubSettings(**given, **below_env) if below_env else settings
    except SettingsError as exc:  # an env value that does not parse at all, e.g. SYNC_RUN_TOKENS
        raise SettingsInputError(f"{exc} (SYNC_RUN_TOKENS must be a JSON object)") from None
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else None
            source = "" if field is None else (flag_name(field) if field in flags else env_name(field)) + ": "
            problems.append(source + error["msg"].removeprefix("Value error, "))
        raise SettingsInputError("; ".join(problems)) from None
