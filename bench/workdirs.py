"""What a local peer's working folder costs at its start: the overlay against none.

    python bench/workdirs.py --repeats 20

Starts the same child the launcher starts for a peer, ``--repeats`` times each way, alternating
(so drift shows in both): in its own folder with no overlay (:class:`~syncserver.workdirs.Here`,
``train/finetune_gpt2.py --local-peers``), and with the launch folder (this checkout) mounted over
itself (:class:`~syncserver.workdirs.Overlay`, ``weightsync-run --local-peers``); the child is
``python -c pass`` and ``python -c 'import torch'`` (which reads ~1,900 files from the checkout's
venv, through the overlay when it is in the launch folder). Prints the median and the fastest
wall time of each, and their ratio; plus the one-time probe :func:`~syncserver.workdirs.choose` makes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from syncserver.workdirs import HERE, Folders, choose

CHILDREN = {"python -c pass": [sys.executable, "-c", "pass"], "import torch": [sys.executable, "-c", "import torch"]}


def started(folders: Folders, folder: Path, command: list[str]) -> float:
    cwd, _, enter = folders.start(folder)
    t0 = time.perf_counter()
    subprocess.run(command, cwd=cwd, preexec_fn=enter, check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    launch = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        t0 = time.perf_counter()
        overlay, refused = choose(launch, out)
        probe = time.perf_counter() - t0
        if refused:
            sys.exit(f"bench/workdirs.py: {refused}")
        print(f"probe (once per launch): {probe * 1e3:.1f} ms")
        print(f"{'child':<16} {'no overlay ms':>14} {'overlay ms':>11} {'ratio':>6}   (median; fastest)")
        for name, command in CHILDREN.items():
            times: dict[str, list[float]] = {"here": [], "overlay": []}
            for i in range(args.repeats):
                for kind, folders in (("here", HERE), ("overlay", overlay)):
                    folder = out / f"{kind}-{name[:6]}-{i}"
                    folder.mkdir(parents=True)
                    times[kind].append(started(folders, folder, command))
            here, over = (statistics.median(times[k]) * 1e3 for k in ("here", "overlay"))
            fast = {k: min(v) * 1e3 for k, v in times.items()}
            fastest = f"({fast['here']:.1f}; {fast['overlay']:.1f})"
            print(f"{name:<16} {here:14.1f} {over:11.1f} {over / here:6.2f}   {fastest}")


if __name__ == "__main__":
    main()
