"""A peer that steps, as a training loop calls the SDK after each optimizer step, for the tests of
preemption (tests/test_preemption.py): it is stopped mid-interval by SIGTERM or a cloud's notice.

    python tests/stepping_proc.py --hub URL --run R --peer NAME --sync-every N --out DIR \\
        [--preemption MODE] [--metadata-url URL]

``tests.models.tiny_bigram(0)``, "trained" by :func:`tests.models.perturb` at each step (4
samples), ``client.step`` after it; each step's number goes to ``DIR/<peer>.steps`` (the test waits
on it), and a :class:`~syncclient.preemption.Preempted` says how it ended in ``DIR/<peer>.end``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from syncclient import SyncClient  # noqa: E402
from syncclient.preemption import Preempted  # noqa: E402
from tests.models import perturb, tiny_bigram  # noqa: E402

SAMPLES = 4  # per step


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--hub", "--run", "--peer", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--sync-every", type=int, required=True)
    ap.add_argument("--preemption")
    ap.add_argument("--metadata-url")
    args = ap.parse_args()
    out = Path(args.out)
    model = tiny_bigram(0)
    client = SyncClient(
        args.hub,
        run=args.run,
        peer=args.peer,
        sync_every=args.sync_every,
        preemption=args.preemption,
        metadata_url=args.metadata_url,
        timeout=10,
        retry_seconds=60,
    )
    client.join(model)
    client.count_from(0)
    step = 0
    try:
        while True:
            step += 1
            perturb(model, seed=7, round_=step, scale=0.001)
            client.step(model, samples=SAMPLES)
            with open(out / f"{args.peer}.steps", "a") as f:
                f.write(f"{step}\n")
            time.sleep(0.02)
    except Preempted as exc:
        end = {"handed_in": exc.handed_in, "round": exc.round, "source": exc.notice.source, "step": step}
        (out / f"{args.peer}.end").write_text(json.dumps(end))
        raise


if __name__ == "__main__":
    main()
