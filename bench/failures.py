"""One peer of N fails three ways on a real hub: what it costs the survivors, in seconds, and what it loses.

    sudo python bench/failures.py                                  # N = 3 and 8; SIGKILL, SIGSTOP, link cut
    sudo python bench/failures.py --peers 3 --kills sigkill --lease 10
    python bench/failures.py --quick --kills sigkill               # the smoke test: 3 peers, seconds

The issue's scenario (issue 36): a ``syncserver serve`` hub with ``--min-peers N`` (README's recipe)
and N SDK peers, each a process of its own (``tests/peer_proc.py``: the 66 kB bigram, a round's
"training" a sleep of ``--train-seconds``, so 8 peers fit on 2 cores). After ``--warmup`` rounds
with everybody, the victim (the last peer) holds back from round W while the others train and
submit; the instant the hub has recorded every survivor's update for round W, the victim fails:

- ``sigkill``: its process is SIGKILLed (an OOM kill, a preempted spot VM, a driver crash): its
  sockets close;
- ``sigstop``: SIGSTOPped (a hung machine): its sockets stay open, nothing more is sent;
- ``vanish``: its network namespace's link is cut at the switch (a VM gone from the network):
  nothing closes, nothing arrives. Needs ``ip netns`` (root); skipped and said so otherwise.

So the survivors are all waiting when it fails: the worst moment, and what they wait is what the
failure costs. Once round W has closed without it, the benchmark restarts it under its name (a
new process, as a supervisor would; for ``vanish`` with its link back) and the run goes on, each
peer let into a round (its ``go_<round>`` file) as soon as the one before closed, until the
restarted peer has been in a round and ``--after`` rounds have closed since W (or ``--give-up``
seconds after its join); then every peer is stopped. Every figure comes from the hub's own
records (its sqlite, read-only, and its log), on the hub's clock, the same machine's as the
benchmark's:

- **idle**: round W's close minus the last survivor's update received: what the survivors wait
  because of the failure (a round without one costs ``healthy``: the same figure over the
  warm-up rounds, measured side by side);
- **to first round**: the failure to round W's close: the first round without the victim;
- **restart**: the restart to the close of the first round it is a participant of, and that
  round against the version it joined at (0: the round open at its join; 1: the next);
- **lost**: acknowledged updates (the hub's update records, and every sync a peer saw return
  with its update in) that are not in their round's participants. Must be 0.
- **survivors' sync**: the longest ``sync()`` a survivor saw in round W, against a warm-up one.

With ``--netns`` (the default where ``ip netns add`` works) the hub and every peer run in
network namespaces of their own behind a bridge (bench/wire.py's :class:`~wire.Net`, named
``<prefix>-...`` with this process's pid), removed with every process in them in ``finally``
and on SIGTERM; ``--no-netns`` (or no root) runs everything on 127.0.0.1 and skips ``vanish``.
The hub's lease is ``--lease`` (default: the hub's own default), so that runs stay short; a round
that has not closed ``--give-up`` seconds after the failure is recorded as such, and the case
ends there. Results: a markdown table on stdout and ``bench/results/failures-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

import record  # noqa: E402 (bench/record.py: the targets table)
import round as rb  # noqa: E402 (bench/round.py: the hub process, the result file)
from wire import HUB_IP, Net, enter_netns, sh, terminated_as_exit  # noqa: E402 (the namespaces)

KILLS = ("sigkill", "sigstop", "vanish")
RUN = "failures"

# -----------------------------------------------------------------------------
# settings
parser = argparse.ArgumentParser(description="One peer of N killed three ways on a real hub.")
parser.add_argument("--peers", type=int, nargs="+", default=[3, 8], help="numbers of peers (N)")
parser.add_argument("--kills", nargs="+", choices=KILLS, default=list(KILLS), help="how the victim fails")
parser.add_argument("--lease", type=float, default=None, help="the hub's --lease-seconds (default: the hub's)")
parser.add_argument("--hub-flag", action="append", default=[], help="another flag for `syncserver serve`, e.g. =--x=1")
parser.add_argument("--train-seconds", type=float, default=1.0, help="each peer's 'training' per round (a sleep)")
parser.add_argument("--warmup", type=int, default=2, help="rounds with every peer before the failure")
parser.add_argument("--after", type=int, default=3, help="rounds after the failure's round, at least")
parser.add_argument("--give-up", type=float, default=150.0, help="seconds after the failure to wait for its round")
parser.add_argument("--netns", action=argparse.BooleanOptionalAction, default=None, help="default: where permitted")
parser.add_argument("--ns-prefix", default=None, help="namespace name prefix (default: unique per run)")
parser.add_argument("--quick", action="store_true", help="N = 3, lease 3 s, short rounds: the smoke test")
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")
parser.add_argument("--data-root", type=Path, default=None, help="where the hub's data dir goes")
parser.add_argument("--keep", action="store_true", help="keep the hubs' and peers' folders (logs, records)")


# -----------------------------------------------------------------------------
# the hub's records, read as it writes them
class Records:
    """The hub's sqlite, opened read-only (WAL: readers never block the hub's writes)."""

    def __init__(self, data_dir: Path, run: str = RUN) -> None:
        self.path, self.run = data_dir / "hub.sqlite3", run
        self._db: sqlite3.Connection | None = None

    def _query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        if self._db is None:
            if not self.path.exists():
                return []
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10)
        return self._db.execute(sql, params).fetchall()

    def received(self, round_: int) -> dict[str, float]:
        """Peer -> when the hub acknowledged its update for ``round_``."""
        rows = self._query("SELECT peer, received FROM updates WHERE run = ? AND round = ?", self.run, round_)
        return {peer: received for peer, received in rows}

    def updates(self) -> list[tuple[int, str]]:
        """Every acknowledged update: (round, peer)."""
        return [(r, p) for r, p in self._query("SELECT round, peer FROM updates WHERE run = ?", self.run)]

    def metrics(self) -> list[tuple[int, str, dict[str, Any]]]:
        """Every acknowledged update's metrics (its interval's PACE_KEYS among them): (round, peer, metrics)."""
        rows = self._query("SELECT round, peer, metrics FROM updates WHERE run = ?", self.run)
        return [(r, p, json.loads(m)) for r, p, m in rows]

    def rounds(self) -> dict[int, tuple[float, list[str]]]:
        """Round -> (closed, participants), of the rounds closed so far."""
        rows = self._query("SELECT round, closed, participants FROM rounds WHERE run = ?", self.run)
        return {r: (c, json.loads(p)) for r, c, p in rows}

    def idle(self, round_: int, victim: str | None = None) -> float:
        """Seconds between the last update of ``round_`` the hub acknowledged (of a peer other than
        ``victim``: a survivor's) and the round's close."""
        received = [t for peer, t in self.received(round_).items() if peer != victim]
        return self.rounds()[round_][0] - max(received)

    def lost(self, acked: Iterable[tuple[int, str]] = ()) -> list[tuple[int, str]]:
        """Acknowledged updates (the hub's records, and ``acked``: (round, peer) that peers saw
        acknowledged) missing from their round's participants, or whose round never closed."""
        rounds = self.rounds()
        return sorted((r, p) for r, p in set(self.updates()) | set(acked) if r not in rounds or p not in rounds[r][1])

    def ledger(self) -> dict[str, dict[str, int]]:
        """The hub's samples ledger (syncserver/core/ledger.py), per peer: ``acknowledged`` (its
        update records) and ``lost`` (reported trained, in no acknowledged update)."""
        peers: dict[str, dict[str, int]] = {}
        for kind, table in (("acknowledged", "updates"), ("lost", "lost")):
            for peer, n in self._query(f"SELECT peer, SUM(samples) FROM {table} WHERE run = ? GROUP BY peer", self.run):
                peers.setdefault(peer, {"acknowledged": 0, "lost": 0})[kind] = int(n)
        return peers

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def poll(condition: Any, timeout: float, every: float = 0.01) -> Any:
    """``condition()``'s first truthy value, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            return None
        time.sleep(every)
    return value


def wait(condition: Any, what: str, timeout: float) -> Any:
    """:func:`poll`, but TimeoutError naming ``what`` after ``timeout`` s."""
    value = poll(condition, timeout, every=0.05)
    if value is None:
        raise TimeoutError(f"{what}: not within {timeout:.0f} s")
    return value


# -----------------------------------------------------------------------------
# peers: tests/peer_proc.py processes, paced by go files
@dataclass
class Peer:
    """One incarnation of a peer: its process and the folder of its go files and events."""

    name: str
    folder: Path
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.time)

    def events(self, kind: str) -> list[dict[str, Any]]:
        path = self.folder / f"{self.name}.jsonl"
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return [e for e in lines if e["event"] == kind]

    def sync_seconds(self, round_: int) -> float | None:
        """Its ``sync()`` of ``round_``, from the call to the return."""
        start = [e["t"] for e in self.events("syncing") if e["round"] == round_]
        end = [e["t"] for e in self.events("synced") if e["round"] == round_]
        return end[0] - start[0] if start and end else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # a SIGSTOPped process dies of SIGKILL too
        self.proc.wait()


def allow(folder: Path, through: int) -> None:
    """Let the peer of ``folder`` start every round up to ``through`` (its ``go_<round>`` files)."""
    for round_ in range(through + 1):
        (folder / f"go_{round_}").touch(exist_ok=True)


class Peers:
    """The peer processes of one hub; with ``net``, peer k in namespace ``net.peers[k]``."""

    def __init__(self, url: str, train_seconds: float, work: Path, net: Net | None) -> None:
        self.url, self.train_seconds, self.work, self.net = url, train_seconds, work, net
        self.all: list[Peer] = []  # every incarnation, in start order
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def start(self, k: int, go_through: int) -> Peer:
        """Peer ``k``'s next incarnation, free to train rounds up to ``go_through``."""
        name = f"p{k}"
        folder = self.work / f"{name}-{sum(p.name == name for p in self.all)}"
        folder.mkdir(parents=True)
        allow(folder, go_through)
        command = [sys.executable, str(REPO / "tests" / "peer_proc.py"), "--hub", self.url, "--run", RUN,
                   "--peer", name, "--seed", str(k), "--until-version", "100000", "--out", str(folder),
                   "--train-seconds", str(self.train_seconds), "--go-files"]  # fmt: skip
        ns = self.net.peers[k] if self.net is not None else None
        with open(folder / "peer.log", "wb") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                preexec_fn=(lambda: enter_netns(ns)) if ns else None,
            )
        peer = Peer(name, folder, proc)
        self.all.append(peer)
        return peer

    def latest(self, name: str) -> Peer:
        return [p for p in self.all if p.name == name][-1]

    def stop(self) -> None:
        for peer in self.all:
            peer.stop()


# -----------------------------------------------------------------------------
# one case: N peers, one failure
def fail(kind: str, victim: Peer, net: Net | None, k: int) -> None:
    if kind == "sigkill":
        os.kill(victim.proc.pid, signal.SIGKILL)
    elif kind == "sigstop":
        os.kill(victim.proc.pid, signal.SIGSTOP)
    else:
        assert net is not None
        sh("ip", "-n", net.sw, "link", "set", f"vp{k}", "down")  # the cable, at the switch: nothing is told


def gone_reason(log: Path, name: str) -> str | None:
    """The reason the hub's log gives for ``name`` being gone (``peer_gone ... reason=...``)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = re.search(rf"peer_gone run={RUN} peer={name} reason=(\S+)", text)
    return found.group(1) if found else None


def run_case(args: argparse.Namespace, n: int, kind: str, net: Net | None, work: Path) -> dict[str, Any]:
    """A hub and N peers; the victim fails before round ``--warmup``, restarted once it closed."""
    folder = work / f"n{n}-{kind}"
    folder.mkdir(parents=True)
    data_dir = folder / "hub"
    host = HUB_IP if net is not None else "127.0.0.1"
    command = ["-m", "syncserver", "serve", "--host", host, "--data-dir", str(data_dir), "--min-peers", str(n),
               "--log-level", "warning", "--lease-seconds", str(args.lease), *args.hub_flag]  # fmt: skip
    hub = rb.Server(command, folder / "hub.log", prefix=["ip", "netns", "exec", net.hub] if net is not None else [])
    records = Records(data_dir)
    w, k = args.warmup, n - 1
    survivors = [f"p{j}" for j in range(k)]
    peers = Peers(hub.url, args.train_seconds, folder, net)  # the benchmark ends the run (pace), not they
    row: dict[str, Any] = {"peers": n, "kill": kind, "failure_round": w, "lease": args.lease}
    try:
        for j in range(n):  # the victim may train the warm-up rounds only
            peers.start(j, w - 1 if j == k else w)
        # polled often: the kill follows the last survivor's update within ~10 ms, idle is measured from it
        if poll(lambda: set(survivors) <= set(records.received(w)), 120 + 10 * n, every=0.005) is None:
            raise TimeoutError(f"the survivors' updates of round {w} did not all come; see {folder}")
        victim = peers.latest(f"p{k}")
        killed = time.time()
        fail(kind, victim, net, k)
        if poll(lambda: w in records.rounds(), args.give_up) is None:
            row["gave_up_after_s"] = args.give_up  # still open: the case ends here
            row["gone_reason"] = gone_reason(folder / "hub.log", victim.name)
            return row
        victim.stop()
        if kind == "vanish":
            assert net is not None
            sh("ip", "-n", net.sw, "link", "set", f"vp{k}", "up")
        restarted = peers.start(k, w + 1)
        end = pace(args, records, [*(peers.latest(s) for s in survivors), restarted], restarted.name)
        bad = [p.name for p in peers.all if p is not victim and p.proc.poll() is not None]
        if bad:
            raise RuntimeError(f"peers {bad} ended early: see {folder}/*/peer.log")
        row["last_round"] = end
        return measure(row, records, peers, folder / "hub.log", killed, restarted, survivors)
    finally:
        peers.stop()
        hub.stop()
        records.close()


def pace(args: argparse.Namespace, records: Records, live: list[Peer], name: str) -> int:
    """Keep the ``live`` peers free to start the round after the last closed one, until peer
    ``name`` (restarted) has been a participant of a round and ``--after`` rounds have closed
    since the failure, or for ``--give-up`` seconds after its join. Returns the last round."""
    w = args.warmup
    deadline: float | None = None
    while True:
        rounds = records.rounds()
        latest = max(rounds)
        back = any(name in who for r, (_, who) in rounds.items() if r > w)
        if deadline is None and live[-1].events("joined"):
            deadline = time.monotonic() + args.give_up
        if (back and latest >= w + args.after) or (deadline is not None and time.monotonic() > deadline):
            break
        for peer in live:
            allow(peer.folder, latest + 1)
        time.sleep(0.01)
    return latest  # the last round they were let into: closed; they wait for a go that never comes


def measure(
    row: dict[str, Any],
    records: Records,
    peers: Peers,
    hub_log: Path,
    killed: float,
    restarted: Peer,
    survivors: list[str],
) -> dict[str, Any]:
    """The case's figures from the hub's records (see the module docstring)."""
    rounds = records.rounds()
    w, name = row["failure_round"], restarted.name
    warm = range(1, w) if w > 1 else range(w)  # round 0 waits for every peer's start too
    first_of = {s: peers.all[int(s[1:])] for s in survivors}  # the survivors' only incarnation
    row.update(
        victim_in_failure_round=name in rounds[w][1],
        gone_reason=gone_reason(hub_log, name),
        to_first_round_s=rounds[w][0] - killed,
        idle_s=records.idle(w, name),
        healthy_idle_s=statistics.median(records.idle(r) for r in warm),
        survivor_sync_s=max(p.sync_seconds(w) or 0.0 for p in first_of.values()),
        healthy_sync_s=statistics.median(p.sync_seconds(r) or 0.0 for p in first_of.values() for r in warm),
    )
    (joined,) = restarted.events("joined")
    mine = sorted(r for r, (_, who) in rounds.items() if name in who and r >= joined["version"])
    row.update(
        restart_join_s=joined["t"] - restarted.started,
        join_version=joined["version"],
        first_round=mine[0] if mine else None,
        rounds_after_join=mine[0] - joined["version"] if mine else None,
        restart_to_first_round_s=rounds[mine[0]][0] - restarted.started if mine else None,
    )
    row["back_next_round"] = row["rounds_after_join"] is not None and row["rounds_after_join"] <= 1
    # Acknowledged: the hub's update records, and every sync a peer saw come back with its update in.
    seen = {(e["round"], p.name) for p in peers.all for e in p.events("synced") if not e["caught_up"]}
    lost = records.lost(seen)
    row.update(acked=len(set(records.updates()) | seen), lost=len(lost), lost_updates=[f"{p}@{r}" for r, p in lost])
    return row


# -----------------------------------------------------------------------------
# targets and the table
def check_targets(rows: list[dict[str, Any]], lease: float) -> list[dict[str, Any]]:
    """The issue's goals, one line per case and goal."""
    targets = []
    for r in rows:
        case = f"N={r['peers']} {r['kill']}"
        limit = 2.0 if r["kill"] == "sigkill" else lease
        idle = r.get("idle_s")
        value = f"{idle:.2f} s" if idle is not None else f"round still open after {r['gave_up_after_s']:.0f} s"
        targets.append({"target": f"{case}: survivors' idle", "value": value, "threshold": f"<= {limit:g} s",
                        "met": idle is not None and idle <= limit})  # fmt: skip
        if idle is None:
            continue
        after = r["rounds_after_join"]
        targets.append({"target": f"{case}: restarted peer's first round", "threshold": "the next round (<= 1)",
                        "value": "never" if after is None else f"{after} after its join",
                        "met": r["back_next_round"]})  # fmt: skip
        targets.append({"target": f"{case}: acknowledged updates lost", "value": f"{r['lost']} of {r['acked']}",
                        "threshold": "0", "met": r["lost"] == 0})  # fmt: skip
    return targets


def cell(value: float | None) -> str:
    """Seconds for a table: two decimals, or - where not measured."""
    return "-" if value is None else f"{value:.2f}"


def markdown(rows: list[dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    lines = [
        "| N | failure | gone as | idle s (healthy) | to first round without it s | survivors' sync s (healthy) "
        "| restart → its first round s (join s) | its first round - join version | lost / acked |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("idle_s") is None:
            lines.append(f"| {r['peers']} | {r['kill']} | {r.get('gone_reason') or '-'} | round open after "
                         f"{r['gave_up_after_s']:.0f} s | - | - | - | - | - |")  # fmt: skip
            continue
        lines.append(
            f"| {r['peers']} | {r['kill']} | {r['gone_reason'] or '-'} "
            f"| {cell(r['idle_s'])} ({cell(r['healthy_idle_s'])}) "
            f"| {cell(r['to_first_round_s'])} | {cell(r['survivor_sync_s'])} ({cell(r['healthy_sync_s'])}) "
            f"| {cell(r['restart_to_first_round_s'])} ({cell(r['restart_join_s'])}) | {r['rounds_after_join']} "
            f"| {r['lost']} / {r['acked']} |"
        )
    lines += ["", *record.targets_table(targets)]
    return "\n".join(lines)


def hub_default(setting: str) -> Any:
    """The default of one of the hub's settings (what ``syncserver serve`` uses unless told)."""
    from syncserver.settings import HubSettings

    return HubSettings.model_fields[setting].default


def netns_permitted(prefix: str) -> str | None:
    """None where ``ip netns add`` works here, else why not."""
    probe = subprocess.run(["ip", "netns", "add", f"{prefix}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return probe.stderr.strip() or f"ip netns add: exit {probe.returncode}"
    sh("ip", "netns", "del", f"{prefix}-probe")
    return None


def main() -> None:
    args = parser.parse_args()
    if args.quick:
        args.peers = [3] if args.peers == parser.get_default("peers") else args.peers
        args.lease = args.lease or 3.0
        args.train_seconds, args.warmup, args.after, args.give_up = 0.3, 1, 2, 30.0
    if args.warmup < 1 or args.after < 1 or min(args.peers) < 2:
        parser.error("--warmup and --after must be >= 1, every N >= 2")
    args.lease = args.lease or hub_default("lease_seconds")
    started = datetime.datetime.now(datetime.timezone.utc)
    args.ns_prefix = args.ns_prefix or f"wsf{os.getpid()}"
    skipped: dict[str, str] = {}
    why = netns_permitted(args.ns_prefix) if args.netns is not False else "--no-netns"
    if args.netns and why:
        parser.error(f"--netns: {why}")
    kills = args.kills
    if why and "vanish" in kills:
        skipped["vanish"] = f"needs `ip netns add`: {why}"
        kills = [kind for kind in kills if kind != "vanish"]
        print(f"vanish: skipped, {skipped['vanish']}", flush=True)
    print(f"lease {args.lease:g} s; {'namespaces ' + args.ns_prefix + '-*' if not why else 'loopback'}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench-failures-", dir=args.data_root))
    rows: list[dict[str, Any]] = []
    with terminated_as_exit():
        try:
            for n in args.peers:
                net = Net(args.ns_prefix, n) if not why else None
                try:
                    if net is not None:
                        net.up()
                    for kind in kills:
                        rows.append(run_case(args, n, kind, net, work))
                        print(json.dumps(rows[-1]), flush=True)
                finally:
                    if net is not None:
                        net.down()
        finally:
            if args.keep:
                print(f"kept {work}", flush=True)
            else:
                shutil.rmtree(work, ignore_errors=True)
    targets = check_targets(rows, args.lease)
    table = markdown(rows, targets)
    print(table)
    schema = {"embed.weight": (256, 32), "head.weight": (256, 32), "head.bias": (256,)}  # tests.models.Bigram
    args.model = "bigram"
    rb.write_result("failures", args, started, schema, namespaces=None if why else args.ns_prefix,
                    rows=rows, skipped=skipped, targets=targets, table=table)  # fmt: skip


if __name__ == "__main__":
    main()
