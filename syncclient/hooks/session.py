"""Which integration syncs this process, and what the hooks say on the way out.

One integration per process: the first to :func:`claim` it. A Hugging Face or Lightning
``Trainer`` claims it when built, before its optimizer steps, so the plain-loop hook then stands
aside (it must not sync the same model again). A program that imported the SDK itself
(``syncclient.client``) wins over every hook.

At exit, in the process the hooks were installed in (not a fork, not a DataLoader worker): one
line saying nothing was found to sync, or one with the run, the version this peer left at and its
weights' sha-256 (peers can be seen to end bit-identical). The first hooked process of a command
marks itself in ``WEIGHTSYNC_HOOKED_PID``; the Python processes it starts (a compile worker, the
trainer ``accelerate launch`` starts) are hooked too but say nothing when they find nothing.
``print`` to stderr, not ``logging``: weightsync-run's own words, in a program whose logging it
does not configure.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["attached", "check_rank", "claim", "crashed", "note", "on_claimed", "owner", "start", "synced_by"]
__all__ += ["uses_sdk"]

_owner: str | None = None  # "torch", "transformers", "lightning", or "sdk"
_pid: int | None = None  # the process the hooks were installed in
_child = False  # started by a hooked process (see the module docstring)
_report: tuple[Callable[[], Any], Callable[[], Any]] | None = None  # (client, model) getters
_said: set[str] = set()
_stand_aside: list[Callable[[], None]] = []  # told when a Trainer claims the process

MARKER = "WEIGHTSYNC_HOOKED_PID"
_WHAT = {"torch": "a torch optimizer", "transformers": "a Hugging Face Trainer", "lightning": "a Lightning Trainer"}


def note(message: str, *, once: bool = False) -> None:
    """One line on stderr, ``weightsync: ...``."""
    if once:
        if message in _said:
            return
        _said.add(message)
    print(f"weightsync: {message}", file=sys.stderr, flush=True)


def start() -> None:
    """Called once by :func:`syncclient.hooks.install`: the exit line belongs to this process."""
    global _pid, _child
    _pid = os.getpid()
    marker = os.environ.get(MARKER)
    _child = marker is not None and marker != str(_pid)
    if not _child:
        os.environ[MARKER] = str(_pid)
    atexit.register(_at_exit)


def owner() -> str | None:
    return _owner


def uses_sdk() -> bool:
    """The program drives the SDK itself (checked before any hook imports it)."""
    return _owner == "sdk" or (_owner is None and "syncclient.client" in sys.modules)


def on_claimed(fn: Callable[[], None]) -> None:
    """``fn()`` once a Trainer claims the process (the plain-loop hook then removes itself)."""
    _stand_aside.append(fn)


def claim(kind: str, what: str) -> bool:
    """May integration ``kind`` (found as ``what``, e.g. ``Trainer``) sync this process?"""
    global _owner
    if _owner is None:
        if "syncclient.client" in sys.modules:
            _owner = "sdk"
            note("the program uses the weightsync SDK itself: the hooks leave it alone")
            return False
        _owner = kind
        if kind != "torch":
            for fn in _stand_aside:
                fn()
        return True
    if _owner == "sdk" or (kind == "torch" and _owner != "torch"):
        return False  # the SDK syncs; or the Trainer's own optimizer: its callback syncs it
    note(f"{what} was built after {_WHAT[_owner]} began to sync: only the first is synced", once=True)
    return False


def attached(client: Callable[[], Any], model: Callable[[], Any]) -> None:
    """What the exit line reports on: the integration's client and model (getters, read at exit)."""
    global _report
    _report = (client, model)


def synced_by(callback: Any, settings: Any, what: str, model: Callable[[], Any]) -> None:
    """A Trainer's ``SyncCallback`` syncs this process: once joined, the hub's rank must be the
    one the data was sharded by; at exit its client and ``model()`` are reported on."""

    def joined(client: Any) -> None:
        if client.rank is not None:
            check_rank(settings, client)

    callback.after_join = joined
    attached(lambda: callback.client, model)
    note(f"{what} in run {settings.run!r} {settings.said_interval()}")


def check_rank(settings: Any, client: Any) -> None:
    """After join: the data was sharded by the launcher's rank (``WEIGHTSYNC_RANK``); if the hub
    ranked this peer otherwise, two peers would train on the same share. Leave and stop."""
    if settings.rank is not None and (settings.rank, settings.world_size) != (client.rank, client.world_size):
        client.leave()
        raise SystemExit(
            f"weightsync: the hub made this peer rank {client.rank} of {client.world_size}, but its data was "
            f"sharded as WEIGHTSYNC_RANK={settings.rank} of WEIGHTSYNC_WORLD_SIZE={settings.world_size} "
            "(the hub ranks peers by their sorted names: name them so, or unset both)"
        )


def crashed() -> bool:
    """The program ends on an uncaught exception (Ctrl-C included): no final sync then."""
    return getattr(sys, "last_value", None) is not None


def _program_started() -> bool:
    """False when Python could not start the program: no such script (``sys.argv[0]`` names no file)
    or module (``python -m`` leaves ``-m`` there). Not ``__main__.__file__``: Python removes it once a
    script has run to its end."""
    program = sys.argv[0] if sys.argv else ""
    return program in ("-c", "") or (program != "-m" and os.path.exists(program))


def _at_exit() -> None:
    if os.getpid() != _pid or multiprocessing.parent_process() is not None:
        return  # a fork, or a worker process: the exit line is the main program's
    if _owner is None and not _child and not crashed() and "syncclient.client" not in sys.modules:
        if not _program_started():
            return  # Python said why (no such script or module): nothing ran, so nothing to add
        note(
            "found nothing to sync: no Hugging Face or Lightning Trainer was built and no torch optimizer "
            "stepped; the program ran unchanged"
        )
        return
    if _owner is None or _report is None or crashed():
        return
    client, model = _report[0](), _report[1]()
    if client is None or model is None or client.version < 0 or client.preempted:
        return  # (preempted: its weights are its own, it said so)
    from syncclient.weights import ModelView
    from syncwire.digest import left_line, weights_sha256

    digest = weights_sha256(ModelView(model).export())
    print(left_line(client.peer, client.run, client.version, digest), file=sys.stderr, flush=True)
