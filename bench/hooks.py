"""Hooks: what ``weightsync-run``'s hooks cost a plain PyTorch training step between syncs.

    python bench/hooks.py                        # 3 models, 5 interleaved pairs of runs each
    python bench/hooks.py --models mlp --pairs 9
    python bench/hooks.py --control --models null mlp --pairs 3   # A/A: the method's own noise

The same training loop (this file with ``--loop``: a ``DataLoader`` over random data, a model,
AdamW, every step timed with ``perf_counter``) runs as two processes, again and again in turns:

- **baseline**: ``python bench/hooks.py --loop ...``, no weightsync at all;
- **hooked**: ``weightsync-run --hub URL --run R --sync-every 1000000000 -- python bench/hooks.py
  --loop ...`` against a real hub process on loopback: after the first step (the join) the
  optimizer post-hook and the DataLoader's counting ``__next__`` run at every step; the exit sync
  falls after the timed steps, so what is measured is the cost of a step *between* syncs.

Three measures, because on a shared machine the load moves more between two processes (and
even between two seconds of one) than the hooks cost:

- **the hooks' own cost** (the figure the target is checked with): in the hooked process, after
  the training steps, the two things the hooks add to a step, timed alone with the hooks on and
  off in alternating blocks of calls: ``optimizer.step()`` with no gradients (torch then runs
  its hooks and touches no parameter) and ``next()`` on a DataLoader over one-number samples.
  The least block mean of each side (load only ever adds time), on minus off, summed: the
  microseconds the hooks add to every step; divided by the model's median step time;
- **in the hooked process, end to end**: its training steps alternate, step by step, between
  hooks on and hooks taken out (torch's global post-hook dict emptied, the DataLoader iterator's
  ``__next__`` put back), so both sides see the same load, caches and allocator; the ratio of
  the two medians per run, then the median over runs;
- **across processes**: the hooked process's hooks-on steps against the baseline process run
  next to it (in alternating order), the median of the per-pair ratios; this includes everything
  (the sitecustomize, the import watcher) but also the load's drift between the two runs.

Models: ``null`` (a 1x1 linear layer, batch 1: a step that is nearly all Python and DataLoader
overhead, the worst case), ``mlp`` (examples/plain_loop.py's classifier, 1024-64-2, batch 32),
``transformer`` (2 encoder layers, 128 wide, 64 tokens, batch 8).

Results: a markdown table on stdout and ``bench/results/hooks-<date>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import record  # bench/record.py: this script's folder is first on sys.path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO)]

# -----------------------------------------------------------------------------
# settings
parser = argparse.ArgumentParser(description="The hooks' cost per training step, against the same loop without.")
parser.add_argument(
    "--models", nargs="+", choices=["null", "mlp", "transformer"], default=["null", "mlp", "transformer"]
)
parser.add_argument("--pairs", type=int, default=5, help="baseline/hooked pairs of runs per model")
parser.add_argument("--steps", type=int, default=0, help="timed steps per run (default: per model)")
parser.add_argument("--warmup", type=int, default=50, help="untimed steps first (the join is in them)")
parser.add_argument("--alone-blocks", type=int, default=400, help="blocks of calls per side for the hooks' own cost")
parser.add_argument("--threads", type=int, default=1, help="torch threads")
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")
parser.add_argument(
    "--control",
    action="store_true",
    help="A/A control: the 'off' steps keep the hooks on (the switch still runs), so the end-to-end "
    "ratios show what the alternation itself costs",
)
# internal: one training loop
parser.add_argument("--loop", default=None, help=argparse.SUPPRESS)
parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)

STEPS = {"null": 8_000, "mlp": 4_000, "transformer": 400}  # about 4-8 s of timed steps each here
ALONE_CALLS = 100  # the hooks' own cost: calls per block (a block fits in a time slice)


# -----------------------------------------------------------------------------
# one run of the loop
def loop(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kind = args.loop
    if kind == "null":
        model: torch.nn.Module = torch.nn.Linear(1, 1)
        data, batch = TensorDataset(torch.randn(4096, 1), torch.randn(4096, 1)), 1
    elif kind == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(1024, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
        data, batch = TensorDataset(torch.randn(4096, 1024), torch.randint(0, 2, (4096,))), 32
    else:
        layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
        model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
        data, batch = TensorDataset(torch.randn(512, 64, 128), torch.randn(512, 64, 128)), 8
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = torch.nn.functional.cross_entropy if kind == "mlp" else torch.nn.functional.mse_loss
    steps = args.steps or STEPS[kind]
    toggle = _hooks_switch(control=args.control)
    times: dict[bool, list[float]] = {True: [], False: []}  # hooks on -> step times
    step, total = 0, args.warmup + steps
    while step < total:
        loader = iter(DataLoader(data, batch_size=batch, shuffle=True))
        t0 = time.perf_counter()
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            t1 = time.perf_counter()
            on = toggle is not None and (step - args.warmup) % 2 == 0
            if step >= args.warmup:
                times[on].append(t1 - t0)
            step += 1
            if toggle is not None and step >= args.warmup:
                toggle((step - args.warmup) % 2 == 0)  # for the next step
            t0 = time.perf_counter()
            if step == total:
                break
    alone = _hooks_alone(opt, toggle, args.alone_blocks) if toggle is not None else {}
    if toggle is not None:
        toggle(True)  # the exit sync needs them
    return {
        "model": kind,
        "hooked": toggle is not None,
        "on": times[True],
        "off": times[False],
        "alone": alone,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _hooks_alone(opt: Any, toggle: Any, blocks: int) -> dict[str, float]:
    """What the hooks add to a step, in seconds, timed apart from the model: the least block mean
    with them on minus the least with them off, for ``opt.step()`` without gradients (torch runs
    the global hooks and skips every parameter) and for ``next()`` on a one-number DataLoader."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    opt.zero_grad(set_to_none=True)
    tiny = DataLoader(TensorDataset(torch.zeros(ALONE_CALLS * 2, 1)), batch_size=1)

    def step_calls() -> None:
        for _ in range(ALONE_CALLS):
            opt.step()

    def next_calls() -> None:
        it = iter(tiny)
        for _ in range(ALONE_CALLS):
            next(it)

    result = {}
    for name, calls in (("optimizer_step", step_calls), ("dataloader_next", next_calls)):
        best = {True: float("inf"), False: float("inf")}
        for i in range(2 * blocks):
            on = i % 2 == 0
            toggle(on)
            t0 = time.perf_counter()
            calls()
            best[on] = min(best[on], (time.perf_counter() - t0) / ALONE_CALLS)
        result[name] = best[True] - best[False]
    return result


def _hooks_switch(control: bool = False) -> Any:
    """In a hooked process, a function that puts the per-step hooks in (True) or takes them out
    (False); None without hooks. Their join happens at the first optimizer step, so only the
    post-hook and the DataLoader's ``__next__`` are left by the time steps are timed."""
    from torch.optim import optimizer
    from torch.utils.data import dataloader

    if "syncclient.hooks" not in sys.modules:
        return None
    hooked_next = dataloader._BaseDataLoaderIter.__next__
    plain_next = getattr(hooked_next, "__wrapped__", hooked_next)
    posts = optimizer._global_optimizer_post_hooks
    saved: dict[Any, Any] = {}

    def switch(on: bool) -> None:
        on = on or control  # the control takes them out and puts them back at once
        if control:
            saved.update(posts)
            posts.clear()
        if on and saved:
            posts.update(saved)
            saved.clear()
        elif not on and posts:
            saved.update(posts)
            posts.clear()
        dataloader._BaseDataLoaderIter.__next__ = hooked_next if on else plain_next  # type: ignore[method-assign]

    return switch


# -----------------------------------------------------------------------------
# the driver: a hub, then baseline and hooked runs in turns
def run(args: argparse.Namespace, kind: str, hooked: bool, url: str, tmp: Path, i: int) -> dict[str, Any]:
    result = tmp / f"{kind}-{'hooked' if hooked else 'baseline'}-{i}.json"
    cmd = [sys.executable, __file__, "--loop", kind, "--result", str(result), f"--threads={args.threads}"]
    cmd += [
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--alone-blocks={args.alone_blocks}",
        *(["--control"] if args.control else []),
    ]
    if hooked:
        wrap = [sys.executable, "-m", "weightsync_run", "--hub", url, "--run", f"{kind}-{i}", "--sync-every"]
        cmd = [*wrap, str(10**9), "--", *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNC_", "WEIGHTSYNC_"))}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    if hooked and "left run" not in done.stderr:
        raise RuntimeError(f"the hooks did not sync {kind}:\n{done.stderr[-3000:]}")
    return dict(json.loads(result.read_text()))


def main() -> None:
    args = parser.parse_args()
    if args.loop is not None:
        args.result.write_text(json.dumps(loop(args)))
        return
    from syncserver.process import ServerProcess

    started = datetime.datetime.now(datetime.UTC)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hooks-bench-") as tmp_name:
        tmp = Path(tmp_name)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
        serve = [sys.executable, "-m", "syncserver", "serve", "--host=127.0.0.1", f"--data-dir={tmp / 'hub'}"]
        hub = ServerProcess([*serve, "--log-level=warning"], log=tmp / "hub.log", env=env, cwd=REPO)
        url = hub.start()
        try:
            for kind in args.models:
                pairs = []
                for i in range(args.pairs):
                    order = [False, True] if i % 2 == 0 else [True, False]
                    runs = {hooked: run(args, kind, hooked, url, tmp, i) for hooked in order}
                    on, off = (statistics.median(runs[True][k]) for k in ("on", "off"))
                    baseline = statistics.median(runs[False]["off"])
                    alone = sum(runs[True]["alone"].values())
                    pairs.append(
                        {"on": on, "off": off, "baseline": baseline, "params": runs[True]["params"],
                         "alone_s": alone, "alone_parts_s": runs[True]["alone"]}
                    )  # fmt: skip
                    print(
                        f"{kind} pair {i}: hooks alone {alone * 1e6:.2f} us = {alone / off:.2%} of a step; "
                        f"in-process {on / off:.4f}, across {on / baseline:.4f}",
                        flush=True,
                    )
                inside = [p["on"] / p["off"] for p in pairs]
                across = [p["on"] / p["baseline"] for p in pairs]
                rows.append(
                    {
                        "model": kind,
                        "params": pairs[0]["params"],
                        "baseline_step_s": statistics.median(p["baseline"] for p in pairs),
                        "off_step_s": statistics.median(p["off"] for p in pairs),
                        "on_step_s": statistics.median(p["on"] for p in pairs),
                        "alone_us": statistics.median(p["alone_s"] * 1e6 for p in pairs),
                        "alone_fraction": statistics.median(p["alone_s"] / p["off"] for p in pairs),
                        "inside_median": statistics.median(inside),
                        "inside_min": min(inside),
                        "inside_max": max(inside),
                        "difference_us": statistics.median((p["on"] - p["off"]) * 1e6 for p in pairs),
                        "across_median": statistics.median(across),
                        "across_min": min(across),
                        "across_max": max(across),
                        "pairs": pairs,
                    }
                )
        finally:
            hub.stop(timeout=30)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(
        f"\n{args.pairs} pairs per model, {args.threads} torch thread(s), {os.cpu_count()} CPUs, load {load[0]:.1f}\n"
    )
    print(
        "| model | step without hooks (median) | the hooks alone, per step | share of a step (target < 1%) "
        "| hooked / not, same process, step by step: median of runs (min-max) "
        "| hooked / baseline process: median of pairs (min-max) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['off_step_s'] * 1e3:.3f} ms | {r['alone_us']:.2f} µs | {r['alone_fraction']:.3%} "
            f"| {r['inside_median']:.4f} ({r['inside_min']:.4f}-{r['inside_max']:.4f}) "
            f"| {r['across_median']:.4f} ({r['across_min']:.4f}-{r['across_max']:.4f}) |"
        )
    settings = {k: v for k, v in vars(args).items() if k not in ("loop", "result", "out")}
    name = f"hooks{'-control' if args.control else ''}-{started:%Y-%m-%d}.json"
    record.save(args.out / name, started, load=load, settings=settings, rows=rows)


if __name__ == "__main__":
    main()
