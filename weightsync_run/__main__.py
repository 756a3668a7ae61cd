"""``python -m weightsync_run``: the same command as ``weightsync-run``."""

from __future__ import annotations

import sys

from weightsync_run.cli import main

sys.exit(main())
