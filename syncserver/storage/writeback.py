"""Start writing a file range back to disk now, without waiting for it: Linux starts writeback
only when GBs are dirty or after 30 s, so the fsync that acknowledges an update or commits a
round would wait for the whole file (~1 s for 500 MB on a cloud disk); asked as the bytes are
written, the disk works while the network does, and the fsync waits for the last few MiB only.
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
