"""The settings a peer may give a run, written once: one :class:`RunSetting` per setting.

Everything that takes them is made from :data:`RUN_SETTINGS`: ``SyncClient(codec=...,
min_peers=...)`` checks its keywords with :func:`check_run_settings`; ``weightsync-run``
generates a flag (``--min-peers``) and a variable (``WEIGHTSYNC_MIN_PEERS``) for each and parses
their strings with :meth:`RunSetting.parse`. So no setting can be reachable one way and not the
other, nor bounded differently.

They configure the run if this peer creates it; for an existing run each one given must match
the run's (unset: accept the run's, or for a new run the hub's default). The hub judges them
again (its join request declares the same fields with the same bounds, and
``tests/test_runconfig.py`` holds the two together): the bounds are here so that a typo fails
in one line on the peer's side before anything starts, not as a 422 after training began.

The standard library only (and numpy through ``syncwire``, only when a codec is checked): the
hooks read these in every Python process ``weightsync-run`` starts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["NAME_RULE", "POLICIES", "RUN_SETTINGS", "RunSetting", "check_run_settings", "name_problem"]

POLICIES = ("barrier", "samples", "async")  # as the hub names them (syncserver.core.policy)
OUTERS = ("avg", "diloco")

# A run or peer name, as the hub allows it (syncserver.names; a test holds them together): names
# travel in URL paths and the hub's data folder.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "1-64 letters, digits, '.', '_', '-', starting with a letter or digit"


def name_problem(value: str) -> str | None:
    """Why ``value`` cannot name a run or a peer (None: it can)."""
    return None if _NAME.fullmatch(value) else f"expected {NAME_RULE}, got {value!r}"


@dataclass(frozen=True)
class RunSetting:
    """One run setting: its ``SyncClient`` keyword, its type and bounds, and its help line.

    ``kind`` is int, float or str; ``gt``/``ge``/``lt``/``le`` bound a number (as pydantic's
    ``Field`` does on the hub), ``choices`` a word."""

    name: str
    kind: type
    help: str
    metavar: str
    choices: tuple[str, ...] = ()
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def parse(self, raw: str) -> Any:
        """The value a flag or variable spells (ValueError with the reason, for the caller to
        prefix with the flag or variable)."""
        if self.kind is int:
            try:
                value: Any = int(raw)
            except ValueError:
                raise ValueError(f"expected an integer, got {raw!r}") from None
        elif self.kind is float:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"expected a number, got {raw!r}") from None
        else:
            value = raw
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
            from syncwire import get_codec  # numpy: only when a codec is given

            if len(value) > 64:
                return "a codec spec is at most 64 characters, e.g. 'int8:block=128'"
            try:
                get_codec(value)
            except ValueError as exc:
                return str(exc)
        bounds = [("> ", self.gt), (">= ", self.ge), ("< ", self.lt), ("<= ", self.le)]
        if not all(_holds(op, value, bound) for op, bound in bounds if bound is not None):
            rule = " and ".join(f"{op}{_number(bound)}" for op, bound in bounds if bound is not None)
            return f"must be {rule}, got {value!r}"
        return None


def _holds(op: str, value: float, bound: float) -> bool:
    return {"> ": value > bound, ">= ": value >= bound, "< ": value < bound, "<= ": value <= bound}[op]


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


#: The bounds are the hub's (``syncserver/limits.py``, where each is explained).
RUN_SETTINGS: tuple[RunSetting, ...] = (
    RunSetting(
        "min_peers",
        int,
        "peers the run waits for before it starts (its rendezvous)",
        "N",
        ge=1,
        le=2**13,
    ),
    RunSetting(
        "min_merge_peers",
        int,
        "the fewest updates a round merges (fewer once peers left); 1: a dead peer never holds a round",
        "K",
        ge=1,
        le=2**13,
    ),
    RunSetting(
        "policy",
        str,
        "when a round closes: barrier (every peer sent its N steps), samples (the peers together trained "
        "--round-samples), async (no rounds: each update is applied as it comes)",
        "|".join(POLICIES),
        choices=POLICIES,
    ),
    RunSetting(
        "round_samples",
        int,
        "samples per round (policy samples, which it alone implies) or per outer step (async)",
        "S",
        ge=1,
        le=2**40,
    ),
    RunSetting("codec", str, "wire codec: fp32, bf16, int8, int4, topk (e.g. int8:block=64)", "CODEC"),
    RunSetting(
        "outer", str, "outer optimizer: avg (average the peers) or diloco (Nesterov)", "|".join(OUTERS), choices=OUTERS
    ),
    RunSetting("outer_lr", float, "DiLoCo outer learning rate (0.7 in the paper)", "LR", gt=0, le=10),
    RunSetting("outer_momentum", float, "DiLoCo Nesterov momentum", "M", ge=0, lt=1),
    RunSetting(
        "outer_warmup", int, "DiLoCo: outer steps over which momentum ramps up (0: none)", "STEPS", ge=0, le=1_000_000
    ),
    RunSetting(
        "round_timeout",
        float,
        "seconds after a round's first update before stragglers are dropped",
        "SECONDS",
        gt=0,
        le=7 * 24 * 3600,
    ),
    RunSetting(
        "norm_guard",
        float,
        "refuse an update whose norm is over this many times the median of the round's (e.g. 10)",
        "F",
        gt=1,
        le=1e6,
    ),
    RunSetting(
        "max_staleness",
        int,
        "async: refuse an update whose base is more than this many versions old",
        "VERSIONS",
        ge=0,
        le=100_000,
    ),
)

_BY_NAME = {setting.name: setting for setting in RUN_SETTINGS}


def check_run_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings given (None: not given), checked: ValueError naming the keyword for a bad
    one or a bad pair. ``round_samples`` with ``policy="barrier"`` is one: a barrier round is N
    steps, not a sample count."""
    given = {name: value for name, value in values.items() if value is not None}
    for name, value in given.items():
        setting = _BY_NAME.get(name)
        if setting is None:
            raise ValueError(f"no run setting {name!r}; they are {', '.join(_BY_NAME)}")
        problem = setting.problem(value)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    if given.get("policy") == "barrier" and "round_samples" in given:
        raise ValueError("round_samples goes with policy samples or async, not barrier (a barrier round is N steps)")
    return given
