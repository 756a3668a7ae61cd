"""How soon a restarted reference-job peer takes part in a round again (issue 47).

    python bench/restart.py            # 2 peers, 3 restarts of peer-1, each after 3 more rounds
    python bench/restart.py --quick    # one restart: the smoke test

Bench/chaos.py's run (a ``syncserver serve --min-peers 2`` hub, ``train/finetune_gpt2.py`` peers
with a tiny GPT-2, GPT-2's tokenizer cut to 1,025 tokens, one torch thread each), but instead of
random kills: once the run has closed ``--after`` more rounds, peer-1 is SIGKILLed and its command
line started again at once. Per restart: seconds from the new process's start to the hub's
acknowledgement of its first update, the peer's own start-up line (each phase's end, seconds from
its start), the version it joined at and the round that took its first update (the target: the
same, the round open at its return). The peers' tokenized-data cache starts empty in the
benchmark's folder: the first incarnations fill it, the restarts read it, as on a real VM.
Results: a table on stdout and ``bench/results/restart-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import chaos  # bench/chaos.py: the hub and the peers' command line (it puts bench/ and the repo on sys.path)
import round as rb
from failures import wait
from wire import terminated_as_exit

from tests.smallvocab import small_vocab_data

parser = argparse.ArgumentParser(description="Seconds from a restarted peer's start to its first acknowledged update.")
parser.add_argument("--restarts", type=int, default=3, help="kills of peer-1, one after another")
parser.add_argument("--after", type=int, default=3, help="rounds closed between a peer's return and the next kill")
parser.add_argument("--data", type=Path, default=chaos.REPO.parent / "shared" / "data", help="offline imdb/, tokenizer")
parser.add_argument("--quick", action="store_true", help="one restart, after one round")
parser.add_argument("--out", type=Path, default=chaos.BENCH / "results", help="folder for the JSON")


def startup(log: Path) -> dict[str, float]:
    """The peer's ``start-up datasets 0.91, ..., joined 3.20 s`` line as phase -> seconds."""
    found = re.search(r"^start-up (.*) s$", log.read_text(errors="replace"), re.M) if log.exists() else None
    return {k: float(v) for k, v in (p.rsplit(" ", 1) for p in found.group(1).split(", "))} if found else {}


def main() -> None:
    args = parser.parse_args()
    if args.quick:
        args.restarts, args.after = 1, 1
    # chaos.Job's settings: its defaults, 2 peers, and steps enough that the run outlives the restarts
    # steps enough that the run outlives the restarts (a lone peer's round takes ~0.3 s); stopped after
    job_args = chaos.parser.parse_args(["--peers", "2", "--max-steps", "80000"])
    job_args.lease = job_args.lease or chaos.hub_default("lease_seconds")
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"2 peers, {args.restarts} restarts of peer-1; load {os.getloadavg()[0]:.2f}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    os.environ["WEIGHTSYNC_CACHE_DIR"] = str(work / "cache")  # empty: the first start tokenizes, restarts hit
    rows: list[dict[str, Any]] = []
    with terminated_as_exit():
        job = None
        try:
            job = chaos.Job(job_args, "restart", small_vocab_data(args.data, work / "data"), work)
            first = [job.start(peer) for peer in ("peer-0", "peer-1")]
            target = args.after - 1
            for _ in range(args.restarts):
                wait(lambda t=target: max(job.records.rounds(), default=-1) >= t, f"round {target}", 300)
                job.live("peer-1").send_signal(signal.SIGKILL)
                job.live("peer-1").wait()
                restarted = time.time()
                before = set(job.records.updates())  # the killed incarnation's may still come in
                folder = job.start("peer-1")

                def back(folder: Path = folder, before: set[tuple[int, str]] = before) -> list[int] | None:
                    if job.live("peer-1").poll() is not None:
                        raise RuntimeError(f"the restarted peer exited; see {folder / 'peer.log'}")
                    mine = [r for r, p in set(job.records.updates()) - before if p == "peer-1"]
                    return [min(mine)] if mine else None

                [round_] = wait(back, "the restarted peer's first acknowledged update", 300)
                acked = job.records.received(round_)["peer-1"]
                log = folder / "peer.log"
                row = {"join_version": chaos.joined_version(log), "first_round": round_, "startup": startup(log)}
                rows.append(row | {"start_to_ack_s": round(acked - restarted, 2)})
                print(json.dumps(rows[-1]), flush=True)
                target = round_ + args.after
            cold = startup(first[1] / "peer.log")
        finally:
            if job is not None:
                job.stop()
            shutil.rmtree(work, ignore_errors=True)
    phases = list(dict.fromkeys(k for line in (cold, *(r["startup"] for r in rows)) for k in line))
    lines = ["| start | " + " | ".join(phases) + " | first ack s | join version → its first round |",
             "|---" * (len(phases) + 3) + "|",
             "| cold (first) | " + " | ".join(f"{cold.get(k, 0):.2f}" for k in phases) + " | - | - |"]  # fmt: skip
    for i, r in enumerate(rows):
        cells = " | ".join(f"{r['startup'].get(k, 0):.2f}" for k in phases)
        went = f"{r['join_version']} → {r['first_round']}"
        lines.append(f"| restart {i} | {cells} | {r['start_to_ack_s']:.2f} | {went} |")
    table = "\n".join(lines)
    print(table)
    job_args.model, job_args.out = "tiny-gpt2", args.out
    rb.write_result("restart", job_args, started, {}, runs=rows, cold=cold, table=table)


if __name__ == "__main__":
    main()
