"""The settings of a run, declared once: one :class:`RunSetting` per setting, in
:data:`RUN_SETTINGS`, and the rules between them (:func:`settle`).

Both sides are made from this table, so no setting is reachable one way and not another, nor
bounded differently: ``SyncClient``'s checks, ``weightsync-run``'s flags and ``WEIGHTSYNC_*``
variables, the hub's ``SYNC_*`` defaults and ``serve`` flags, the join request, the run's config
in the hub. The peer's side checks what the hub would refuse, so a typo fails in one line before
anything starts, not as a 422 after training began. Plain Python: the hooks read this in every
process ``weightsync-run`` starts (numpy loads only when a codec is checked). The bounds are the
hub's limits (``syncserver/limits.py`` says why each is what it is).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = ["AUTO", "DEFAULT_UTILIZATION", "FLUSH_KEY", "PACE_KEYS", "PROBE_STEPS"]
__all__ += ["MAX_PEERS", "MAX_SAMPLES", "MAX_SECONDS", "RUN_SETTINGS", "Outer", "Policy", "RunSetting"]
__all__ += ["check_run_settings", "normal_codec", "paired_interval", "settle"]

Outer = Literal["avg", "diloco"]
Policy = Literal["barrier", "samples", "async"]  # the round policies of syncserver.core.policy
#: Peers a run may ever have (a bound of ``min_peers``, and of the hub's ``max_peers_per_run``).
MAX_PEERS = 2**13
#: An update's weight: ``MAX_PEERS`` x ``MAX_SAMPLES`` = 2^53 keeps a round's total exact.
MAX_SAMPLES = 2**40
#: A deadline longer than a week is a typo, and an infinite one never fires.
MAX_SECONDS = 7 * 24 * 3600.0
#: ``sync_every="auto"``: the hub picks each interval (syncserver/core/interval.py), keeping this
#: share of the peers' wall time computing unless ``utilization`` says otherwise.
AUTO, DEFAULT_UTILIZATION = "auto", 0.95
#: The first interval of an auto run, in steps: long enough for a step time, short enough to
#: measure the links soon.
PROBE_STEPS = 10
#: What every update's metrics say of its peer's last interval, for the hub to pick the next: steps
#: and samples trained, wall seconds since the sync before, training-thread seconds in the SDK's own
#: work and blocked on the hub, and 1 when the peer overlaps its syncs with training.
PACE_KEYS = ("sync_steps", "sync_samples", "sync_seconds", "sync_host_s", "sync_wait_s", "sync_overlap")
#: the metric that marks a lossy codec's flush update (its residual alone, weighing the final update it
#: was cut from): the hub's samples ledger counts those samples once, with that final update
FLUSH_KEY = "sync_flush"


@dataclass(frozen=True)
class RunSetting:
    """One run setting: its name (``SyncClient``'s keyword; ``--min-peers``, ``WEIGHTSYNC_MIN_PEERS``
    and ``SYNC_MIN_PEERS`` follow from it), ``kind`` (int, float or str), bounds (``gt``/``ge``/
    ``lt``/``le``, as pydantic's ``Field`` takes them; ``choices`` for a word), the hub's default
    for new runs, and ``help`` for a peer's flag, ``hub`` for the hub's setting. ``nullable``:
    None is a value (off, or not set)."""

    name: str
    kind: type
    default: Any
    metavar: str
    help: str
    hub: str
    choices: tuple[str, ...] = ()
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    nullable: bool = False

    @property
    def bounds(self) -> dict[str, float]:
        return {op: bound for op in ("gt", "ge", "lt", "le") if (bound := getattr(self, op)) is not None}

    def parse(self, raw: str) -> Any:
        """The value a flag or variable spells (ValueError with the reason, for the caller to prefix)."""
        try:
            value = self.kind(raw)
        except ValueError:
            raise ValueError(f"expected {'an integer' if self.kind is int else 'a number'}, got {raw!r}") from None
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is no value of this setting (None: it is one)."""
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return f"expected an integer, got {value!r}"
        if self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"expected a number, got {value!r}"
            if not math.isfinite(value):
                return f"expected a finite number, got {value!r}"
        if self.kind is str and not isinstance(value, str):
            return f"expected a string, got {value!r}"
        if self.choices and value not in self.choices:
            return f"expected one of {', '.join(self.choices)}, got {value!r}"
        if self.name == "codec":
            try:
                normal_codec(value)
            except ValueError as exc:
                return str(exc)
        bounds = self.bounds
        if all(_OPS[op][0](value, bound) for op, bound in bounds.items()):
            return None
        rule = " and ".join(f"{_OPS[op][1]} {_number(bound)}" for op, bound in bounds.items())
        return f"must be {rule}, got {value!r}"


_OPS = {"gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "lt": (operator.lt, "<"), "le": (operator.le, "<=")}


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def normal_codec(spec: str) -> str:
    """The codec's one spelling (``int8:block=64`` is ``int8``), so runs compare codecs, not
    strings; ValueError, with the list of codecs, for one that does not exist."""
    if len(spec) > 64:
        raise ValueError("a codec spec is at most 64 characters, e.g. 'int8:block=128'")
    from syncwire.codecs import get_codec  # numpy: only when a codec is given

    return get_codec(spec).spec


#: In the order of the run's config on the wire (join request, answers). Each row: name, type,
#: the hub's default, the flag's metavar (a word's choices: theirs), the peer's help, the hub's.
# fmt: off
RUN_SETTINGS: tuple[RunSetting, ...] = (
    RunSetting("codec", str, "fp32", "CODEC", "wire codec: fp32, bf16, int8, int4, topk (e.g. int8:block=64)",
               "Default codec of new runs: fp32, bf16, int8, int4, topk, with parameters: int8:block=128."),
    RunSetting("outer", str, "avg", "", "outer optimizer: avg (average the peers) or diloco (Nesterov)",
               "Default outer optimizer of new runs.", choices=get_args(Outer)),
    RunSetting("outer_lr", float, 0.7, "LR", "DiLoCo outer learning rate (0.7 in the paper)",
               "DiLoCo outer learning rate (default of new runs; at most 10).", gt=0, le=10),
    RunSetting("outer_momentum", float, 0.9, "M", "DiLoCo Nesterov momentum", "DiLoCo Nesterov momentum (default).",
               ge=0, lt=1),
    RunSetting("outer_warmup", int, 20, "STEPS", "DiLoCo: outer steps over which momentum ramps up (0: none)",
               "DiLoCo: outer steps over which momentum ramps from 0 to outer_momentum, with outer lr 1/(1+momentum) "
               "meanwhile (default of new runs; 0: DiLoCo as published).", ge=0, le=1_000_000),
    RunSetting("min_peers", int, 1, "N", "peers the run waits for before it starts (its rendezvous)",
               "Peers a new run waits for before it starts (its rendezvous).", ge=1, le=MAX_PEERS),
    RunSetting("min_merge_peers", int, 1, "K",
               "the fewest updates a round merges (fewer once peers left); 1: a dead peer never holds a round",
               "Default of new runs: the fewest updates a round merges (torchft's min_replica_size; fewer once peers "
               "left the run). A round whose live peers are all in waits for more while it has fewer, and status and "
               "the dashboard say so. 1: a gone peer never holds a round.", ge=1, le=MAX_PEERS),
    RunSetting("round_timeout", float, 600.0, "SECONDS", "seconds after a round's first update before stragglers are "
               "dropped", "Seconds after a round's first update before stragglers are dropped.", gt=0, le=MAX_SECONDS),
    RunSetting("norm_guard", float, None, "F",
               "refuse an update whose norm is over this many times the median of the round's (e.g. 10)",
               "Default of new runs: refuse (422 poisoned_update) an update whose L2 norm is over this many times the "
               "median norm of the updates accepted in this round and the previous one (e.g. 10). Unset: off.",
               gt=1, le=1e6, nullable=True),
    RunSetting("policy", str, "barrier", "",
               "when a round closes: barrier (every peer sent its N steps), samples (the peers together trained "
               "round_samples), async (no rounds: each update is applied as it comes)",
               "Default of new runs: when a round closes. barrier: every live peer sent its N steps; samples: the "
               "peers' reported samples reached round_samples; async: no rounds, each update is applied as it comes.",
               choices=get_args(Policy)),
    RunSetting("round_samples", int, None, "S",
               "samples per round (policy samples, which it alone implies) or per outer step (async)",
               "Default of new runs: samples per round (policy samples) or per outer step (async). Setting it alone "
               "makes the default policy samples.", ge=1, le=MAX_SAMPLES, nullable=True),
    RunSetting("max_staleness", int, 32, "VERSIONS", "async: refuse an update whose base is more than this many "
               "versions old", "Default of new async runs: refuse an update whose base is older (versions).",
               ge=0, le=100_000),
    RunSetting("utilization", float, None, "U",
               "sync_every auto: the share of wall time the peers compute; the hub picks the smallest interval "
               "that keeps it (0.95 when auto is asked without it)",
               "Default of new runs: the hub picks each round's interval (steps; samples in a samples run) as the "
               "smallest that keeps this share of the peers' wall time computing (sync_every auto). Unset: the "
               "peers' own interval.", gt=0, lt=1, nullable=True),
    RunSetting("sync_min", int, 1, "N", "sync_every auto: the fewest steps (samples runs: samples) between syncs",
               "Default of new auto runs: the shortest interval the hub picks (steps; samples in a samples run).",
               ge=1, le=MAX_SAMPLES),
    RunSetting("sync_max", int, None, "N", "sync_every auto: the most steps (samples runs: samples) between syncs",
               "Default of new auto runs: the longest interval the hub picks. Unset: no bound.",
               ge=1, le=MAX_SAMPLES, nullable=True),
)
# fmt: on

_BY_NAME = {setting.name: setting for setting in RUN_SETTINGS}


def settle(values: Mapping[str, Any], chosen: Collection[str] = (), say: Callable[[str], str] = str) -> dict[str, Any]:
    """The rules between settings, written once: ``values`` with the policy a sample target
    implies, or ValueError with the reason. A setting missing from ``values`` is not known (the
    hub's default decides it); ``chosen``: those set on purpose; ``say(name)``: how the reason
    names a setting (a flag, a variable). A sample target alone means policy samples; a barrier
    round is N steps, not samples; samples and async runs need their target; ``min_merge_peers``
    over ``min_peers`` could never merge a round it could start with; an interval's bounds go with
    the utilization that picks it (not in async runs), the lower under the upper."""
    values = dict(values)
    policy, target = values.get("policy"), values.get("round_samples")
    if policy == "barrier" and target is not None and "policy" not in chosen:
        values["policy"] = policy = "samples"
    if policy == "barrier" and target is not None:
        raise ValueError(
            f"{say('round_samples')} goes with {say('policy')} samples or async, not barrier "
            "(a barrier round is N steps)"
        )
    if policy in ("samples", "async") and "round_samples" in values and target is None:
        raise ValueError(f"{say('policy')} {policy} needs {say('round_samples')} (samples per round)")
    bounds = [name for name in ("sync_min", "sync_max") if values.get(name) not in (None, 1)]
    if values.get("utilization") is None and bounds:
        raise ValueError(
            f"{say(bounds[0])} bounds an interval the hub picks: it goes with {say('utilization')} (sync_every auto)"
        )
    if values.get("utilization") is not None and policy == "async":
        raise ValueError(
            f"{say('utilization')} (sync_every auto) picks the interval of barrier and samples runs; "
            "an async run's peers sync on their own: give sync_every N"
        )
    low, high = values.get("sync_min"), values.get("sync_max")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{say('sync_min')} {low} is over {say('sync_max')} {high}")
    floor, start = values.get("min_merge_peers"), values.get("min_peers")
    if floor is not None and start is not None and floor > start:
        raise ValueError(
            f"{say('min_merge_peers')} {floor} is over {say('min_peers')} {start}: a run could start with fewer "
            "peers than any of its rounds needs"
        )
    return values


def paired_interval(
    sync_every: Any, utilization: float | None, *, samples: bool, say: Callable[[str], str] = str
) -> tuple[Any, float | None]:
    """``sync_every`` and ``utilization`` as they go together, the one rule the SDK, the launcher and
    the reference job apply: ``"auto"`` targets :data:`DEFAULT_UTILIZATION` unless told; a
    utilization alone means ``"auto"`` (in a samples run, ``samples``, it sizes the rounds instead);
    beside a number of steps or a schedule it is a ValueError naming both (``say``, as in :func:`settle`)."""
    if utilization is not None and not samples:
        if sync_every is not None and sync_every != AUTO:
            raise ValueError(
                f"{say('utilization')} picks the interval: give {say('sync_every')} auto, not {sync_every}"
            )
        sync_every = AUTO
    if sync_every == AUTO and utilization is None:
        utilization = DEFAULT_UTILIZATION
    return sync_every, utilization


def check_run_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings given (None: not given), checked one by one and together (:func:`settle`):
    ValueError naming the keyword for a bad one or a bad pair."""
    given = {name: value for name, value in values.items() if value is not None}
    for name, value in given.items():
        setting = _BY_NAME.get(name)
        if setting is None:
            raise ValueError(f"no run setting {name!r}; they are {', '.join(_BY_NAME)}")
        problem = setting.problem(value)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    return settle(given, chosen=given)
