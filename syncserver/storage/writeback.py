"""Start writing a file range back to disk now, without waiting for it.

The hub fsyncs every update before acknowledging it and every round's files before
committing the round; by default Linux starts writeback only when GBs are dirty or 30 s
have passed, so each fsync would then wait for the whole file (~1 s for 500 MB on a cloud
disk). Asking for writeback as the bytes are written lets the disk work while the network
does, and the fsync wait for the last few MiB only.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["start_writeback"]


def _starter() -> Callable[[int, int, int], None]:
    """Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which Python's os module lacks,
    through ctypes. Elsewhere, or if libc refuses, it does nothing: the fsync does it all."""
    try:
        import ctypes
        import ctypes.util

        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    except (OSError, AttributeError, TypeError):
        return lambda fd, offset, nbytes: None
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure loses the head start


#: ``start_writeback(fd, offset, nbytes)``: ask the kernel to begin writing that range.
start_writeback = _starter()
