"""``weightsync-run``, the zero-code launcher: a training program run unchanged, synced by the
SDK's hooks (:mod:`syncclient.hooks`) through a hub, or with ``--local-peers`` through a hub it
runs itself (:mod:`syncserver.local`).

Its own package because it depends on both sides: ``syncclient`` alone never needs the hub
installed, and the hub never imports the SDK. The hub is imported only for ``--local-peers``.
See :mod:`weightsync_run.cli`.
"""

from __future__ import annotations

from weightsync_run.cli import build_parser, main

__all__ = ["build_parser", "main"]
