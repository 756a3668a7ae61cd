"""The reference job with a random peer SIGKILLed, or preempted, every few rounds: what the run ends
at, what it lost.

    python bench/chaos.py                      # 4 peers, tiny GPT-2, 80 rounds, a kill every 8, against a calm run
    python bench/chaos.py --variants preempt   # the same, each kill a preemption with notice
    python bench/chaos.py --quick              # the smoke test: 2 peers, one kill, no calm run

``train/finetune_gpt2.py`` as users run it on separate machines: a ``syncserver serve`` hub with
``--min-peers N`` (README's recipe) and N peer processes with ``--hub``, each in a folder of its
own (a random-init ``--model-config tiny`` GPT-2, the offline IMDB in ``--data``, GPT-2's tokenizer
cut to 1,025 tokens as the tests cut it: :mod:`tests.smallvocab`; ``--max-steps`` per peer, a round
every ``--sync-every`` steps, one torch thread each). Two runs of the same seed, one after the other:

- **calm**: nothing fails;
- **chaos**: after every ``--kill-every`` rounds the benchmark picks a peer at random (its own
  ``--chaos-seed``), SIGKILLs it at a random point of the open round and at once starts the same
  command line again, as a supervisor would (same peer name, a new folder): the peer rejoins,
  catches up to the run's version and trains the steps the run has left. The next kill comes
  ``--kill-every`` rounds later, at a peer that is not restarting (a peer's own start takes as
  long here as a dozen rounds: several may be down at once; one at least stays), and only while
  the run has rounds enough left for a restart (as many as the peers' own start took, and two more; ``--quick``
  kills after round 0 whatever is left: a peer back after the run's end says so, ``ended_first``).
- **preempt** (``--variants preempt``): the same, but each kill is a spot VM's end with notice:
  SIGTERM (the peer hands in its steps since its last sync and leaves: syncclient.preemption),
  then SIGKILL if it still runs ``--notice`` seconds later; then the restart.

Each run ends with every peer's validation perplexity (identical: the peers end on the hub's
last version), compared between the runs (target: within 1%). The hub's records give, per kill:
the first round after the victim's last acknowledged update (its update may have gone in before
it died), and in it the **survivors' idle** (its close minus the last survivor's update: what they
waited for the victim, or for its restart if it came back in time; the calm run's median of the
same is beside it), the time from the kill to that round's close, the restarted peer's time to its
first round and how many rounds after its join that was; and per run **acknowledged updates
lost** (an update record whose round closed without it: must be 0) and the hub's **samples
ledger** (samples acknowledged, and samples the peers reported training that no acknowledged
update carried: what each SIGKILL cost, per peer under ``ledger``).
Results: a markdown table on stdout and ``bench/results/chaos-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

import record  # noqa: E402 (bench/record.py: the targets table)
import round as rb  # noqa: E402 (bench/round.py: the hub process, the result file)
from failures import Records, cell, hub_default  # noqa: E402 (the hub's records, read as it writes them)
from wire import terminated_as_exit  # noqa: E402

from syncclient.preemption import EXIT_CODE  # noqa: E402
from tests.smallvocab import small_vocab_data  # noqa: E402

RUN = "chaos"

# -----------------------------------------------------------------------------
# settings
parser = argparse.ArgumentParser(description="The reference job with a random peer SIGKILLed every few rounds.")
parser.add_argument("--peers", type=int, default=4, help="peer processes (N)")
parser.add_argument("--kill-every", type=int, default=8, help="rounds between kills")
parser.add_argument("--chaos-seed", type=int, default=0, help="which peer dies, and when")
parser.add_argument("--max-kills", type=int, default=None, help="at most this many kills (default: no limit)")
parser.add_argument(
    "--variants", nargs="+", choices=("sigkill", "preempt"), default=["sigkill", "preempt"], help="runs with kills"
)
parser.add_argument("--notice", type=float, default=30.0, help="preempt: seconds from SIGTERM to SIGKILL")
parser.add_argument("--lease", type=float, default=None, help="the hub's --lease-seconds (default: the hub's)")
parser.add_argument("--hub-flag", action="append", default=[], help="another flag for `syncserver serve`, e.g. =--x=1")
parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True, help="the calm run too")
parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data", help="offline imdb/, gpt2-tokenizer/")
g = parser.add_argument_group("the reference job's flags")
g.add_argument("--seed", type=int, default=1234, help="the job's --seed, shared by both runs")
g.add_argument("--max-steps", type=int, default=640, help="optimizer steps per peer")
g.add_argument("--sync-every", type=int, default=8)
g.add_argument("--batch-size", type=int, default=32, help="global batch in blocks")
g.add_argument("--lr", type=float, default=2e-3)
g.add_argument("--train-samples", type=int, default=400)
g.add_argument("--val-samples", type=int, default=20)
g.add_argument("--test-samples", type=int, default=10)
parser.add_argument("--quick", action="store_true", help="2 peers, 6 rounds, one kill, no calm run: the smoke test")
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")
parser.add_argument("--data-root", type=Path, default=None, help="where the runs' folders go")


class Job:
    """One run of the reference job: a hub and its peer processes, each incarnation in a folder."""

    def __init__(self, args: argparse.Namespace, name: str, data: Path, work: Path) -> None:
        self.args, self.name, self.data = args, name, data
        self.folder = work / name
        self.folder.mkdir(parents=True)
        command = ["-m", "syncserver", "serve", "--data-dir", str(self.folder / "hub"), "--min-peers", str(args.peers),
                   "--log-level", "warning", "--lease-seconds", str(args.lease), *args.hub_flag]  # fmt: skip
        self.hub = rb.Server(command, self.folder / "hub.log")
        self.records = Records(self.folder / "hub", RUN)
        self.incarnations: list[tuple[str, Path, subprocess.Popen[bytes], float]] = []  # peer, folder, proc, started
        self.started = time.time()

    def start(self, peer: str) -> Path:
        """``peer``'s next incarnation: the same command line, a new folder."""
        a = self.args
        folder = self.folder / f"{peer}-{sum(p == peer for p, *_ in self.incarnations)}"
        command = [sys.executable, str(REPO / "train" / "finetune_gpt2.py"), "--hub", self.hub.url, "--run", RUN,
                   "--peer", peer, "--output-dir", str(folder), "--model-config", "tiny",
                   "--dataset", str(self.data / "imdb"), "--tokenizer", str(self.data / "gpt2-tokenizer"),
                   "--train-samples", str(a.train_samples), "--val-samples", str(a.val_samples),
                   "--test-samples", str(a.test_samples), "--max-steps", str(a.max_steps),
                   "--sync-every", str(a.sync_every), "--eval-every", "0", "--batch-size", str(a.batch_size),
                   "--lr", str(a.lr), "--seed", str(a.seed), "--threads", "1"]  # fmt: skip
        folder.mkdir()
        env = os.environ | {"WEIGHTSYNC_PREEMPTION": "sigterm"}  # no cloud here: SIGTERM is the notice
        with open(folder / "peer.log", "wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self.incarnations.append((peer, folder, proc, time.time()))
        return folder

    def live(self, peer: str) -> subprocess.Popen[bytes]:
        return [proc for p, _, proc, _ in self.incarnations if p == peer][-1]

    def settled(self, peer: str, rounds: dict[int, tuple[float, list[str]]]) -> bool:
        """``peer``'s last incarnation runs and has been a participant of a round since its join."""
        folder, proc = [(f, proc) for p, f, proc, _ in self.incarnations if p == peer][-1]
        join = joined_version(folder / "peer.log")
        return proc.poll() is None and join is not None and any(r >= join and peer in rounds[r][1] for r in rounds)

    def running(self) -> bool:
        return any(proc.poll() is None for *_, proc, _ in self.incarnations)

    def stop(self) -> None:
        for _, _, proc, _ in self.incarnations:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.hub.stop()
        self.records.close()

    def finals(self) -> dict[str, dict[str, Any]]:
        """Each peer's ``results.json``: of its last incarnation that finished."""
        done = {p: f / "results.json" for p, f, _, _ in self.incarnations if (f / "results.json").exists()}
        return {p: json.loads(path.read_text()) for p, path in done.items()}


def ended_first(folder: Path) -> bool:
    """The incarnation found the run past its last step (the others ended before it was back)."""
    log = folder / "peer.log"
    return log.exists() and "past the" in log.read_text(errors="replace")


def restart_rounds(job: Job, rounds: dict[int, tuple[float, list[str]]]) -> int:
    """Rounds that pass while a peer starts: the peers' own start (to round 0's close) over a round."""
    typical = statistics.median(rounds[r][0] - rounds[r - 1][0] for r in rounds if r - 1 in rounds)
    return math.ceil((rounds[0][0] - job.started) / max(typical, 0.1))


def joined_version(log: Path) -> int | None:
    """The version a peer joined at (its log's ``joined as ... version V``)."""
    found = re.search(r"joined as .*?, version (\d+)", log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1)) if found else None


def run_job(args: argparse.Namespace, name: str, data: Path, work: Path, kills: bool) -> dict[str, Any]:
    """One run; with ``kills``, the chaos (module docstring; ``name`` says how a peer dies). Its
    figures, from the hub's records."""
    job = Job(args, name, data, work)
    peers = [f"peer-{k}" for k in range(args.peers)]
    rng = random.Random(args.chaos_seed)
    last_round = -(-args.max_steps // args.sync_every) - 1
    failures: list[dict[str, Any]] = []
    try:
        for peer in peers:
            job.start(peer)
        next_kill = args.kill_every - 1  # kill once this round has closed
        deadline = time.monotonic() + 60 * 30
        while job.running():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: still running after 30 min; see {job.folder}")
            rounds = job.records.rounds()
            latest = max(rounds, default=-1)
            # a kill in round latest+1 leaves the rounds a restart takes (as long as the peers' start
            # took, at the pace of the rounds so far; --quick: none) and two more
            margin = 0 if args.quick or latest < 1 else restart_rounds(job, rounds)
            settled = [p for p in peers if job.settled(p, rounds)]  # a restarted one once it is back
            more = args.max_kills is None or len(failures) < args.max_kills
            if kills and more and latest >= next_kill and latest + 3 + margin <= last_round and len(settled) >= 2:
                failures.append(kill(job, rng, settled, rounds, notice=args.notice if name == "preempt" else None))
                next_kill = latest + args.kill_every
                continue
            time.sleep(0.05)
        bad = [
            folder
            for _, folder, proc, _ in job.incarnations
            if proc.returncode not in (0, -signal.SIGKILL, EXIT_CODE) and not ended_first(folder)
        ]
        if bad:
            tail = (bad[0] / "peer.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name}: {len(bad)} peers failed; {bad[0].name}'s log ends:\n{tail}")
        rounds = job.records.rounds()
        finals = job.finals()
        ppl = {p: r["final_val_ppl"] for p, r in finals.items()}
        lost = job.records.lost()
        ledger = job.records.ledger()
        healthy = [job.records.idle(r) for r in rounds if r > 0 and len(rounds[r][1]) == args.peers]
        return {
            "run": name,
            "wall_s": time.time() - job.started,
            "rounds": len(rounds),
            "final_version": max(rounds) + 1,
            "final_val_ppl": statistics.fmean(ppl.values()),
            "val_ppl_identical": len(set(ppl.values())) == 1,
            "final_test_ppl": statistics.fmean(r["final_test_ppl"] for r in finals.values()),
            "healthy_idle_s": statistics.median(healthy) if healthy else None,
            "acked": len(job.records.updates()),
            "lost": len(lost),
            "lost_updates": [f"{p}@{r}" for r, p in lost],
            "samples_acknowledged": sum(p["acknowledged"] for p in ledger.values()),
            "samples_lost": sum(p["lost"] for p in ledger.values()),
            "ledger": ledger,
            "failures": [measure(job, f) for f in failures],
        }
    finally:
        job.stop()


@dataclass
class Failure:
    victim: str
    killed: float
    last: int  # the round of its last update acknowledged before it died (-1: none)
    restarted: float
    folder: Path  # its new incarnation's
    exit_code: int | None  # how it ended: 143 a preempted peer that handed in and left, -9 SIGKILL


def kill(
    job: Job, rng: random.Random, settled: list[str], rounds: dict[int, tuple[float, list[str]]], notice: float | None
) -> Failure:
    """SIGKILL one of the ``settled`` peers, at random, at a random point of the open round (with a
    ``notice``: SIGTERM, then SIGKILL if it still runs that many seconds later), and start it again
    at once, as a supervisor would."""
    durations = [rounds[r][0] - rounds[r - 1][0] for r in rounds if r - 1 in rounds]
    time.sleep(rng.uniform(0.0, 0.9) * (statistics.median(durations) if durations else 1.0))
    victim = rng.choice(settled)
    killed, proc = time.time(), job.live(victim)
    if notice is not None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(notice)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    restarted = time.time()
    folder = job.start(victim)
    last = max((r for r, p in job.records.updates() if p == victim), default=-1)
    return Failure(victim, killed, last, restarted, folder, proc.returncode)


def measure(job: Job, f: Failure) -> dict[str, Any]:
    """A kill's figures: the first round after the victim's last acknowledged update (its update may
    have gone in before it died: that round holds it), the survivors' idle in it, and the new
    incarnation's first round."""
    got = job.records.rounds()
    first = next((r for r in sorted(got) if r > f.last and got[r][0] > f.killed), None)
    join = joined_version(f.folder / "peer.log")
    again = next((r for r in sorted(got) if join is not None and r >= join and f.victim in got[r][1]), None)
    hit = max((r for r in got if got[r][0] <= f.killed), default=-1) + 1  # the round open at the kill
    # the survivors' idle: the worst of the rounds from the one the kill hit to the first without the
    # victim's last update (a preempted peer's hand-in goes into the first)
    idle = [job.records.idle(r, f.victim) for r in range(hit, first + 1) if r in got] if first is not None else []
    return {
        "victim": f.victim,
        "exit_code": f.exit_code,
        "killed_in_round": hit,
        "acknowledged_before": f.last == hit,
        "first_round_after": first,
        "restarted_in_it": first is not None and f.victim in got[first][1],
        "idle_s": max(idle) if idle else None,
        "to_first_round_s": got[first][0] - f.killed if first is not None else None,
        "join_version": join,
        "back_round": again,
        "restart_to_first_round_s": got[again][0] - f.restarted if again is not None else None,
        "rounds_after_join": again - join if again is not None and join is not None else None,
        "ended_first": ended_first(f.folder),
    }


def markdown(runs: list[dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    lines = ["| run | rounds | val ppl | test ppl | wall s | idle s per kill (healthy median) | lost / acked "
             "| samples lost / acknowledged |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        idle = ", ".join(cell(f["idle_s"]) for f in r["failures"]) or "-"
        healthy = "-" if r["healthy_idle_s"] is None else f"{r['healthy_idle_s']:.2f}"
        lines.append(f"| {r['run']} | {r['rounds']} | {r['final_val_ppl']:.3f} | {r['final_test_ppl']:.3f} | "
                     f"{r['wall_s']:.0f} | {idle} ({healthy}) | {r['lost']} / {r['acked']} "
                     f"| {r['samples_lost']:,} / {r['samples_acknowledged']:,} |")  # fmt: skip
    for chaos in (r for r in runs if r["failures"]):
        lines += ["", f"{chaos['run']}:", "", "| kill | victim (exit) | in round (its update in) | first round "
                  "after its last update (restarted peer in it) | idle s | kill → that round s "
                  "| restart → its first round s | its first round - join version |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for i, f in enumerate(chaos["failures"]):
            restart = cell(f["restart_to_first_round_s"])
            after = "the run ended first" if f["ended_first"] else f["rounds_after_join"]
            lines.append(f"| {i} | {f['victim']} ({f['exit_code']}) | {f['killed_in_round']} "
                         f"({'yes' if f['acknowledged_before'] else 'no'}) | {f['first_round_after']} "
                         f"({'yes' if f['restarted_in_it'] else 'no'}) | "
                         f"{cell(f['idle_s'])} | {cell(f['to_first_round_s'])} | {restart} "
                         f"| {after} |")  # fmt: skip
    lines += ["", *record.targets_table(targets)]
    return "\n".join(lines)


def check_targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    calm = next((r for r in runs if r["run"] == "calm"), None)
    targets = []
    for chaos in (r for r in runs if r["run"] != "calm"):
        how = chaos["run"]
        targets.append({"target": f"{how}: acknowledged updates lost", "value": f"{chaos['lost']} of {chaos['acked']}",
                        "threshold": "0", "met": chaos["lost"] == 0 and chaos["val_ppl_identical"]})  # fmt: skip
        if how == "preempt":  # each victim handed in what it trained: the ledger has lost nothing
            lost, trained = chaos["samples_lost"], chaos["samples_lost"] + chaos["samples_acknowledged"]
            targets.append({"target": "preempt: samples lost (the ledger)", "value": f"{lost:,} of {trained:,}",
                            "threshold": "0", "met": lost == 0})  # fmt: skip
        idle = [f["idle_s"] for f in chaos["failures"] if f["idle_s"] is not None]
        if idle and how == "preempt":  # a healthy round's idle and 0.2 s more
            bound = (calm or chaos)["healthy_idle_s"] + 0.2
            targets.append({"target": "preempt: survivors' idle per preemption", "value": f"max {max(idle):.2f} s",
                            "threshold": f"<= {bound:.2f} s (healthy + 0.2 s)", "met": max(idle) <= bound})  # fmt: skip
        elif idle:
            targets.append({"target": "sigkill: survivors' idle per SIGKILL", "value": f"max {max(idle):.2f} s",
                            "threshold": "<= 2 s", "met": max(idle) <= 2.0})  # fmt: skip
        if calm is not None:
            # a peer away while it restarts trains nothing: the rounds its absence cost, beside the gap
            gap, trained = chaos["final_val_ppl"] / calm["final_val_ppl"] - 1, f"{chaos['acked']} of {calm['acked']}"
            targets.append({"target": f"{how}: val perplexity against the calm run", "threshold": "within 1%",
                            "value": f"{gap:+.2%} ({chaos['final_val_ppl']:.3f} against {calm['final_val_ppl']:.3f}; "
                                     f"peer-rounds trained: {trained})",
                            "met": abs(gap) <= 0.01})  # fmt: skip
    return targets


def main() -> None:
    args = parser.parse_args()
    if args.quick:
        args.peers, args.max_steps, args.kill_every, args.baseline = 2, 6 * args.sync_every, 1, False
        args.max_kills = 1
        args.train_samples, args.lease = 100, args.lease or 3.0
    if args.peers < 2 or args.kill_every < 1 or args.max_steps < 4 * args.sync_every:
        parser.error("want --peers >= 2, --kill-every >= 1 and --max-steps of 4 rounds or more")
    if not (args.data / "imdb" / "train.parquet").exists():
        parser.error(f"--data {args.data}: no imdb/train.parquet there")
    args.lease = args.lease or hub_default("lease_seconds")
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"{args.peers} peers, {args.max_steps} steps, a round every {args.sync_every}; lease {args.lease:g} s; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench-chaos-", dir=args.data_root))
    runs: list[dict[str, Any]] = []
    with terminated_as_exit():
        try:
            data = small_vocab_data(args.data, work / "data")
            for name in (["calm"] if args.baseline else []) + args.variants:
                runs.append(run_job(args, name, data, work, kills=name != "calm"))
                print(json.dumps(runs[-1]), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    targets = check_targets(runs)
    table = markdown(runs, targets)
    print(table)
    args.model = "tiny-gpt2"
    rb.write_result("chaos", args, started, {}, runs=runs, targets=targets, table=table)


if __name__ == "__main__":
    main()
