"""How much of the hub one token may take: ``SYNC_MAX_RUNS_PER_TOKEN`` runs created, and
``SYNC_MAX_PEERS_PER_RUN`` peers a run (past either, a join is ``403 limit_reached``). Runs are
never deleted and each costs memory and disk for the hub's life: one token *did* create 2,000,
and 1,000 peers joined one run. The admin token is not limited; a run token can only create its
own run. Pure checks: the coordinator asks before it changes anything.
"""

from __future__ import annotations

from collections.abc import Iterable

from syncserver.core.state import Run
from syncserver.errors import InvalidUpdate, LimitReached
from syncserver.settings import HubSettings

__all__ = ["check_new_peer", "check_new_run"]


def check_new_run(runs: Iterable[Run], creator: str, min_peers: int, settings: HubSettings) -> None:
    """May ``creator`` (a kind of token, :data:`syncserver.api.deps.Caller`) create one more run?"""
    if min_peers > settings.max_peers_per_run:
        raise InvalidUpdate(
            f"min_peers {min_peers} is over this hub's SYNC_MAX_PEERS_PER_RUN ({settings.max_peers_per_run}): "
            "the run could never start"
        )
    if creator in ("admin", "run"):
        return
    # runs from before creators were kept count as the hub token's: the common case, and the safe one
    made = sum(1 for run in runs if (run.creator or creator) == creator)
    if made >= settings.max_runs_per_token:
        raise LimitReached(
            f"this token has created {made} runs, this hub's limit (SYNC_MAX_RUNS_PER_TOKEN); "
            "its operator can raise it, or create runs with the admin token",
            limit="max_runs_per_token",
            value=settings.max_runs_per_token,
        )


def check_new_peer(run: Run, peer: str, settings: HubSettings) -> None:
    """May ``peer`` join ``run``? A member (gone, left, or rejoining after a crash) always may."""
    if peer not in run.peers and len(run.peers) >= settings.max_peers_per_run:
        raise LimitReached(
            f"run {run.name!r} has {len(run.peers)} peers, this hub's limit (SYNC_MAX_PEERS_PER_RUN)",
            limit="max_peers_per_run",
            value=settings.max_peers_per_run,
        )
