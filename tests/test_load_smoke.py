"""The load path in small: 16 peers (threads) on one hub for 3 rounds, via ``bench/load.py``.

The full load test (64 peers x 20 rounds, ``python bench/load.py``) is recorded in
``bench/RESULTS.md``; this keeps its code and the hub's many-peers path covered in CI.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

from tests.conftest import REPO, Hub

# bench/ is scripts, not a package: load bench/load.py by path
_spec = importlib.util.spec_from_file_location("bench_load", REPO / "bench" / "load.py")
assert _spec is not None and _spec.loader is not None
bench_load = importlib.util.module_from_spec(_spec)
sys.modules["bench_load"] = bench_load  # dataclasses look their module up
_spec.loader.exec_module(bench_load)


def test_sixteen_peers_three_rounds(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory()
    assert hub.proc is not None
    result = bench_load.run_load(hub.url, peers=16, rounds=3, params=1 << 16, procs=1, hub_pid=hub.proc.pid)
    assert result.failures == 0, result.failure_examples
    assert result.complete_rounds == 3, result
    assert len(result.overhead_seconds) == 3 and all(0 < s < 30 for s in result.overhead_seconds)
    assert result.hub_peak_rss_mb is not None and result.hub_peak_rss_mb < 1024
    assert len(result.hub_round_seconds) == 3
