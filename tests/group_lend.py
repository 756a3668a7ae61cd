"""PeerGroup's collectives return only once torch.distributed's worker let go of their tensors,
for tests/test_group.py (run under torchrun, 2 ranks, gloo).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/group_lend.py

Every tensor PeerGroup hands to a collective is recorded; right after each of its calls, none
may still be held by gloo (a TensorImpl reference beyond its Python object's). Prints
``rank R: N calls, still held after K of them`` and exits 1 if K > 0; then how many of gloo's
worker threads the exit's wait for them (``_quiesce``) finds.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from syncclient.group import PeerGroup, gloo_worker_states

CALLS = 40


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    lent: list[torch.Tensor] = []

    def spy(collective: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            lent.append(tensor)
            return collective(tensor, *args, **kwargs)

        return call

    dist.broadcast, dist.all_reduce = spy(dist.broadcast), spy(dist.all_reduce)  # type: ignore[assignment]
    group = PeerGroup(dist.group.WORLD)
    model = torch.nn.Linear(64, 64)
    arrays = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    held = 0
    for i in range(CALLS):
        for call in (
            functools.partial(group.tell, {"i": i} if group.leader else None),
            functools.partial(group.flag, i % 2 == 0),
            functools.partial(group.total, i),
            functools.partial(group.scatter, model, arrays if group.leader else None),
        ):
            lent.clear()
            call()
            held += sum(t._use_count() > 1 for t in lent)  # type: ignore[attr-defined]
    print(f"rank {group.rank}: {CALLS * 4} calls, still held after {held} of them", flush=True)
    print(f"rank {group.rank}: gloo workers {len(gloo_worker_states())}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if held else 0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
