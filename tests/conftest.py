"""Shared fixtures: real hubs on 127.0.0.1 (a free port each), tiny real models.

``hub_factory`` starts ``python -m syncserver serve`` as a real process, so tests can kill
it with SIGKILL and start it again on the same data dir. ``hub`` is one such hub.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel  # imported once here: lazy imports race in threads

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Hub:
    """A hub process; ``url`` stays the same across restarts."""

    data_dir: Path
    port: int
    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    scheme: str = "http"
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Hub:
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the process)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "syncserver",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--log-level",
                "warning",
                *self.args,
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hub exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1, verify=False).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError(f"hub did not start in {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as when a VM dies."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]


@pytest.fixture
def hub_factory(tmp_path: Path) -> Iterator[Callable[..., Hub]]:
    """``hub_factory("--min-peers", "2", env={"SYNC_TOKEN": "t"})`` -> a started Hub."""
    hubs: list[Hub] = []

    def make(*args: str, env: dict[str, str] | None = None, data_dir: Path | None = None, start: bool = True) -> Hub:
        n = len(hubs)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
        full_env.update(env or {})
        hub = Hub(data_dir or tmp_path / f"hub{n}", free_port(), list(args), full_env, tmp_path / f"hub{n}.log")
        hubs.append(hub)
        return hub.start() if start else hub

    yield make
    for hub in hubs:
        hub.stop()


@pytest.fixture
def hub(hub_factory: Callable[..., Hub]) -> Hub:
    return hub_factory()


def tiny_gpt2(seed: int = 0, **overrides: int) -> GPT2LMHeadModel:
    """A randomly initialised GPT-2 small enough for a unit test (~40k parameters)."""
    torch.manual_seed(seed)
    shape = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 32, **overrides}
    config = GPT2Config(bos_token_id=0, eos_token_id=0, **shape)
    return GPT2LMHeadModel(config)
