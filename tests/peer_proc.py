"""A peer as a process of its own, for the tests that SIGKILL one (tests/harness.py has the rest).

    python tests/peer_proc.py --hub URL --run R --peer NAME --seed S --samples N \\
        --until-version V --out DIR [--train-seconds T] [--go-files] [--join-after FILE]

It builds ``tests.models.tiny_bigram(0)`` (torch only, so that it starts and exits seconds sooner
than a GPT-2's process; every peer the same init; the first to join uploads version 0),
joins (once FILE exists, with ``--join-after``: a test starts the process early, so that its
imports overlap what the test waits for, and says when it joins), and for each round: waits
for ``DIR/go_<round>`` if ``--go-files`` (so the test sets the pace), "trains" (a
deterministic perturbation from ``seed`` and the round, counted as ``--samples`` trained, then
sleeps ``--train-seconds``), dumps
its delta as ``DIR/delta_<peer>_<round>.safetensors`` (exactly the float32 ``local - base`` the
SDK sends with the fp32 codec), and syncs. Progress goes to ``DIR/<peer>.jsonl`` (one event a
line), the final weights to ``DIR/final_<peer>.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

import safetensors.numpy  # noqa: E402

from syncclient import SyncClient  # noqa: E402
from syncclient.weights import ModelView  # noqa: E402
from tests.models import perturb, tiny_bigram  # noqa: E402


def events(out: Path, peer: str) -> list[dict[str, Any]]:
    path = out / f"{peer}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hub", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--peer", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--samples", type=int, default=100, help="this peer's weight in the average")
    ap.add_argument("--until-version", type=int, required=True, help="stop once the model is at this version")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--train-seconds", type=float, default=0.0, help="sleep per round (heartbeats keep going)")
    ap.add_argument("--go-files", action="store_true", help="wait for OUT/go_<round> before each round")
    ap.add_argument("--join-after", type=Path, help="wait for this file before joining")
    args = ap.parse_args()

    def log(event: str, **fields: Any) -> None:
        with open(args.out / f"{args.peer}.jsonl", "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")

    model = tiny_bigram(0)
    while args.join_after is not None and not args.join_after.exists():
        time.sleep(0.02)
    client = SyncClient(args.hub, run=args.run, peer=args.peer, timeout=10, retry_seconds=120)
    info = client.join(model)
    log("joined", version=info.version, rank=info.rank)
    view = ModelView(model)
    while client.version < args.until_version:
        round_ = client.version
        if args.go_files:
            while not (args.out / f"go_{round_}").exists():
                time.sleep(0.02)
        log("training", round=round_)
        base = {k: v.copy() for k, v in view.export().items()}
        perturb(model, args.seed, round_)
        client.progress(args.samples)  # "trained": the hub's ledger hears of it within seconds
        time.sleep(args.train_seconds)
        delta = {k: v - base[k] for k, v in view.export().items()}
        safetensors.numpy.save_file(delta, str(args.out / f"delta_{args.peer}_{round_}.safetensors"))
        log("syncing", round=round_)
        result = client.sync(model, samples=args.samples)
        log("synced", round=round_, version=result.version, caught_up=result.caught_up)
    safetensors.numpy.save_file(
        {k: v.copy() for k, v in view.export().items()}, str(args.out / f"final_{args.peer}.safetensors")
    )
    client.leave()
    log("done", version=client.version)


if __name__ == "__main__":
    main()
