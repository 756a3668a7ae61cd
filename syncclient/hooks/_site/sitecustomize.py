"""Imported by Python at startup in every process ``weightsync-run`` starts (this folder is first
on their ``PYTHONPATH``): installs the hooks (:mod:`syncclient.hooks`), then runs the
``sitecustomize`` this file hides. It never stops a program: an interpreter that cannot import
``syncclient`` says so and runs the program without sync.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _install() -> None:
    try:
        from syncclient.hooks import install
    except Exception as exc:  # a program must run even where weightsync cannot
        print(
            f"weightsync: {sys.executable} cannot load the hooks ({type(exc).__name__}: {exc}); "
            "the program runs without sync",
            file=sys.stderr,
            flush=True,
        )
        return
    install()


def _run_hidden_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_install()
_run_hidden_sitecustomize()
