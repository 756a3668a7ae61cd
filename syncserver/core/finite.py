"""Merging a round into finite weights, without the updates that would make them Inf.

Finite updates can still overflow ``version v + decode(result)`` (updates near 1e38, an outer
step that multiplies them, a codec rounding the largest float32 up to Inf). The merge checks that
before anything is written; a refused round goes on without the update of largest magnitude, the
others folded again in order, until it is finite (with every update out it changes nothing: at
most one merge per participant). Ties go by peer name: a restarted hub closes it the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from anyio import to_thread

from syncserver.core.state import Run
from syncserver.reduce.engine import Accumulator, MergeEngine, NonFinite, RoundMerge
from syncserver.storage.store import ObjectRecord, UpdateKey

__all__ = ["Merged", "merge_finite"]

#: A merge done: the result's size, the objects it wrote to the bucket, the reducers' bound on |v+1|
Merged = tuple[int, list[ObjectRecord], dict[str, float]]

log = logging.getLogger(__name__)


async def merge_finite(
    engine: MergeEngine,
    run: Run,
    round_: int,
    participants: Sequence[str],
    merge: Callable[[RoundMerge], Awaitable[Merged]],
) -> tuple[int, list[str], list[ObjectRecord], dict[str, float]]:
    """Merge ``run``'s open round with ``merge`` (the workers', folding the rest): the result's size,
    the peers left out (in order), and what ``merge`` said of its objects and of ``|version v+1|``."""
    assert run.schema is not None
    acc = run.accumulator()
    order = [u.peer for u in run.ordered()]
    left_out: list[str] = []
    peaks: dict[str, float] = {}
    bound = run.peaks[1] if run.peaks is not None and run.peaks[0] == round_ else None
    while True:
        samples = sum(run.acked[name].samples for name in participants if name not in left_out)
        unfolded = [peer for peer in order if peer not in acc.folded and peer not in left_out]
        m = RoundMerge(
            run.name,
            round_,
            acc,
            run.codec,
            run.config.outer_optimizer,
            total=run.policy.total(samples),
            fraction=run.policy.fraction(samples),
            # the round's every update is its peer's last: plain averaging (see aggregate)
            final=all(run.acked[name].final for name in participants if name not in left_out),
            unfolded=[(_key(run, peer), run.weight(run.acked[peer])) for peer in unfolded],
            bound=bound,
        )
        try:
            size, objects, after = await merge(m)
            return size, left_out, objects, after
        except NonFinite as exc:
            merged = list(dict.fromkeys([*acc.folded, *unfolded]))  # a final round's merge folds into acc
            if not merged:
                raise  # a round that changes nothing is finite: cannot happen
            for peer in merged:
                if peer not in peaks:
                    peaks[peer] = await to_thread.run_sync(engine.peak, _key(run, peer), run.codec, run.schema)
            worst = max(merged, key=lambda p: (peaks[p], p))
            log.warning(
                "update_left_out run=%s round=%d peer=%s peak=%.4g reason=not_finite (%s)",
                run.name,
                round_,
                worst,
                peaks[worst],
                exc,
            )
            left_out.append(worst)
            if worst in acc.folded:  # the others are folded again by the next merge, in order
                acc = run.acc = Accumulator(run.schema)


def _key(run: Run, peer: str) -> UpdateKey:
    return UpdateKey.of(run.name, run.acked[peer])
