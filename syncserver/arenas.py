"""Few malloc arenas for the hub: its threads share the memory they free.

glibc gives a thread that allocates while another holds an arena an arena of its own, up to
8 per core, and memory freed into one arena is not reused by the others. The hub's threads
(anyio's workers, which receive uploads in batches of 8 MiB, and the slice pool that folds and
merges) each allocate and free megabytes of temporaries, so its peak RSS went from one run to
the next of the same round with how many arenas those happened to spread over: 1.35-3.65x the
fp32 model for 2 GPT-2 peers; with two arenas, 1.27-1.98x, and the rounds took as long
(bench/RESULTS.md, Wire). The big arrays are few and their work is numpy's.

The hub's own processes set it (``syncserver serve``, ``uvicorn syncserver.app:app``) before their
threads exist; :func:`~syncserver.create_app` does not: a process that embeds a hub keeps its allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["HUB_ARENAS", "limit_arenas"]

HUB_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h


def limit_arenas(arenas: int = HUB_ARENAS) -> bool:
    """Cap glibc's malloc arenas for threads that allocate from now on; False where the C library is
    not glibc or the user's ``MALLOC_ARENA_MAX`` wins."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_ARENA_MAX, arenas))
