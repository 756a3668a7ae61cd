"""Where each local peer runs: the launch folder, as on a VM of its own (docs/launcher.md, "The working folder").

A program launched as its README says (``cd repo; python train.py config/small.py``) reads files
relative to its working folder: a helper module, ``data/``, a tokenizer. On K VMs each has that
folder and writes its own files in it. ``weightsync-run --local-peers K`` gives each peer the same,
one of these objects chosen once at start (:func:`choose`):

- :class:`Overlay`: in a mount namespace of the peer's own, the launch folder is mounted over itself
  (overlayfs): reads come from it, writes go to ``OUT/peer-k``. Every path under it, relative or
  absolute, works as typed; two peers never write one file; the launch folder is never written.
  Needs ``CAP_SYS_ADMIN``, or unprivileged user namespaces (Linux >= 5.11) for a user who is not root.
- :class:`Links`, where the kernel refuses that: the peer runs in ``OUT/peer-k``, holding a link to
  each entry of the launch folder. Relative reads work; a new file is the peer's own; a write into a
  file or folder that exists in the launch folder is shared, and ``../`` leaves the peer's folder. The
  launcher says so in one line.
- :class:`Here`: the peers run where the launcher runs (``train/finetune_gpt2.py --local-peers``,
  whose outputs go to ``WEIGHTSYNC_PEER_DIR``).

Each gives a peer ``(cwd, WEIGHTSYNC_PEER_DIR, preexec)`` for :class:`subprocess.Popen`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

__all__ = ["HERE", "Folders", "Here", "Links", "Overlay", "choose"]

Start = tuple[Path | None, Path, Callable[[], None] | None]  # cwd, WEIGHTSYNC_PEER_DIR, preexec_fn


class Folders(Protocol):
    def start(self, folder: Path) -> Start:
        """How the peer whose own folder is ``folder`` (``OUT/peer-k``, absolute, made) starts."""
        ...


class Here:
    def start(self, folder: Path) -> Start:
        return None, folder, None


HERE = Here()  # holds nothing: one is enough


class Links:
    def __init__(self, launch: Path) -> None:
        self.launch = launch

    def start(self, folder: Path) -> Start:
        for entry in self.launch.iterdir():
            mine = folder / entry.name
            if not (mine.exists() or mine.is_symlink() or folder.is_relative_to(entry)):
                mine.symlink_to(entry)
        return folder, folder, None


class Overlay:
    def __init__(self, launch: Path, work: Path) -> None:
        self.launch, self.work = launch, work  # work: overlayfs's scratch folders, one per peer

    def start(self, folder: Path) -> Start:
        work = self.work / folder.name
        _empty(work)
        lower, upper = str(self.launch), str(folder)
        return self.launch, self.launch, lambda: _mount_over(lower, upper, str(work))


def choose(launch: Path, out: Path) -> tuple[Overlay | Links, str | None]:
    """Peers that run in ``launch`` as their own, and a line for the user when the overlay was refused."""
    launch, out = launch.absolute(), out.absolute()
    work = out / ".overlay"
    refused = _try(launch, work)
    if refused is None:
        return Overlay(launch, work), None
    shutil.rmtree(work, ignore_errors=True)
    return Links(launch), (
        f"the kernel refused an overlay of {launch} ({refused}): each peer runs in {out}/peer-k with links to what "
        "is there; a write into a file or folder that exists there is shared by the peers, and ../ leaves the "
        "peer's folder"
    )


# -- the overlay: raw syscalls (Python 3.11 has no os.unshare, and no os.mount at all) ----------------
_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000


def _mount_over(lower: str, upper: str, work: str) -> None:
    """In the child, between fork and exec: a mount namespace of its own (inside a user namespace of
    its own if that is what the kernel lets this user have), the launch folder mounted over itself."""
    if ":" in lower + upper + work or "," in lower + upper + work:
        raise OSError(22, "a folder name with ':' or ',' cannot be an overlayfs option")
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWNS) != 0:
        _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS))
        for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(line)
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None))  # our mounts stay ours
    options = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    _check(libc.mount(b"overlay", lower.encode(), b"overlay", 0, options))
    os.chdir(lower)  # the working folder was the folder under the mount


def _check(result: int) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _try(launch: Path, work: Path) -> str | None:
    """Why an overlay of ``launch`` cannot be made (None: it can): made once in a child that exits."""
    upper, scratch = work / "probe-upper", work / "probe"
    _empty(upper)
    _empty(scratch)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child, which must never return into the launcher)
        code = errno.EOPNOTSUPP  # not Linux (no unshare in its libc), or another failure
        try:
            _mount_over(str(launch), str(upper), str(scratch))
            code = 0
        except OSError as exc:
            code = exc.errno or code
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    shutil.rmtree(upper, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return None if code == 0 else os.strerror(code)


def _empty(folder: Path) -> None:
    """``folder``, made empty: overlayfs leaves a folder of mode 000 in its scratch folder."""

    def writable(remove: Callable[[str], object], path: str, exc: object) -> None:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        shutil.rmtree(path, onerror=writable) if os.path.isdir(path) else remove(path)

    if folder.exists():
        shutil.rmtree(folder, onerror=writable)
    folder.mkdir(parents=True)
