"""A server in a child process, on a port the operating system picks: the one way this project
(the launcher, the tests, the benchmarks) starts a server it talks to.

Binding a "free" port, closing it and handing its number to a child races with every other process
on the machine. Instead the child binds port 0 and, once it listens, writes its URL to a *ready
file* (``syncserver serve --ready-file``; the benchmarks' baseline servers take the same flags). A
restart asks for the port the first start got, so clients retrying the same URL find it again.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import uvicorn

__all__ = ["ServerProcess", "ServerStartError", "run_uvicorn", "write_ready"]

START_SECONDS = 60.0


class ServerStartError(RuntimeError):
    """The server exited, or did not listen in time; the message ends with its log's tail."""


class ServerProcess:
    """``command --port P --ready-file F`` (P = 0 at first) as a child process."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        new_session: bool = False,
        ready_file: Path | None = None,
    ) -> None:
        self.command = list(command)
        self.log = Path(log)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.new_session = new_session  # Ctrl-C at a prompt then reaches only the parent
        self.ready_file = ready_file or self.log.with_name(self.log.name + ".url")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = None

    @property
    def port(self) -> int:
        if self.url is None:
            raise RuntimeError("the server has not started yet")
        port = urlsplit(self.url).port
        assert port is not None
        return port

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process (on the port of the first start, if any); :meth:`wait_ready` next."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.command[0]} is running already")
        self.ready_file.unlink(missing_ok=True)
        port = 0 if self.url is None else self.port
        command = [*self.command, "--port", str(port), "--ready-file", str(self.ready_file)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as f:  # the child keeps its own handle
            self.proc = subprocess.Popen(
                command,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=self.new_session,
            )
        return self.proc

    def wait_ready(self, timeout: float = START_SECONDS) -> str:
        """The server's URL, once it listens. :class:`ServerStartError` if it exits first or
        takes longer than ``timeout`` seconds."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.command[0]} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"{self.command[0]} did not listen within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.02)
        self.url = self.ready_file.read_text().strip()
        return self.url

    def start(self, timeout: float = START_SECONDS) -> str:
        self.spawn()
        return self.wait_ready(timeout)

    def kill(self) -> None:
        """SIGKILL: nothing runs on the way out, as when a VM dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (uvicorn shuts down cleanly), then SIGKILL after ``timeout`` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, chars: int = 5000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


# ---- the child's side ------------------------------------------------------------------------
def write_ready(path: Path, url: str) -> None:
    """Say where a server listens, all at once: readers never see half a URL."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(url + "\n")
    tmp.replace(path)


def run_uvicorn(
    config: uvicorn.Config, *, ready_file: Path | None = None, on_listening: Callable[[str], None] | None = None
) -> None:
    """uvicorn's server, telling its URL once it listens (with port 0: the port the OS chose)
    to ``ready_file`` and ``on_listening``."""
    import asyncio

    import uvicorn

    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            scheme = "https" if config.ssl_certfile else "http"
            url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
            if on_listening is not None:
                on_listening(url)
            if ready_file is not None:
                write_ready(ready_file, url)
        await task

    asyncio.run(serve())
