"""Pruned tensor files, kept (a few: :data:`SPARES`) to be written over by the next files
:meth:`Store.write <syncserver.storage.store.Store.write>` makes while their pages are cached: a
GPT-2 fp32 round writes half a GB of result and as much of version, and fresh page-cache pages
cost 0.8-1.1 s per 500 MB on the 2-core VM of bench/RESULTS.md against 0.08 s for cached ones (a
VM hands freed memory back to its host: every fresh page faults there too). A spare is taken only
while nothing else has it open (a write lease, ``F_SETLEASE``): a pruned version still served to
a late peer is never written over.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import uuid
from pathlib import Path

__all__ = ["SPARES", "Spares"]

#: pruned tensor files kept to be written over (:class:`Spares`; the hub's ``SYNC_SPARE_FILES``).
#: A round writes a result, a version, an upload per peer and, for DiLoCo and topk, a momentum
#: and a residual, and prunes as many.
SPARES = 6


def _unshared(fd: int) -> bool | None:
    """Whether ``fd`` is the only open file of its inode, in any process (a mapping counts):
    the kernel grants a write lease only then. None where leases do not work (not Linux, a
    file system without them, not the file's owner): then nothing can be told."""
    setlease = getattr(fcntl, "F_SETLEASE", None)
    if setlease is None:
        return None
    try:
        fcntl.fcntl(fd, setlease, fcntl.F_WRLCK)
    except BlockingIOError:  # EAGAIN: someone else has it open
        return False
    except OSError:
        return None
    fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
    return True


class Spares:
    """The largest ``limit`` pruned files (:meth:`retire`), handed out to be written over
    (:meth:`open`). Where the kernel cannot tell who has a file open (no leases), none is kept."""

    def __init__(self, folder: Path, limit: int = SPARES) -> None:
        self._folder = folder
        self._limit = limit
        self._files: list[tuple[int, Path]] = []  # (size, path)
        self._lock = threading.Lock()  # prune runs on the event loop, writes in worker threads
        self._usable = limit > 0

    def retire(self, path: Path) -> None:
        """Remove ``path``'s name: keep its file as a spare, or delete it."""
        if not self._usable:
            path.unlink(missing_ok=True)
            return
        self._folder.mkdir(parents=True, exist_ok=True)
        spare = self._folder / f"{uuid.uuid4().hex}.spare"
        try:
            size = path.stat().st_size
            os.rename(path, spare)
        except FileNotFoundError:
            return
        with self._lock:
            self._files.append((size, spare))
            self._files.sort(key=lambda f: -f[0])
            dropped = self._files[self._limit :]
            del self._files[self._limit :]
        for _, extra in dropped:
            extra.unlink(missing_ok=True)

    def open(self, size: int | None, to: Path) -> int:
        """``to``, opened for writing: a spare renamed there (its old bytes still in it: write
        over them and cut it at the end), else a new file. The spare is the smallest that holds
        ``size`` bytes, else the largest, and one that nothing else has open (a download of a
        pruned version may still read it: that one waits for a later round)."""
        with self._lock:
            fits = sorted((f for f in self._files if size is not None and f[0] >= size), key=lambda f: f[0])
            for entry in [*fits, *(f for f in self._files if f not in fits)]:
                try:
                    fd = os.open(entry[1], os.O_WRONLY)
                except FileNotFoundError:  # cleared meanwhile
                    self._files.remove(entry)
                    continue
                unshared = _unshared(fd)
                if unshared is False:  # still read: a later round may have it
                    os.close(fd)
                    continue
                self._files.remove(entry)
                if unshared is None:  # the kernel cannot say who else has it open: keep none
                    os.close(fd)
                    self._usable = False
                    for _, path in [entry, *self._files]:
                        path.unlink(missing_ok=True)
                    self._files.clear()
                    break
                os.rename(entry[1], to)
                return fd
        return os.open(to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def clear(self) -> None:
        with self._lock:
            self._files.clear()
        shutil.rmtree(self._folder, ignore_errors=True)
