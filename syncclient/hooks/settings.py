"""What the hooks are told: ``WEIGHTSYNC_*`` variables, written by ``weightsync-run`` and read by
the hooks in each program it starts. One parser on both sides (:meth:`HookSettings.resolve`: a
flag beats its variable), so the launcher refuses a bad value in one line before anything starts.
Imports nothing heavy: the hooks read these in every Python process of the command.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from syncclient.peerlr import DEFAULT_PEER_LR, PeerLR
from syncclient.preemption import metadata_base, preemption_mode
from syncclient.schedule import SyncEvery, SyncSchedule
from syncwire.runsettings import AUTO, RUN_SETTINGS, paired_interval, settle

__all__ = ["DEFAULT_SYNC_EVERY", "ENV", "HookSettings", "SettingsError", "flag_name", "name_problem"]

DEFAULT_SYNC_EVERY = 100  # optimizer steps; docs/concepts/outer.md, "The interval", says how to pick it

# A run or peer name, as the hub allows it (syncserver.names; a test holds them together): names
# travel in URL paths and the hub's data folder.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "1-64 letters, digits, '.', '_', '-', starting with a letter or digit"


def name_problem(value: str) -> str | None:
    """Why ``value`` cannot name a run or a peer (None: it can)."""
    return None if _NAME.fullmatch(value) else f"expected {NAME_RULE}, got {value!r}"


#: field -> variable: the launcher's own settings, every run setting (``min_peers`` ->
#: ``WEIGHTSYNC_MIN_PEERS``), and the peer's name and rank (``--local-peers`` sets those itself).
_OWN: tuple[str, ...] = ("hub", "run", "token", "sync_every", "shard", "seed", "lr_scaling", "lr_scaling_warmup")
_OWN += ("preemption", "metadata_url")  # the machine's: syncclient.preemption
_PEER = ("peer", "rank", "world_size")
ENV = {name: "WEIGHTSYNC_" + name.upper() for name in (*_OWN, *(s.name for s in RUN_SETTINGS), *_PEER)}


T = TypeVar("T")


class SettingsError(ValueError):
    """A setting that does not hold: one line naming the flag or variable that gave it."""


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class HookSettings:
    """How a hooked program syncs. ``config``: the run settings given, checked, for ``SyncClient``.
    ``sync_every`` (steps, a :class:`~syncclient.schedule.SyncSchedule` or ``"auto"``, which
    ``utilization`` alone implies) and a samples run's
    ``round_samples`` exclude each other; with neither, :data:`DEFAULT_SYNC_EVERY` (an async run
    takes both). ``rank`` and ``world_size`` (set by ``--local-peers``, or by you) are what the
    data is sharded by; without them nothing is."""

    hub: str  # "" until a launcher gives it
    run: str
    token: str | None = None
    sync_every: SyncEvery | None = DEFAULT_SYNC_EVERY
    shard: bool = True
    seed: bool = True  # a constant seed the program sets becomes seed + rank (syncclient.hooks.seeds)
    peer: str | None = None
    rank: int | None = None
    world_size: int | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    lr_scaling: str = DEFAULT_PEER_LR.scaling  # each peer's learning rate from the peers (syncclient.peerlr)
    lr_scaling_warmup: int | None = DEFAULT_PEER_LR.warmup  # None: one round (sync_every steps)
    preemption: str | None = None  # which notices of the machine's end to act on (None: auto)
    metadata_url: str | None = None  # the cloud's metadata server (None: 169.254.169.254)

    @classmethod
    def resolve(
        cls, flags: Mapping[str, str | None], env: Mapping[str, str] = os.environ, *, launched: bool = False
    ) -> HookSettings:
        """From ``flags`` (raw strings by field; None: not given), else the variables;
        :class:`SettingsError` names where a bad value came from. ``launched``: a launcher will
        give the hub (``--local-peers``'s own), so it is left empty."""

        def raw(field: str) -> tuple[str | None, str]:
            given = flags.get(field)
            if given is not None:
                return given, flag_name(field)
            return env.get(ENV[field]) or None, ENV[field]

        def parsed(source: str, parse: Callable[..., T], *args: Any) -> T:
            try:
                return parse(*args)
            except ValueError as exc:
                raise SettingsError(f"{source}: {exc}") from None

        def number(field: str, low: int = 1) -> int | None:
            value, source = raw(field)
            if value is None:
                return None
            try:
                parsed = int(value)
            except ValueError:
                raise SettingsError(f"{source}: expected an integer, got {value!r}") from None
            if parsed < low:
                raise SettingsError(f"{source}: must be >= {low}, got {parsed}")
            return parsed

        def switch(field: str) -> bool:
            value, source = raw(field)
            if value not in (None, "0", "1"):
                raise SettingsError(f"{source}: expected 0 (off) or 1 (on), got {value!r}")
            return value != "0"

        def name(field: str) -> str | None:
            value, source = raw(field)
            problem = None if value is None else name_problem(value)
            if problem is not None:
                raise SettingsError(f"{source}: {problem}")
            return value

        hub, hub_source = raw("hub")
        if hub is None and not launched:
            raise SettingsError(f"give the hub: --hub URL (or {ENV['hub']}), or run peers here: --local-peers K")
        hub = hub or ""
        parts = urlsplit(hub)
        if not launched and (parts.scheme not in ("http", "https") or not parts.netloc):
            raise SettingsError(
                f"{hub_source}: expected an http:// or https:// URL such as http://hub:8000, not {hub!r}"
            )
        run = name("run")
        if run is None:
            raise SettingsError(f"give the run to join: --run NAME or {ENV['run']}")
        config: dict[str, Any] = {}
        for setting in RUN_SETTINGS:
            value, source = raw(setting.name)
            if value is not None:
                config[setting.name] = parsed(source, setting.parse, value)
        every, source = raw("sync_every")
        schedule = every is not None and (":" in every or "," in every)
        sync_every: SyncEvery | None = None
        if every == AUTO:
            sync_every = "auto"
        else:
            sync_every = parsed(source, SyncSchedule.parse, every) if schedule else number("sync_every")
        by_samples = "round_samples" in config and config.get("policy") != "async"
        try:
            sync_every, utilization = paired_interval(
                sync_every, config.get("utilization"), samples=by_samples, say=lambda name: raw(name)[1]
            )
            if utilization is not None:
                config["utilization"] = utilization
            settle(config, config, say=lambda name: raw(name)[1])
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if sync_every is not None and by_samples:
            raise SettingsError(
                f"{raw('sync_every')[1]} and {raw('round_samples')[1]} exclude each other: "
                "sync every N optimizer steps, or whenever the peers together trained S samples"
            )
        if sync_every is None and not by_samples:
            sync_every = DEFAULT_SYNC_EVERY
        (lr_scaling, lr_source), warmup = raw("lr_scaling"), number("lr_scaling_warmup", low=0)
        # (a warm-up not given, None, is one round; only the scaling can be wrong: the warm-up is a number >= 0)
        peer_lr = parsed(lr_source, PeerLR, lr_scaling or DEFAULT_PEER_LR.scaling, warmup)
        shard, seed = switch("shard"), switch("seed")
        preemption, preemption_source = raw("preemption")
        if preemption is not None:
            parsed(preemption_source, preemption_mode, preemption)
        metadata_url, url_source = raw("metadata_url")
        if metadata_url is not None:
            parsed(url_source, metadata_base, metadata_url)
        rank, world_size = number("rank", low=0), number("world_size")
        if (rank is None) != (world_size is None) or (rank or 0) >= (world_size or 1):
            raise SettingsError(
                f"{ENV['rank']} and {ENV['world_size']} go together, with 0 <= rank < world size; "
                f"got {rank} and {world_size}"
            )
        return cls(
            hub=hub.rstrip("/"),
            run=run,
            token=raw("token")[0],
            sync_every=sync_every,
            shard=shard,
            seed=seed,
            peer=name("peer"),
            rank=rank,
            world_size=world_size,
            config=config,
            lr_scaling=peer_lr.scaling,
            lr_scaling_warmup=peer_lr.warmup,
            preemption=preemption,
            metadata_url=metadata_url,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HookSettings:
        return cls.resolve({}, env)

    def to_env(self) -> dict[str, str]:
        """The variables that give a child these settings (tokens stay off command lines)."""
        values = {name: getattr(self, name) for name in (*_OWN, *_PEER)}
        values |= {"shard": str(int(self.shard)), "seed": str(int(self.seed)), **self.config}
        return {ENV[k]: str(v) for k, v in values.items() if v not in (None, "")}

    def said_interval(self, steps: str = "steps") -> str:
        """When this program syncs, as the line the hooks say at start puts it."""
        if self.sync_every is None:
            return "when rounds are due"
        return "at intervals the hub picks" if self.sync_every == AUTO else f"every {self.sync_every} {steps}"

    @property
    def peer_lr(self) -> PeerLR:
        """How each peer's learning rate follows the number of peers (the warm-up in steps)."""
        return PeerLR(self.lr_scaling, self.lr_scaling_warmup).for_rounds(self.sync_every)

    def callback_kwargs(self) -> dict[str, Any]:
        """Keywords for the callbacks: the client's, and the learning-rate scaling."""
        return {"lr_scaling": self.lr_scaling, "lr_scaling_warmup": self.lr_scaling_warmup, **self.client_kwargs()}

    def client_kwargs(self) -> dict[str, Any]:
        """Keywords for ``SyncClient`` (and the callbacks, which pass them on)."""
        own = {"run": self.run, "peer": self.peer, "token": self.token, "sync_every": self.sync_every}
        return own | {"preemption": self.preemption, "metadata_url": self.metadata_url, **self.config}

    @property
    def seed_offset(self) -> int:
        """What each constant seed the program sets gets added: the rank among several peers, if on."""
        return self.rank if self.seed and self.rank is not None and (self.world_size or 1) > 1 else 0

    @property
    def shards(self) -> bool:
        """Whether data is to be sharded: asked for, and a rank among several peers is known."""
        return self.shard and self.world_size is not None and self.world_size > 1
