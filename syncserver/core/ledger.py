"""The samples ledger: every sample a peer reported training is counted once, acknowledged or lost.

Pure bookkeeping, no I/O: the coordinator feeds it a run's events and writes what it finds lost in
the transaction of the event that found it (a round's commit, a peer's join or leave record), then
books it here. The rule, in one place: a peer's latest progress report (``base``: the version it
trains from, ``samples`` since its last sync) is **acknowledged** once an update of that peer from
``base`` or later is acknowledged (the update carries it and more), and **lost** when

- a round closes and the next one no longer takes an update from ``base`` (its round closed without
  the peer: it was killed, or late and drops its local steps on the catch-up; async: the base went
  over ``max_staleness``), or
- the peer joins again (a restarted process starts from nothing) or leaves, before delivering it.

A report for a base the peer already delivered from is late news of samples its update carried
(reports and updates travel on separate connections): ignored. Steps trained while an update is in
flight (``sync_async``) are reported for the next base, so they never count against the round in
flight. The hub loses the open round's reports when it is killed (a restart keeps the booked ledger:
acknowledged from the update records, lost from its own); the peers report again as they train.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from syncserver.records import Loss

__all__ = ["Account", "Ledger"]


@dataclass
class Account:
    """One peer's samples."""

    acknowledged: int = 0  # carried by its acknowledged updates
    lost: int = 0  # reported trained, never in an acknowledged update (booked: durable)
    delivered: int = -1  # the newest base version it has an acknowledged update from
    trained: tuple[int, int] | None = None  # (base, samples): its latest report no update carried yet


class Ledger:
    """A run's accounts, by peer."""

    def __init__(self) -> None:
        self.accounts: dict[str, Account] = {}

    def _account(self, peer: str) -> Account:
        return self.accounts.setdefault(peer, Account())

    def load(self, accounts: dict[str, Account]) -> None:
        """The booked ledger as the store keeps it (a restart): no report survives one."""
        self.accounts = accounts

    def report(self, peer: str, base: int, samples: int) -> None:
        """``peer`` trained ``samples`` from version ``base`` since its last sync (its running count)."""
        account = self._account(peer)
        if base > account.delivered and samples > 0:
            account.trained = (base, samples)

    def acknowledged(self, peer: str, base: int, samples: int) -> None:
        """An update of ``peer`` from version ``base`` carrying ``samples`` is durable."""
        account = self._account(peer)
        account.acknowledged += samples
        account.delivered = max(account.delivered, base)
        if account.trained is not None and account.trained[0] <= base:
            account.trained = None

    def forfeit(self, peer: str) -> Loss | None:
        """What ``peer`` loses by joining again or leaving now: its report no update carried."""
        trained = self.accounts[peer].trained if peer in self.accounts else None
        return None if trained is None else Loss(trained[0], peer, trained[1])

    def lost(self, taken: Callable[[int], bool]) -> list[Loss]:
        """What a close loses: the reports whose base the next round no longer takes (``taken(base)``)."""
        return [
            Loss(a.trained[0], peer, a.trained[1])
            for peer, a in sorted(self.accounts.items())
            if a.trained is not None and not taken(a.trained[0])
        ]

    def forfeited(self, peer: str, loss: Loss | None) -> None:
        """``peer`` joined again or left, ``loss`` (its :meth:`forfeit`) is durable: what comes next
        is a new process's, which has delivered nothing yet."""
        self.book([loss] if loss is not None else [])
        self._account(peer).delivered = -1

    def book(self, losses: list[Loss]) -> None:
        """``losses`` (from :meth:`lost` or :meth:`forfeit`) are durable: count them, once."""
        for loss in losses:
            account = self.accounts[loss.peer]
            account.lost += loss.samples
            if account.trained == (loss.round, loss.samples):
                account.trained = None

    def pending(self, peer: str) -> int:
        """Samples ``peer`` reported and no update carried yet: in flight, neither counted nor lost."""
        trained = self.accounts[peer].trained if peer in self.accounts else None
        return 0 if trained is None else trained[1]
