"""The test suite (a package, so that ``tests.conftest`` is imported once, under one name).

Set here, before ``tests.conftest`` imports torch: one intra-op thread for torch, in the test
process and in the programs the tests start (those that set their own, as --local-peers' peers
and torchrun's ranks do, keep theirs). Every model here is tiny, and on 2 cores two xdist workers,
each beside programs with an OpenMP pool of 2 that spins between ops, took each other's cores.
Measured with -n 2 on a quiet 2-core VM: seven in-process modules (test_e2e, test_resume,
test_callback, test_poison, test_streaming_hub, test_sparse, test_metrics) 71 -> 56 s of wall
time; four two-program tests of test_zero_code 89 -> 82 s.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No peer here asks a cloud's metadata server (169.254.169.254) or takes SIGTERM over: traffic stays on
# 127.0.0.1, and xdist's workers end as they should; tests/test_preemption.py sets its own.
os.environ["WEIGHTSYNC_PREEMPTION"] = "off"
