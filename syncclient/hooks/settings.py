"""What the hooks are told: ``WEIGHTSYNC_*`` variables, written by ``weightsync-run`` and read by
the hooks in each program it starts.

``weightsync-run`` resolves its flags (a flag beats its variable) into :class:`HookSettings`,
checks them once, and hands them to the program as variables (:meth:`HookSettings.to_env`);
the hooks read them back with :meth:`HookSettings.from_env`. One parser on both sides, so the
launcher refuses a bad value in one line before anything starts. Imports nothing heavy: the
hooks read these in every Python process of the command, training or not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["DEFAULT_SYNC_EVERY", "ENV", "HookSettings", "SettingsError", "env_name", "flag_name"]

DEFAULT_SYNC_EVERY = 100  # optimizer steps; docs/concepts/outer.md, "The interval", says how to pick it

#: field -> variable. The launcher sets the last three (its own, or ``--local-peers``'s).
ENV = {
    "hub": "WEIGHTSYNC_HUB",
    "run": "WEIGHTSYNC_RUN",
    "token": "WEIGHTSYNC_TOKEN",
    "sync_every": "WEIGHTSYNC_SYNC_EVERY",
    "round_samples": "WEIGHTSYNC_ROUND_SAMPLES",
    "codec": "WEIGHTSYNC_CODEC",
    "shard": "WEIGHTSYNC_SHARD",
    "peer": "WEIGHTSYNC_PEER",
    "rank": "WEIGHTSYNC_RANK",
    "world_size": "WEIGHTSYNC_WORLD_SIZE",
}


class SettingsError(ValueError):
    """A setting that does not hold: one line naming the flag or variable that gave it."""


def env_name(field: str) -> str:
    return ENV.get(field, "WEIGHTSYNC_" + field.upper())


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class HookSettings:
    """How a hooked program syncs. ``sync_every`` and ``round_samples`` exclude each other;
    with neither, ``sync_every`` is :data:`DEFAULT_SYNC_EVERY`. ``rank`` and ``world_size`` (set
    by ``--local-peers``, or by you for peers on several machines) are what the data is
    sharded by; without them nothing is sharded."""

    hub: str  # "" until a launcher gives it
    run: str
    token: str | None = None
    sync_every: int | None = DEFAULT_SYNC_EVERY
    round_samples: int | None = None
    codec: str | None = None
    shard: bool = True
    peer: str | None = None
    rank: int | None = None
    world_size: int | None = None

    @classmethod
    def resolve(
        cls, flags: Mapping[str, str | None], env: Mapping[str, str] = os.environ, *, launched: bool = False
    ) -> HookSettings:
        """From ``flags`` (raw strings by field; None: not given), else the variables. Raises
        :class:`SettingsError` naming where a bad value came from. ``launched``: a launcher
        will give the hub (``--local-peers``'s own), so ``hub`` is left empty."""

        def raw(field: str) -> tuple[str | None, str]:
            given = flags.get(field)
            if given is not None:
                return given, flag_name(field)
            return env.get(env_name(field)) or None, env_name(field)

        def number(field: str) -> int | None:
            value, source = raw(field)
            if value is None:
                return None
            try:
                parsed = int(value)
            except ValueError:
                raise SettingsError(f"{source}: expected an integer, got {value!r}") from None
            low = 0 if field == "rank" else 1
            if parsed < low:
                raise SettingsError(f"{source}: must be >= {low}, got {parsed}")
            return parsed

        hub, hub_source = raw("hub")
        if hub is None and not launched:
            raise SettingsError(f"give the hub: --hub URL (or {env_name('hub')}), or run peers here: --local-peers K")
        hub = hub or ""
        parts = urlsplit(hub)
        if not launched and (parts.scheme not in ("http", "https") or not parts.netloc):
            raise SettingsError(
                f"{hub_source}: expected an http:// or https:// URL such as http://hub:8000, not {hub!r}"
            )
        run, _ = raw("run")
        if run is None:
            raise SettingsError(f"give the run to join: --run NAME or {env_name('run')}")
        sync_every, round_samples = number("sync_every"), number("round_samples")
        if sync_every is not None and round_samples is not None:
            raise SettingsError(
                f"{raw('sync_every')[1]} and {raw('round_samples')[1]} exclude each other: "
                "sync every N optimizer steps, or whenever the peers together trained S samples"
            )
        if sync_every is None and round_samples is None:
            sync_every = DEFAULT_SYNC_EVERY
        codec, codec_source = raw("codec")
        if codec is not None:
            from syncwire import get_codec  # numpy only; here so that a bad codec stops the launcher

            try:
                get_codec(codec)
            except ValueError as exc:
                raise SettingsError(f"{codec_source}: {exc}") from None
        shard, shard_source = raw("shard")
        if shard not in (None, "0", "1"):
            raise SettingsError(f"{shard_source}: expected 0 (off) or 1 (on), got {shard!r}")
        rank, world_size = number("rank"), number("world_size")
        if (rank is None) != (world_size is None) or (rank or 0) >= (world_size or 1):
            raise SettingsError(
                f"{env_name('rank')} and {env_name('world_size')} go together, with 0 <= rank < world size; "
                f"got {rank} and {world_size}"
            )
        return cls(
            hub=hub.rstrip("/"),
            run=run,
            token=raw("token")[0],
            sync_every=sync_every,
            round_samples=round_samples,
            codec=codec,
            shard=shard != "0",
            peer=raw("peer")[0],
            rank=rank,
            world_size=world_size,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HookSettings:
        return cls.resolve({}, env)

    def to_env(self) -> dict[str, str]:
        """The variables that give a child these settings (tokens stay off command lines)."""
        values = {
            "hub": self.hub,
            "run": self.run,
            "token": self.token,
            "sync_every": self.sync_every,
            "round_samples": self.round_samples,
            "codec": self.codec,
            "shard": "1" if self.shard else "0",
            "peer": self.peer,
            "rank": self.rank,
            "world_size": self.world_size,
        }
        return {env_name(k): str(v) for k, v in values.items() if v not in (None, "")}

    def client_kwargs(self) -> dict[str, Any]:
        """Keywords for ``SyncClient`` (and the callbacks, which pass them on)."""
        kwargs: dict[str, Any] = {"run": self.run, "peer": self.peer, "token": self.token, "codec": self.codec}
        if self.round_samples is not None:
            kwargs["round_samples"] = self.round_samples
        return kwargs

    @property
    def shards(self) -> bool:
        """Whether data is to be sharded: asked for, and a rank among several peers is known."""
        return self.shard and self.world_size is not None and self.world_size > 1
