"""Time to quality, measured end to end: ``sudo python bench/ttq.py [--quick]``.

    sudo python bench/ttq.py                              # 2 peers, 1 Gbit/s and 100 Mbit/s, seeds 1 and 2
    sudo python bench/ttq.py --peers 4 --links 1gbit      # on a machine with a core per peer
    sudo python bench/ttq.py --quick                      # the smoke test: a few steps, seconds
                                                          # (random tiny GPT-2, tokenizer cut to 1,025 tokens)

Users rent N machines to get the model one machine would give, sooner. This runs the reference job
(``train/finetune_gpt2.py``) both ways and measures the **wall time from start until the run's model
first reaches serial's final validation perplexity**, checked at every evaluation the job logs
(``rounds.jsonl``: serial every ``--serial-eval-every`` steps; the peers right after each sync, where
all peers hold the hub's version). Each machine is emulated by one core:

- **serial**: the job with ``--no-hub --threads 1``, pinned to one core (``taskset``), one epoch;
  its target is its own final validation perplexity, its time the first evaluation at or below it;
- **peers**: a real hub (``python -m syncserver serve``) in a network namespace of its own and N
  peer processes of the job (``--hub``, ``--threads 1``), each pinned to a core of its own (where
  the machine has one; it says when peers share cores) and in a namespace of its own with its own
  ``tbf``-shaped link, both ways (``bench/wire.py``'s :class:`wire.Net`, ``peer:RATE``), shaped from
  the start: joining (version 0) is part of the time. Peers may train past one epoch (up to
  ``--max-epochs``); the run is stopped (SIGTERM: each peer leaves) once it reaches the target.

Times are each process's own ``elapsed`` (from the job's start: imports, tokenizing and, for peers,
joining included). The regime is the quality grid's (``bench/quality.py``): the ``tiny`` GPT-2 warm
start of ``bench/pretrain.py``, fine-tuned on ``--train-samples`` IMDB reviews at a global batch of
32 blocks of 20 tokens, Adam 3e-4 constant, held-out validation reviews of the seed.

**Variants** (``--variants``), each against the baseline ``fp32`` (sync every ``--sync-every`` steps,
serial's rate) on the same seed and link: ``lr2x`` (the peers' rate doubled), ``int8-short`` (int8
every third of the interval), ``linear`` (the rate decays linearly to 0 over ``--max-epochs``),
``schedule`` (``--sync-schedule``: every third of the interval for two intervals, then every 5/3
of it: 5:30,25 at 15, no more syncs than the baseline over 2 epochs), ``short`` and ``long`` (a
third of the interval, and three times it) and ``auto`` (``--sync-every auto``: the hub picks each
interval). One is **kept** only if it reaches the target sooner than the baseline on every seed;
the targets are judged on the fastest kept one (the baseline if none). With ``auto`` and fixed
intervals in one run, the **interval grid** table sets ``auto`` beside the best fixed interval:
its time to the target and every run's validation perplexity at one wall time (the earliest any
of them reached the target), the issue-46 check that picking the interval costs no quality.

Namespaces ``<prefix>-...`` are removed in ``finally`` and on SIGTERM. Needs root (``ip netns``).
Results: markdown tables and ``bench/results/ttq-<date>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

import quality  # noqa: E402 (bench/quality.py: the warm start, the data)
import record  # noqa: E402 (bench/record.py: the result file)
import wire  # noqa: E402 (bench/wire.py: namespaces, links, pinning)

from tests.smallvocab import small_vocab_data  # noqa: E402

TRAIN = REPO / "train" / "finetune_gpt2.py"


@dataclass(frozen=True)
class Variant:
    """The peers' settings beside the baseline's: a name, the interval as a share of the
    baseline's (after ``schedule``'s phases: (interval, until step) as shares of it), the codec
    and extra flags of the reference job."""

    name: str
    interval: float = 1.0  # 0: sync_every auto (the hub picks each interval)
    schedule: tuple[tuple[float, float], ...] = ()
    codec: str = "fp32"
    flags: dict[str, str] = field(default_factory=dict)


VARIANTS = {
    v.name: v
    for v in (
        Variant("fp32"),
        Variant("lr2x", flags={"lr": "6e-4"}),
        Variant("int8-short", interval=1 / 3, codec="int8"),
        Variant("linear", flags={"lr-schedule": "linear"}),
        Variant("schedule", interval=5 / 3, schedule=((1 / 3, 2.0),)),
        Variant("short", interval=1 / 3),
        Variant("long", interval=3.0),
        Variant("auto", interval=0.0),
    )
}
#: the grid's regime (bench/quality.py FULL_COMMON) on fewer reviews: one serial epoch is 90 steps
COMMON = {"train-samples": 200, "val-samples": 24, "test-samples": 8, "batch-size": 32, "lr": 3e-4,
          "lr-scaling": "none"}  # fmt: skip
QUICK = {"train-samples": 8, "val-samples": 4, "test-samples": 2, "batch-size": 8, "lr": 3e-4, "lr-scaling": "none"}
#: targets (issue 40): peers' time to serial's final perplexity over serial's time
TARGETS = {2: {"1gbit": 0.55, "100mbit": 0.6}, 4: {"1gbit": 0.30, "100mbit": 0.30}}

parser = argparse.ArgumentParser(description="Time to serial's final perplexity, serial against N peers.")
parser.add_argument("--peers", type=int, default=2)
parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit"], help="each peer's link rate (tc spelling)")
parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="default: all (--quick: fp32)")
parser.add_argument("--variant-links", nargs="+", default=["1gbit"], help="links the variants run on (fp32: all)")
parser.add_argument("--sync-every", type=int, default=15, help="the baseline's interval (a sixth of an epoch)")
parser.add_argument("--serial-eval-every", type=int, default=15, help="serial's checks, in its steps")
parser.add_argument("--max-epochs", type=float, default=2.0, help="how far the peers may train")
parser.add_argument("--quick", action="store_true", help="a few steps of each, one seed, one link, fp32 only")
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


def evaluations(folder: Path) -> list[dict[str, Any]]:
    """The job's evaluations so far (``rounds.jsonl``: ``eval`` and ``round`` rows), in order."""
    path = folder / "rounds.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.endswith("}"):  # a line still being written
            continue
        row = json.loads(line)
        if row.get("val_ppl") is not None:
            rows.append(row)
    return rows


def run_serial(
    common: dict[str, Any], model: Path | None, data: Path, work: Path, seed: int, every: int
) -> dict[str, Any]:
    """Serial, one epoch, on one core: its final perplexity (the target) and when it first got there."""
    out = work / f"serial-{seed}"
    cpu = str(sorted(os.sched_getaffinity(0))[0])
    argv = ["taskset", "-c", cpu, *job(common | {"seed": seed}, model, data, out, "--no-hub", "--epochs", "1",
                                       "--eval-every", str(every))]  # fmt: skip
    with (work / f"serial-{seed}.log").open("wb") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        raise RuntimeError(f"serial seed {seed} exited {code}: {(work / f'serial-{seed}.log').read_text()[-800:]}")
    final = json.loads((out / "results.json").read_text())
    rows = evaluations(out)
    target = final["final_val_ppl"]
    first = next(r for r in rows if r["val_ppl"] <= target)
    return {"seed": seed, "target": target, "time_s": first["elapsed"], "step": first["step"],
            "steps": final["steps"], "wall_s": final["wall_seconds"], "start_ppl": rows[0]["val_ppl"],
            "curve": [(r["step"], r["elapsed"], r["val_ppl"]) for r in rows]}  # fmt: skip


def run_peers(args: argparse.Namespace, common: dict[str, Any], model: Path | None, data: Path, work: Path,
              net: wire.Net, url: str, serial: dict[str, Any], variant: Variant,
              link: str) -> dict[str, Any]:  # fmt: skip
    """N peers of the job over ``link`` until rank 0 logs a sync at or below serial's final perplexity."""
    name = f"{variant.name}-{link}-seed{serial['seed']}"
    every: int | str = max(1, round(args.sync_every * variant.interval)) if variant.interval else "auto"
    phases = [f"{max(1, round(args.sync_every * e))}:{round(args.sync_every * u)}" for e, u in variant.schedule]
    interval = ["--sync-schedule", ",".join([*phases, str(every)])] if phases else ["--sync-every", str(every)]
    cores = sorted(os.sched_getaffinity(0))
    net.shape(wire.Link("peer", link))
    procs, folders = [], []
    try:
        for k, ns in enumerate(net.peers):
            out = work / name / f"p{k}"
            folders.append(out)
            flags = common | {"seed": serial["seed"]} | variant.flags
            argv = job(flags, model, data, out, "--hub", url, "--run", name, "--peer", f"p{k}", "--min-peers",
                       str(args.peers), *interval, "--codec", variant.codec, "--eval-every", "0",
                       "--epochs", str(args.max_epochs))  # fmt: skip
            out.mkdir(parents=True)
            log = (out / "log.txt").open("wb")
            command = wire.in_ns(ns, str(cores[k % len(cores)]), *argv)
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        reached = None
        while reached is None:
            rows = [r for r in evaluations(folders[0]) if r["event"] == "round"]
            reached = next((r for r in rows if r["val_ppl"] <= serial["target"]), None)
            if reached is None and procs[0].poll() is not None:
                break  # it trained --max-epochs without reaching the target
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the SDK leaves the run on its way out (SystemExit)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        net.unshape()
    rows = [r for r in evaluations(folders[0]) if r["event"] == "round"]
    if reached is None and procs[0].returncode != 0:
        raise RuntimeError(
            f"{name}: rank 0 exited {procs[0].returncode}: {(folders[0] / 'log.txt').read_text()[-800:]}"
        )
    # equal samples: the last sync at or before serial's last step (each peer's step is 1/N of the
    # batch): the peers have seen at most serial's samples there, so the gap is not flattered
    equal = next((r for r in reversed(rows) if r["step"] <= serial["steps"]), None)
    return {
        "variant": variant.name, "link": link, "seed": serial["seed"], "peers": args.peers,
        "sync_every": interval[1] if phases else every,
        "steps_per_sync": round((rows[-1]["step"] - rows[0]["step"]) / (len(rows) - 1), 1) if len(rows) > 1 else None,
        "codec": variant.codec, "flags": variant.flags, "reached": reached is not None,
        "time_s": reached["elapsed"] if reached else None,
        "x_serial": reached["elapsed"] / serial["time_s"] if reached else None,
        "step": reached["step"] if reached else None, "best_ppl": min((r["val_ppl"] for r in rows), default=None),
        "equal_samples_ppl": equal["val_ppl"] if equal else None,
        "equal_samples_vs_serial": equal["val_ppl"] / serial["target"] - 1 if equal else None,
        "sync_s": [r["sync_seconds"] for r in rows], "mb_up": sum(r["bytes_up"] for r in rows) / 1e6,
        "cores_shared": args.peers > len(cores),
        "curve": [(r["step"], r["elapsed"], r["val_ppl"]) for r in rows],
    }  # fmt: skip


def kept(rows: list[dict[str, Any]], seeds: list[int]) -> dict[str, list[str]]:
    """Per link, the variants that reached the target sooner than the baseline on every seed."""
    out: dict[str, list[str]] = {}
    for link in dict.fromkeys(r["link"] for r in rows):
        base = {r["seed"]: r for r in rows if r["link"] == link and r["variant"] == "fp32"}
        wins = []
        for name in dict.fromkeys(r["variant"] for r in rows if r["link"] == link and r["variant"] != "fp32"):
            mine = {r["seed"]: r for r in rows if r["link"] == link and r["variant"] == name}
            if all(
                s in mine and mine[s]["reached"] and (not base.get(s, {}).get("reached") or
                                                      mine[s]["time_s"] < base[s]["time_s"])
                for s in seeds
            ):  # fmt: skip
                wins.append(name)
        out[link] = wins
    return out


def check_targets(rows: list[dict[str, Any]], keep: dict[str, list[str]], peers: int) -> list[dict[str, Any]]:
    """Each link's target on the fastest kept configuration (the baseline if none): met only if
    every seed reached serial's final perplexity within the threshold of serial's time."""
    out = []
    for link, threshold in TARGETS.get(peers, {}).items():
        ratios: dict[str, float] = {}  # configuration -> its worst seed (inf: a seed never got there)
        for v in ["fp32", *keep.get(link, [])]:
            mine = [r["x_serial"] for r in rows if r["link"] == link and r["variant"] == v]
            if mine:
                ratios[v] = max(x if x is not None else math.inf for x in mine)
        if not ratios:
            continue
        best = min(ratios, key=ratios.__getitem__)
        value = ratios[best] if math.isfinite(ratios[best]) else None
        out.append(
            {
                "target": f"{peers} peers, {link}: time to serial's final perplexity / serial's <= {threshold}",
                "configuration": best,
                "value": value,
                "threshold": threshold,
                "met": value is not None and value <= threshold,
            }
        )
    return out


FIXED = ("fp32", "short", "long")  # the fixed intervals auto is set beside (a third, one, three times the baseline's)


def interval_grid(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Per link and seed: auto against the best fixed interval of :data:`FIXED` (the soonest to the
    target), and each one's validation perplexity at the earliest time any reached the target; the
    table's lines and the targets (auto no later than the best fixed interval, on every seed)."""
    lines = ["| link | seed | interval | time to target s | val ppl at the common time |", "|---|---:|---|---:|---:|"]
    targets = []
    for link in dict.fromkeys(r["link"] for r in rows):
        for seed in dict.fromkeys(r["seed"] for r in rows):
            mine = {r["variant"]: r for r in rows if (r["link"], r["seed"]) == (link, seed)}
            if "auto" not in mine or not any(v in mine for v in FIXED):
                continue
            fixed = [mine[v] for v in FIXED if v in mine]
            when = min((r["time_s"] for r in [*fixed, mine["auto"]] if r["reached"]), default=None)
            for r in [*fixed, mine["auto"]]:
                at = [ppl for _, t, ppl in r["curve"] if when is not None and t <= when]
                every = f"mean {r['steps_per_sync']}" if r["sync_every"] == "auto" else r["sync_every"]
                lines.append(f"| {link} | {seed} | {r['variant']} ({every}) | {_x(r['time_s'], '{:.1f}')} "
                             f"| {_x(at[-1] if at else None, '{:.2f}')} |")  # fmt: skip
            best = min(fixed, key=lambda r: r["time_s"] if r["reached"] else math.inf)
            auto = mine["auto"]
            targets.append(
                {
                    "target": f"auto, {link}, seed {seed}: time to target <= the best fixed interval's "
                    f"({best['variant']}, every {best['sync_every']})",
                    "value": auto["time_s"],
                    "threshold": best["time_s"],
                    "met": auto["reached"] and (not best["reached"] or auto["time_s"] <= best["time_s"]),
                }
            )
    return lines, targets


def _x(v: float | None, fmt: str = "{:.3f}") -> str:
    return "not reached" if v is None else fmt.format(v)


def markdown(serials: list[dict[str, Any]], rows: list[dict[str, Any]], keep: dict[str, list[str]],
             targets: list[dict[str, Any]]) -> str:  # fmt: skip
    lines = ["| seed | serial final val ppl (target) | serial steps | serial time to target s | serial wall s |",
             "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for s in serials:
        lines.append(f"| {s['seed']} | {s['target']:.2f} | {s['steps']} | {s['time_s']:.1f} | {s['wall_s']:.1f} |")
    lines += ["", "| variant | link | seed | interval | codec | time to target s | x serial | at step "
              "| best val ppl | at equal samples vs serial | MB up / peer | kept |",
              "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        keeps = "baseline" if r["variant"] == "fp32" else ("yes" if r["variant"] in keep.get(r["link"], []) else "no")
        equal = _x(r["equal_samples_vs_serial"], "{:+.2%}") if r["equal_samples_ppl"] is not None else "-"
        lines.append(
            f"| {r['variant']} | {r['link']} | {r['seed']} | {r['sync_every']} | {r['codec']} "
            f"| {_x(r['time_s'], '{:.1f}')} "
            f"| {_x(r['x_serial'])} | {r['step'] or '-'} | {_x(r['best_ppl'], '{:.2f}')} | {equal} "
            f"| {r['mb_up']:.1f} | {keeps} |"
        )
    grid, picked = interval_grid(rows)
    if picked:
        lines += ["", *grid]
    lines += ["", "| target | configuration | measured | threshold | met |", "|---|---|---|---|---|"]
    for t in targets:
        met = "yes" if t["met"] else "**no**"
        lines.append(f"| {t['target']} | {t['configuration']} | {_x(t['value'])} | {t['threshold']} | {met} |")
    return "\n".join(lines)


def main() -> None:
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    common = dict(COMMON)
    if args.quick:  # the pipeline, not the figures: a random-init tiny GPT-2, no pretraining
        common = dict(QUICK)
        args.seeds, args.links, args.sync_every, args.serial_eval_every = [1], ["1gbit"], 2, 2
        args.variants = args.variants or ["fp32"]
        args.max_epochs = 1.5
    try:
        for rate in args.links:
            wire.rate_bits(rate)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.variants = args.variants or list(VARIANTS)
    if args.peers < 2 or args.sync_every < 1 or args.max_epochs < 1:
        parser.error("want --peers >= 2, --sync-every >= 1 and --max-epochs >= 1")
    cores = len(os.sched_getaffinity(0))
    if args.peers > cores:
        print(f"note: {args.peers} peers on {cores} cores share cores: not one machine each", flush=True)
    model = (
        None
        if args.quick
        else quality.pretrained(quality.PRETRAIN["full"], {**quality.FULL_COMMON, "model-config": "tiny"})
    )
    args.ns_prefix = args.ns_prefix or f"wst{os.getpid()}"
    print(f"warm start {model}; namespaces {args.ns_prefix}-*; load {os.getloadavg()[0]:.2f}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-ttq-"))
    net = wire.Net(args.ns_prefix, args.peers)
    hub = None
    serials: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    with wire.terminated_as_exit():
        try:
            # --quick: GPT-2's tokenizer cut to 1,025 tokens, as the tests cut it (tests/smallvocab.py):
            # with all 50,257 the output layer is ~98% of a random tiny GPT-2's compute
            data = small_vocab_data(quality.DATA, work / "data") if args.quick else quality.DATA
            net.up()
            hub = wire.serve_in_ns(net, work / "hub", work / "hub.log")
            url = hub.url
            for seed in args.seeds:
                serial = run_serial(common, model, data, work, seed, args.serial_eval_every)
                serials.append(serial)
                print(f"seed {seed}: serial {serial['target']:.2f} at {serial['time_s']:.1f} s "
                      f"({serial['steps']} steps), load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
                for link in args.links:
                    for name in args.variants:
                        if name != "fp32" and link not in args.variant_links:
                            continue
                        r = run_peers(args, common, model, data, work, net, url, serial, VARIANTS[name], link)
                        rows.append(r)
                        equal = _x(r["equal_samples_vs_serial"], "{:+.2%}")
                        print(f"seed {seed} {name} {link}: {_x(r['time_s'], '{:.1f} s')}, x serial {_x(r['x_serial'])} "
                              f"(best {r['best_ppl']:.2f}), equal samples {equal}, load {os.getloadavg()[0]:.2f}",
                              flush=True)  # fmt: skip
        finally:
            if hub is not None:
                hub.stop(timeout=20)
            net.down()
            shutil.rmtree(work, ignore_errors=True)
    keep = kept(rows, args.seeds)
    targets = check_targets(rows, keep, args.peers)
    targets += [{**t, "configuration": "auto"} for t in interval_grid(rows)[1]]
    table = markdown(serials, rows, keep, targets)
    print(table)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record.save(args.out / f"ttq-{started.date().isoformat()}.json", started, command=" ".join(["python", *sys.argv]),
                settings=settings, common=common, warm_start=str(model), serial=serials, rows=rows, kept=keep,
                targets=targets, table=table, load_end=os.getloadavg())  # fmt: skip


if __name__ == "__main__":
    main()
