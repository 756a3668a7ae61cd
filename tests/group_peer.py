"""One peer that is a torch.distributed group, for tests/test_group.py (run under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/group_peer.py \
        --hub URL --job R --peer NAME --mode ddp|fsdp|trainer --rounds N --out DIR [--model bigram]

Every rank trains a tiny GPT-2 (or, ``--model bigram``, :class:`tests.models.Bigram`: a rank that
needs no GPT-2 shapes then skips importing transformers) on its own random tokens (ddp:
DistributedDataParallel; fsdp: ``fully_shard``, parameters sharded across the ranks; trainer: a
Hugging Face ``Trainer`` with ``SyncCallback``, which runs DDP itself) and syncs every few steps
through one SyncClient that serves the group. After every sync each rank writes the sha-256 of the weights it holds to
``DIR/<peer>-r<rank>-v<version>``, and at start its pid to ``DIR/<peer>-r<rank>.pid``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from syncclient import SyncClient
from tests.models import Blocks, tiny_bigram, tiny_gpt2

STEPS = 2  # optimizer steps per round


def build(kind: str, seed: int) -> torch.nn.Module:
    return tiny_bigram(seed) if kind == "bigram" else tiny_gpt2(seed)  # GPT-2: imports transformers


def digest(arrays: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(arrays[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the hub holds (parameters once, as named), whole on every rank."""
    from torch.distributed.tensor import DTensor

    return {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--hub", "--job", "--peer", "--mode", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--min-peers", type=int, default=2)
    p.add_argument("--retry-seconds", type=float, default=60)
    p.add_argument("--model", choices=["gpt2", "bigram"], default="gpt2", help="bigram: no transformers (ddp)")
    p.add_argument("--auto", action="store_true", help="ddp: sync_every auto, --rounds x STEPS steps, synced when due")
    args = p.parse_args()
    if args.model == "bigram" and args.mode != "ddp":
        p.error("--model bigram goes with --mode ddp")
    out = Path(args.out)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    (out / f"{args.peer}-r{rank}.pid").write_text(str(os.getpid()))
    if args.mode == "trainer":
        return trainer(args, rank, out)
    dist.init_process_group("gloo")
    model = build(args.model, seed=rank)  # different on purpose: joining makes every rank the run's version 0
    client = SyncClient(
        args.hub,
        run=args.job,
        peer=args.peer,
        min_peers=args.min_peers,
        retry_seconds=args.retry_seconds,
        group=dist.group.WORLD,
        **({"sync_every": "auto", "utilization": 0.5, "sync_max": 4} if args.auto else {}),
    )
    client.join(model)
    if args.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        wrapped: torch.nn.Module = model
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 * rank + len(args.peer))
    if args.auto:  # every rank asks the one clock after each step; the leader's answer goes to all
        client.count_from(0)
    for _ in range(args.rounds):
        for _ in range(STEPS):
            ids = torch.randint(0, 256, (4, 16), generator=gen)
            wrapped(input_ids=ids, labels=ids)["loss"].backward()
            opt.step()
            opt.zero_grad()
            result = client.step(wrapped, samples=4) if args.auto else None
            if result is not None:
                (out / f"{args.peer}-r{rank}-v{result.version}").write_text(digest(weights(model)))
        if not args.auto:
            result = client.sync(wrapped, samples=4 * STEPS)
            (out / f"{args.peer}-r{rank}-v{result.version}").write_text(digest(weights(model)))
    client.leave()
    dist.destroy_process_group()


def trainer(args: argparse.Namespace, rank: int, out: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from syncclient import SyncCallback  # imports transformers

    model = build("gpt2", seed=rank)

    def note(result: Any) -> None:  # on every rank, after each sync (the Trainer's DDP wraps `model`)
        (out / f"{args.peer}-r{rank}-v{result.version}").write_text(digest(weights(model)))

    callback = SyncCallback(
        args.hub,
        run=args.job,
        peer=args.peer,
        sync_every=STEPS,
        min_peers=args.min_peers,
        retry_seconds=args.retry_seconds,
        on_sync=note,
    )
    training = TrainingArguments(
        output_dir=str(out / f"{args.peer}-trainer"),
        per_device_train_batch_size=4,
        max_steps=STEPS * args.rounds,
        learning_rate=1e-3,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        seed=0,
    )
    Trainer(model=model, args=training, train_dataset=Blocks(64, seed=rank), callbacks=[callback]).train()


if __name__ == "__main__":
    main()
