"""Time to quality, measured end to end and scored off the clock: ``sudo python bench/ttq.py``.

    sudo python bench/ttq.py                      # 2 peers at 1 and 0.1 Gbit/s, seeds 1 2 3: ~2.5 h, 3+ cores
    sudo python bench/ttq.py --seeds 1 --links 1gbit --lr-scalings sqrt     # one column: ~25 min
    sudo python bench/ttq.py --quick --ignore-load  # the smoke test: ~1 min (a random tiny GPT-2, small vocab)

Users rent N machines to get the model one machine would give, sooner. This runs the reference job
(``train/finetune_gpt2.py``) both ways, each process with one torch thread on a core of its own
(``taskset``; it says when the machine has too few cores), and measures the **wall time from launch
until the run's model first reaches serial's final validation perplexity**:

- **serial**: ``--no-hub --threads 1``, one epoch, saving its weights with their time every
  ``--check-every`` steps (``--save-every``); **the target** is its final validation perplexity
  smoothed (the least-squares line through its last ``--smooth`` checks, at the last), **its time** the
  launch to its last checkpoint. It runs before and after each seed's peers (serial, peers, serial), so
  that drift of the machine shows; the ratios use the mean of the two.
- **peers**: a real hub (``python -m syncserver serve --keep-versions 10000``: it keeps every version,
  and its sqlite each round's ``closed`` time) in a network namespace, N peers in namespaces of their own,
  each behind its own ``tbf`` link both ways (``bench/wire.py``), shaped from the start. Each peer keeps
  serial's per-device batch, as users do (the global batch grows with N; the rate per ``--lr-scaling``,
  a grid run on the first seed at the first link; the soonest is used everywhere else), up to
  ``--max-epochs``. **The equal-global-batch** regime (each peer 1/N of serial's batch, ``--lr-scaling
  none``) runs beside it at every link. A version's time is its round's commit minus the launch.

Nothing is evaluated while the clock runs (``--no-eval``): after each seed, evaluators (``--score``:
one process per run, in parallel) score serial's checkpoints and the hub's versions on the same
held-out reviews. Before each timed run the benchmark waits until the other processes' load (busy cores
by ``/proc/stat`` less its own processes') is at most ``--max-load`` (0.3; it refuses after
``--load-wait`` s unless ``--ignore-load``), and it gives the others' load during each run. Beside each
time, where the peers' time went (mean over peers, up to the version that reached the target): start-up
and join (the job's ``start-up`` line), compute, the stall on the training thread and the wait for
rounds (the updates' ``sync_host_s`` and ``sync_wait_s``, PACE_KEYS); a miss names its cause from these.

Regime: the ``tiny`` GPT-2 warm start of ``bench/pretrain.py`` (its exclusions widened to this set),
2,000 IMDB reviews (~29,000 blocks of 20 tokens: one serial epoch is ~900 steps of 32, 5-6 min on a
core at 0.4 s a step), Adam 3e-4 constant, 100 held-out validation reviews of the seed, a sync every 30 steps.
Namespaces ``<prefix>-...`` are removed in ``finally`` and on SIGTERM. Needs root (``ip netns``).
Results: markdown tables and ``bench/results/ttq-<date>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

import quality  # noqa: E402 (bench/quality.py: the warm start, the data)
import record  # noqa: E402 (bench/record.py: the result file, the targets table)
import wire  # noqa: E402 (bench/wire.py: namespaces, links, pinning)
from failures import Records  # noqa: E402 (the hub's sqlite, read-only)
from restart import startup  # noqa: E402 (the job's start-up line)

from tests.smallvocab import small_vocab_data  # noqa: E402

TRAIN = REPO / "train" / "finetune_gpt2.py"
COMMON = {"train-samples": 2000, "val-samples": 100, "test-samples": 8, "batch-size": 32, "lr": 3e-4}
QUICK = {"train-samples": 16, "val-samples": 4, "test-samples": 2, "batch-size": 8, "lr": 3e-4}
#: targets (issue 45): peers' time to serial's final perplexity over serial's time, on every seed
TARGETS = {2: {"1gbit": 0.60, "100mbit": 0.65}}
CLK = os.sysconf("SC_CLK_TCK")

parser = argparse.ArgumentParser(description="Time to serial's final perplexity, serial against N peers.")
parser.add_argument("--peers", type=int, default=2)
parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit"], help="each peer's link rate (tc spelling)")
parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
parser.add_argument("--lr-scalings", nargs="+", default=["none", "sqrt", "linear"], help="the per-device grid")
parser.add_argument("--sync-every", default="30", help="steps between syncs, or auto (the hub picks)")
parser.add_argument("--check-every", type=int, default=30, help="serial's checkpoints, in its steps")
parser.add_argument("--smooth", type=int, default=5, help="serial's last checks the target is fitted through")
parser.add_argument("--max-epochs", type=float, default=2.0, help="how far the peers train")
parser.add_argument("--max-load", type=float, default=0.3, help="other processes' load (busy cores) to start at")
parser.add_argument("--load-wait", type=float, default=600, help="seconds to wait for it before refusing")
parser.add_argument("--ignore-load", action="store_true", help="run whatever the load (smoke tests)")
parser.add_argument("--quick", action="store_true", help="a few steps of each, one seed, one link, one rate")
parser.add_argument("--ns-prefix", default=None, help="namespace name prefix (default: unique per run)")
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")


def job(common: dict[str, Any], model: Path | None, data: Path, out: Path, *extra: str) -> list[str]:
    """The reference job's command line, on the offline ``data`` folder and the warm start (None: a
    random tiny GPT-2)."""
    start = ["--model", str(model)] if model else ["--model-config", "tiny"]
    argv = [sys.executable, str(TRAIN), "--output-dir", str(out), *start, "--threads", "1"]
    argv += ["--dataset", str(data / "imdb"), "--tokenizer", str(data / "gpt2-tokenizer")]
    for flag, value in common.items():
        argv += [f"--{flag}", str(value)]
    return [*argv, *extra]


def busy() -> float:
    """CPU seconds the machine has been busy, all cores together (``/proc/stat``)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK  # less idle and iowait


class Load:
    """Other processes' load in busy cores: the machine's busy CPU time less this process's, its
    waited-for children's (serial, the peers) and the hub's, over the wall time since ``start``."""

    def __init__(self, hub_pid: int) -> None:
        self.hub_pid = hub_pid
        self.start()

    def ours(self) -> float:
        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        own = sum(r.ru_utime + r.ru_stime for r in usage)
        stat = Path(f"/proc/{self.hub_pid}/stat").read_text().rsplit(")", 1)[1].split()
        return own + (int(stat[11]) + int(stat[12])) / CLK  # utime, stime

    def start(self) -> None:
        self.t, self.busy, self.own = time.monotonic(), busy(), self.ours()

    def now(self) -> float:
        return max(0.0, (busy() - self.busy - (self.ours() - self.own)) / (time.monotonic() - self.t))

    def quiet(self, args: argparse.Namespace) -> float:
        """Wait until the others' load over 5 s is at most ``--max-load``; refuse after ``--load-wait``."""
        deadline = time.monotonic() + args.load_wait
        while True:
            self.start()
            time.sleep(0.5 if args.ignore_load else 5)
            others = self.now()
            if others <= args.max_load or args.ignore_load:
                self.start()  # the run's own figure counts from here
                return others
            if time.monotonic() > deadline:
                raise SystemExit(f"error: other processes' load {others:.2f} > --max-load {args.max_load} for "
                                 f"{args.load_wait:.0f} s: run on a quiet machine (or --ignore-load)")  # fmt: skip
            print(f"waiting: other processes' load {others:.2f} > {args.max_load}", flush=True)


def timed(load: Load, args: argparse.Namespace, commands: list[list[str]], logs: list[Path]) -> dict[str, Any]:
    """``commands`` launched together once the machine is quiet, and waited for: the launch time, the
    others' load before and during, each process's start-up phases (seconds from its start)."""
    before = load.quiet(args)
    launched = time.time()
    procs = []
    for command, log in zip(commands, logs, strict=True):
        log.parent.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO))
    for p, log in zip(procs, logs, strict=True):
        if p.wait() != 0:
            raise RuntimeError(f"{log.parent.name} exited {p.returncode}: {log.read_text()[-800:]}")
    return {"launched": launched, "load_before": before, "load": load.now(), "startup": [startup(g) for g in logs]}


def score(runs: list[dict[str, Any]], common: dict[str, Any], model: Path | None, data: Path, work: Path) -> None:
    """Each run's checkpoints (serial's) or kept versions (the hub's) on the held-out reviews, by the
    reference job's evaluator, one process a run, as many at once as there are cores; then deleted."""
    todo = [r for r in runs if "scores" not in r]
    cores = len(os.sched_getaffinity(0))
    for i in range(0, len(todo), cores):
        batch = todo[i : i + cores]
        procs = [subprocess.Popen(job(common | {"seed": r["seed"]}, model, data, work / "score" / r["name"], "--score",
                                      r["folder"]), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
                 for r in batch]  # fmt: skip
        for r, p in zip(batch, procs, strict=True):
            _, err = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"scoring {r['name']} exited {p.returncode}: {err.decode()[-800:]}")
            lines = (work / "score" / r["name"] / "scores.jsonl").read_text().splitlines()
            r["scores"] = [json.loads(line) for line in lines]
            shutil.rmtree(r.pop("folder"))


def serial_run(load: Load, args: argparse.Namespace, common: dict[str, Any], model: Path | None, data: Path,
               work: Path, seed: int, leg: str) -> dict[str, Any]:  # fmt: skip
    """Serial, one epoch, on the first core, checkpoints every ``--check-every`` steps, no evaluation;
    its time is the last one's (the second leg's checkpoints are not scored: the same bits, later)."""
    from safetensors import safe_open

    name = f"serial-{seed}{leg}"
    cpu = str(sorted(os.sched_getaffinity(0))[0])
    argv = ["taskset", "-c", cpu, *job(common | {"seed": seed}, model, data, work / name, "--no-hub", "--no-eval",
                                       "--epochs", "1", "--save-every", str(args.check_every))]  # fmt: skip
    run = {"name": name, "seed": seed, "leg": leg, **timed(load, args, [argv], [work / name / "log.txt"])}
    folder = work / name / "checkpoints"
    with safe_open(str(max(folder.glob("*.safetensors"))), "np") as last:
        run["time_s"] = float(last.metadata()["time"]) - run["launched"]
    if leg == "b":
        shutil.rmtree(folder)
        return run
    return run | {"folder": str(folder)}


def peers_run(load: Load, args: argparse.Namespace, common: dict[str, Any], model: Path | None, data: Path,
              work: Path, net: wire.Net, url: str, seed: int, regime: str, scaling: str,
              link: str) -> dict[str, Any]:  # fmt: skip
    """N peers of the job over ``link`` for ``--max-epochs``: each with serial's batch (``per-device``)
    or 1/N of it (``equal-batch``); its versions and their commit times are the hub's."""
    name = f"{regime}-{scaling}-{link}-s{seed}"
    batch = common["batch-size"] * (args.peers if regime == "per-device" else 1)
    cores = sorted(os.sched_getaffinity(0))
    flags = common | {"seed": seed, "batch-size": batch, "lr-scaling": scaling}
    extra = ["--hub", url, "--run", name, "--min-peers", str(args.peers), "--sync-every", args.sync_every,
             "--no-eval", "--epochs", str(args.max_epochs)]  # fmt: skip
    commands = [
        wire.in_ns(
            ns, str(cores[k % len(cores)]), *job(flags, model, data, work / name / f"p{k}", *extra, "--peer", f"p{k}")
        )
        for k, ns in enumerate(net.peers)
    ]
    net.shape(wire.Link("peer", link))
    try:
        run = timed(load, args, commands, [work / name / f"p{k}" / "log.txt" for k in range(args.peers)])
    finally:
        net.unshape()
    records = Records(work / "hub", name)
    try:
        closed = {r + 1: t for r, (t, _) in records.rounds().items()}  # version v+1 is round v's commit
        metrics = records.metrics()
    finally:
        records.close()
    folder = work / "hub" / "runs" / name / "versions"
    return {"name": name, "seed": seed, "regime": regime, "lr_scaling": scaling, "link": link, "peers": args.peers,
            "batch_per_peer": batch // args.peers, "closed": closed, "metrics": metrics, **run,
            "folder": str(folder)}  # fmt: skip


def serial_figures(a: dict[str, Any], b: dict[str, Any], k: int) -> dict[str, Any]:
    """A seed's target (A's final perplexity, smoothed over its last ``k`` checks) and time (the mean
    of A's and B's launch to last checkpoint)."""
    curve = [(int(s["step"]), float(s["time"]) - a["launched"], s["val_ppl"]) for s in a["scores"]]
    last = curve[-max(2, k) :]
    if len(last) > 1:
        slope, intercept = statistics.linear_regression([s for s, _, _ in last], [p for _, _, p in last])
        target = slope * last[-1][0] + intercept
    else:
        target = last[-1][2]
    times = [a["time_s"], b["time_s"]]
    started = statistics.fmean(r["startup"][0].get("model", 0.0) for r in (a, b))
    return {"seed": a["seed"], "target": target, "final_ppl": curve[-1][2], "steps": curve[-1][0],
            "time_s": statistics.fmean(times), "time_a_s": times[0], "time_b_s": times[1], "startup_s": started,
            "load": [a["load"], b["load"]], "curve": curve}  # fmt: skip


def peers_figures(
    run: dict[str, Any], serial: dict[str, Any], common: dict[str, Any], sync_every: str
) -> dict[str, Any]:
    """Time to ``serial``'s target, and where the peers' time went up to it (mean over peers): start-up
    (to the model built), join (to joined: the rendezvous), per sync the stall on the training thread
    and the wait for the round (the updates' PACE_KEYS), compute the rest of the intervals."""
    curve = [(int(Path(s["file"]).stem), run["closed"][v] - run["launched"], s["val_ppl"])
             for s in run["scores"] if (v := int(Path(s["file"]).stem)) in run["closed"]]  # fmt: skip
    reached = next((c for c in curve if c[2] <= serial["target"]), None)
    upto = reached[0] if reached else max(run["closed"], default=0)  # the updates of rounds < upto made it
    laps = [m for r, _, m in run["metrics"] if r < upto and "sync_seconds" in m]
    n = run["peers"]
    start = statistics.fmean(s.get("model", 0.0) for s in run["startup"])
    join = statistics.fmean(s.get("joined", 0.0) for s in run["startup"]) - start
    stall, wait = (sum(m[key] for m in laps) / n for key in ("sync_host_s", "sync_wait_s"))
    compute = sum(m["sync_seconds"] for m in laps) / n - stall - wait - join  # the first interval holds the join
    time_s = reached[1] if reached else None
    samples = upto * (int(sync_every) if sync_every.isdigit() else 0) * run["batch_per_peer"] * n
    row = {k: run[k] for k in ("name", "seed", "regime", "lr_scaling", "link", "peers", "batch_per_peer", "load")}
    row |= {"reached": reached is not None, "time_s": time_s, "x_serial": time_s / serial["time_s"] if time_s else None,
            "version": reached[0] if reached else None, "best_ppl": min((p for *_, p in curve), default=None),
            "samples_x_serial": samples / (serial["steps"] * common["batch-size"]) or None,
            "start_s": start, "join_s": join, "compute_s": compute, "stall_s": stall, "wait_s": wait,
            "syncs": len(laps) // n, "curve": curve}  # fmt: skip
    return row


def cause(row: dict[str, Any], serial: dict[str, Any], threshold: float) -> str:
    """What a miss is down to, from the figures beside its time: never reached; compute alone over the
    budget (the peers needed too many samples); else the largest overhead."""
    if not row["reached"]:
        return f"not reached in {row['syncs']} syncs (best {row['best_ppl']:.2f} against {serial['target']:.2f})"
    budget = threshold * serial["time_s"]
    if row["x_serial"] <= threshold:
        return ""
    if row["compute_s"] > budget:
        samples = _x(row["samples_x_serial"], "{:.2f}")
        return f"compute: {row['compute_s']:.0f} s > the {budget:.0f} s budget ({samples}x serial's samples)"
    costs = {"start-up and join": row["start_s"] + row["join_s"], "stall on the training thread": row["stall_s"],
             "waiting for rounds": row["wait_s"]}  # fmt: skip
    worst = max(costs, key=costs.__getitem__)
    return f"{worst}: {costs[worst]:.0f} s"


def _x(v: float | None, fmt: str = "{:.3f}") -> str:
    return "not reached" if v is None else fmt.format(v)


def markdown(serials: list[dict[str, Any]], rows: list[dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    lines = ["| seed | target (smoothed; last check) | steps | serial s (before; after) | start-up share | load |",
             "|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for s in serials:
        lines.append(f"| {s['seed']} | {s['target']:.2f} ({s['final_ppl']:.2f}) | {s['steps']} | {s['time_s']:.1f} "
                     f"({s['time_a_s']:.1f}; {s['time_b_s']:.1f}) | {s['startup_s'] / s['time_s']:.1%} "
                     f"| {s['load'][0]:.2f}; {s['load'][1]:.2f} |")  # fmt: skip
    lines += ["", "| regime | lr-scaling | link | seed | time to target s | x serial | version (samples x serial) "
              "| start + join s | compute s | stall s / sync | wait s / sync | load | miss: cause |",
              "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        per = max(r["syncs"], 1)
        lines.append(f"| {r['regime']} | {r['lr_scaling']} | {r['link']} | {r['seed']} | {_x(r['time_s'], '{:.1f}')} "
                     f"| {_x(r['x_serial'])} | {r['version'] or '-'} ({_x(r['samples_x_serial'], '{:.2f}')}) "
                     f"| {r['start_s']:.1f} + {r['join_s']:.1f} | {r['compute_s']:.1f} | {r['stall_s'] / per:.2f} "
                     f"| {r['wait_s'] / per:.2f} | {r['load']:.2f} | {r['cause']} |")  # fmt: skip
    return "\n".join([*lines, "", *record.targets_table(targets)])


def main() -> None:
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    common = dict(COMMON)
    if args.quick:  # the pipeline, not the figures: a random-init tiny GPT-2, no pretraining
        common = dict(QUICK)
        args.seeds, args.links, args.lr_scalings = args.seeds[:1], args.links[:1], args.lr_scalings[:1]
        args.sync_every, args.check_every, args.smooth, args.max_epochs = "2", 2, 2, 1.0
    try:
        for rate in args.links:
            wire.rate_bits(rate)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.peers < 2 or not (args.sync_every == "auto" or args.sync_every.isdigit()) or args.max_epochs < 1:
        parser.error("want --peers >= 2, --sync-every N or auto and --max-epochs >= 1")
    cores = len(os.sched_getaffinity(0))
    if args.peers + 1 > cores:
        print(f"note: {args.peers} peers and the hub on {cores} cores share cores: not a machine each", flush=True)
    # the warm start, pretrained on reviews none of these runs uses (its exclusions cover this set)
    widen = ["--exclude-train", str(common["train-samples"]), "--exclude-val", str(common["val-samples"])]
    regime = {**quality.FULL_COMMON, **common, "model-config": "tiny"}
    model = None if args.quick else quality.pretrained([*quality.PRETRAIN["full"], *widen], regime)
    args.ns_prefix = args.ns_prefix or f"wst{os.getpid()}"
    print(f"warm start {model}; namespaces {args.ns_prefix}-*", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-ttq-"))
    net = wire.Net(args.ns_prefix, args.peers)
    hub = None
    serials: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    scalings = args.lr_scalings
    with wire.terminated_as_exit():
        try:
            # --quick: GPT-2's tokenizer cut to 1,025 tokens, as the tests cut it (tests/smallvocab.py):
            # with all 50,257 the output layer is ~98% of a random tiny GPT-2's compute
            data = small_vocab_data(quality.DATA, work / "data") if args.quick else quality.DATA
            net.up()
            hub = wire.serve_in_ns(net, work / "hub", work / "hub.log", "--keep-versions", "10000")
            if hub.proc is None or hub.url is None:
                raise RuntimeError("the hub did not start")
            load = Load(hub.proc.pid)
            peers = functools.partial(peers_run, load, args, common, model, data, work, net, hub.url)
            for seed in args.seeds:
                a = serial_run(load, args, common, model, data, work, seed, "a")
                runs = []
                for link in args.links:
                    for scaling in scalings:
                        runs.append(peers(seed, "per-device", scaling, link))
                    if len(scalings) > 1:  # the grid, on the first seed at the first link: keep the soonest
                        score([a, *runs], common, model, data, work)
                        serial = serial_figures(a, a, args.smooth)
                        times = {r["lr_scaling"]: peers_figures(r, serial, common, args.sync_every) for r in runs}
                        scalings = [min(scalings, key=lambda s: times[s]["time_s"] or float("inf"))]
                        print(f"seed {seed}: lr-scaling {scalings[0]} reached the target soonest", flush=True)
                    runs.append(peers(seed, "equal-batch", "none", link))
                b = serial_run(load, args, common, model, data, work, seed, "b")
                score([a, *runs], common, model, data, work)
                serial = serial_figures(a, b, args.smooth)
                serials.append(serial)
                for r in runs:
                    row = peers_figures(r, serial, common, args.sync_every)
                    row["cause"] = cause(row, serial, TARGETS.get(args.peers, {}).get(r["link"], 1.0))
                    rows.append(row)
                    said = f"{_x(row['time_s'], '{:.1f} s')}, x serial {_x(row['x_serial'])} {row['cause']}"
                    print(f"seed {seed} {row['regime']} {row['lr_scaling']} {row['link']}: {said}", flush=True)
        finally:
            if hub is not None:
                hub.stop(timeout=20)
            net.down()
            shutil.rmtree(work, ignore_errors=True)
    targets = []
    for link, threshold in TARGETS.get(args.peers, {}).items():
        mine = [r for r in rows if (r["link"], r["regime"], r["lr_scaling"]) == (link, "per-device", scalings[0])]
        if mine:
            worst = max(r["x_serial"] or float("inf") for r in mine)
            seeds = [r["seed"] for r in mine]
            what = f"{args.peers} peers, {link}, lr-scaling {scalings[0]}: time to serial's final / its, seeds {seeds}"
            value = f"{worst:.3f}" if worst < float("inf") else "not reached"
            targets.append({"target": what, "value": value, "threshold": threshold, "met": worst <= threshold})
    table = markdown(serials, rows, targets)
    print(table)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record.save(args.out / f"ttq-{started.date().isoformat()}.json", started, command=" ".join(["python", *sys.argv]),
                settings=settings, common=common, warm_start=str(model), lr_scaling=scalings[0], serial=serials,
                rows=rows, targets=targets, table=table)  # fmt: skip


if __name__ == "__main__":
    main()
