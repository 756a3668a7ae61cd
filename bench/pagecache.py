"""How fast this machine writes a hub-sized file: page cache, early writeback, fsync.

The hub's merge writes the round's result and version v+1 (about 1 GB for GPT-2 in fp32)
with 4 MiB ``pwrite`` calls, asks for writeback as it goes and fsyncs before the commit.
This tells whether such a write costs CPU (allocating, zeroing and copying page-cache
pages) or disk waits, by timing the same bytes with and without each step::

    python bench/pagecache.py                      # 500 MB in ./, 3 repetitions
    python bench/pagecache.py --dir /dev/shm --mb 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from syncserver.storage.writeback import start_writeback

CHUNK = 4 << 20


def write_once(path: Path, nbytes: int, writeback: bool, fsync: bool) -> tuple[float, float]:
    """Seconds spent in the pwrites and in the final fsync of one ``nbytes`` file."""
    data = np.random.default_rng(0).random(CHUNK // 4, dtype=np.float32).view(np.uint8).data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        began = time.perf_counter()
        for offset in range(0, nbytes, CHUNK):
            os.pwrite(fd, data, offset)
            if writeback:
                start_writeback(fd, offset, CHUNK)
        written = time.perf_counter()
        if fsync:
            os.fsync(fd)
        return written - began, time.perf_counter() - written
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("."), help="where to write the test file")
    parser.add_argument("--mb", type=int, default=500, help="file size in MB (default 500)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each mode, interleaved")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds after each write for its writeback to drain")
    args = parser.parse_args()
    nbytes = args.mb * 1_000_000 // CHUNK * CHUNK
    modes = [(False, False), (True, False), (False, True), (True, True)]
    times: dict[tuple[bool, bool], list[tuple[float, float]]] = {m: [] for m in modes}
    for _ in range(args.reps):
        for mode in modes:  # interleaved, so that a noisy neighbour hits every mode alike
            times[mode].append(write_once(args.dir / ".pagecache-bench", nbytes, *mode))
            time.sleep(args.settle)  # let the previous file's writeback drain
    print(f"{nbytes / 1e6:.0f} MB in {CHUNK >> 20} MiB pwrites to {args.dir.resolve()}, {args.reps} reps")
    print("| writeback | fsync | pwrite s (median) | fsync s (median) | total GB/s |")
    print("|---|---|---|---|---|")
    for (writeback, fsync), reps in times.items():
        w = statistics.median(r[0] for r in reps)
        f = statistics.median(r[1] for r in reps)
        flags = " | ".join("yes" if on else "no" for on in (writeback, fsync))
        print(f"| {flags} | {w:.2f} | {f:.2f} | {nbytes / 1e9 / (w + f):.2f} |")


if __name__ == "__main__":
    main()
