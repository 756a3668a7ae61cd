"""The one launcher: an embedded hub and K peer processes of any command, on this machine.

    weightsync-run --local-peers 2 --out runs/try --metric eval_loss -- python train.py --epochs 1

``weightsync_run/cli.py`` and ``train/finetune_gpt2.py --local-peers`` call :func:`launch`; what a
user sees (folders, logs, the ``WEIGHTSYNC_*`` variables each peer gets, exit codes) is in
docs/getting-started.md. The hub runs as ``syncserver serve --port 0`` in a child, which writes its
URL to ``OUT/hub.url``. Peers are named ``peer-0`` ... so that the hub's ranks (by sorted name) are
their ``WEIGHTSYNC_RANK``, and get ``OMP_NUM_THREADS`` = cores // K unless it is set (as ``torchrun``
does). The table of rounds, the check of the final weights against the hub's last version
(:func:`syncwire.digest.left_line`, which peers print as they leave) and ``results.json`` come from
the hub and the peers' logs alone: any program that syncs through the hub fills them.

Supervision: a peer that fails or a hub that exits stops the run: the other peers get SIGINT (they
leave the run), then SIGTERM, then SIGKILL, a grace period each, and the hub goes last; SIGINT or
SIGTERM to the launcher does the same. :class:`LaunchError` names what failed, how, and its log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import safetensors.numpy
from pydantic import SecretStr

import syncserver
from syncserver.process import ServerProcess, ServerStartError
from syncserver.settings import HubSettings, SettingsInputError, hub_settings
from syncserver.workdirs import HERE, Folders
from syncwire.digest import LEFT, weights_sha256

__all__ = [
    "PEER_EXIT",
    "HUB_EXIT",
    "SETTINGS_EXIT",
    "INTERRUPTED_EXIT",
    "LaunchError",
    "LocalRun",
    "RoundTable",
    "hub_settings_for",
    "check_final",
    "launch",
    "settings_env",
]

log = logging.getLogger(__name__)

PEER_EXIT, HUB_EXIT = 1, 3  # the launcher's exit codes for "a peer failed" and "the hub failed"
SETTINGS_EXIT = 2  # a hub setting (a SYNC_* variable) that does not hold: bad input
INTERRUPTED_EXIT = 130  # Ctrl-C or SIGTERM: the shell's code for SIGINT
HUB_START_SECONDS = 60.0
GRACE_SECONDS = 10.0  # per stopping signal: time to leave the run, flush logs, save


class LaunchError(Exception):
    """A launch that failed; ``exit_code`` says how (a child, a hub setting, an interrupt)."""

    def __init__(self, message: str, exit_code: int) -> None:  # PEER_EXIT, HUB_EXIT, SETTINGS_EXIT, INTERRUPTED_EXIT
        super().__init__(message)
        self.exit_code = exit_code


def hub_settings_for(out: Path, peers: int, token: str | None = None) -> HubSettings:
    """The embedded hub's settings, for every launcher of this machine: its ``SYNC_*`` variables,
    overridden by data in ``out/hub``, a rendezvous of all ``peers`` and ``token`` if given. A bad
    variable: :class:`LaunchError` naming it, exit code :data:`SETTINGS_EXIT`."""
    flags = {"data_dir": str(out / "hub"), "min_peers": str(peers)} | ({"token": token} if token else {})
    try:
        return hub_settings(flags)
    except SettingsInputError as exc:
        raise LaunchError(f"hub settings: {exc}", SETTINGS_EXIT) from None


def settings_env(settings: HubSettings) -> dict[str, str]:
    """The ``SYNC_*`` variables that give a child hub these settings (not flags: tokens stay out of ``ps``)."""

    env = {}
    for name in settings.model_fields_set:
        value = getattr(settings, name)
        if isinstance(value, dict):
            value = json.dumps(value, default=SecretStr.get_secret_value)
        elif isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is not None:
            env[f"SYNC_{name.upper()}"] = str(value)
    return env


class RoundTable:
    """One printed row per closed round of a run's status (``GET /v1/runs/{run}``), kept in ``rows``
    as JSON-ready dicts (``results.json``'s rounds: ``metrics`` are each peer's from its update,
    ``bytes_down`` the result times its participants, ``seconds`` from first update to close)."""

    def __init__(self, peers: Sequence[str], metric: str, echo: Callable[[str], None], t0: float) -> None:
        self.peers, self.metric, self.echo, self.t0 = list(peers), metric, echo, t0
        self.width = max(10, *(len(p) for p in self.peers))
        self.rows: list[dict[str, Any]] = []

    def header(self) -> None:
        names = " ".join(f"{p:>{self.width}}" for p in self.peers)
        self.echo(
            f"{'round':>5} {'step':>6} {'peers':>5} {'samples':>8} {names} "
            f"{'MB up':>9} {'MB down':>9} {'round s':>7} {'elapsed':>7}"
        )
        self.echo(f"{'':>27}{self.metric} per peer, from its update of the round")

    def update(self, status: dict[str, Any]) -> None:
        """Print the rounds of ``status`` not printed yet, in order."""
        done = self.rows[-1]["round"] if self.rows else -1
        metrics: dict[int, dict[str, dict[str, float]]] = {}
        for u in status.get("updates", []):
            metrics.setdefault(u["round"], {})[u["peer"]] = u["metrics"]
        for record in sorted(status.get("rounds", []), key=lambda r: r["round"]):
            if record["round"] <= done:
                continue
            sent = metrics.get(record["round"], {})
            steps = [m["step"] for m in sent.values() if "step" in m]
            row = {
                "round": record["round"],
                "version": record["round"] + 1,
                "step": int(max(steps)) if steps else None,
                "participants": len(record["participants"]),
                "dropped": record["dropped"],
                "samples": record["samples"],
                "metrics": {p: sent.get(p) for p in self.peers},
                "bytes_up": record["bytes_in"],
                "bytes_down": record["result_bytes"] * len(record["participants"]),
                "seconds": round(record["closed"] - record["opened"], 3),
                "elapsed": round(time.time() - self.t0, 1),
            }
            self.rows.append(row)
            values = [(m or {}).get(self.metric) for m in row["metrics"].values()]
            # .6g: 10760.1, not 1.076e+04
            cells = " ".join(f"{'-':>{self.width}}" if v is None else f"{v:>{self.width}.6g}" for v in values)
            step = "-" if row["step"] is None else row["step"]
            self.echo(
                f"{row['round']:>5} {step:>6} {row['participants']:>5} {row['samples']:>8} {cells} "
                f"{row['bytes_up'] / 1e6:>9.2f} {row['bytes_down'] / 1e6:>9.2f} {row['seconds']:>7.2f} "
                f"{row['elapsed']:>7.0f}"
            )


class LocalRun:
    """An embedded hub plus K peers of ``command``; a context manager that stops them all.

    ``with LocalRun(...) as launched: rows = launched.wait()``: while inside, ``hub_url`` answers
    (a caller may still download the final version after ``wait``); leaving stops every child.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        peers: int,
        out: Path,
        settings: HubSettings,
        run: str,
        metric: str = "loss",
        env: Mapping[str, str] | None = None,
        folders: Folders = HERE,
    ) -> None:
        if not command:
            raise ValueError("give the command each peer runs, e.g. ['python', 'train.py']")
        if peers < 1:
            raise ValueError(f"peers must be >= 1, got {peers}")
        self.command, self.k, self.out, self.settings, self.run = list(command), peers, Path(out), settings, run
        self.env, self.folders = dict(os.environ if env is None else env), folders
        digits = len(str(peers - 1))  # peer-07 sorts before peer-10: the hub's ranks follow the names
        self.peers = [f"peer-{i:0{digits}d}" for i in range(peers)]
        # the narrowest token that lets a peer into the run: its run token, else the hub's
        secret = settings.run_tokens.get(run) or settings.token or settings.admin_token
        self.token = secret.get_secret_value() if secret is not None else None
        self.auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.table = RoundTable(self.peers, metric, _print, time.time())
        self.hub_url = ""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self._handlers: dict[int, Any] = {}

    def __enter__(self) -> LocalRun:
        # `kill` stops the children as Ctrl-C does; SIGINT is set too because a shell starts
        # background jobs with it ignored.
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._handlers[signum] = signal.signal(signum, _interrupt)
        try:
            self._start_hub()
            self._start_peers()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_hub(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        hub = ServerProcess(
            [sys.executable, "-m", "syncserver", "serve", "--host", "127.0.0.1"],
            log=self.out / "hub.log",
            env=_child_env(dict(os.environ, **settings_env(self.settings))),
            new_session=True,
            ready_file=self.out / "hub.url",
        )
        self.procs["hub"], self.logs["hub"] = hub.spawn(), hub.log
        try:
            self.hub_url = hub.wait_ready(HUB_START_SECONDS)
        except ServerStartError:
            self._check()  # a hub that exited: named with its exit
            raise LaunchError(
                f"the hub did not listen within {HUB_START_SECONDS:.0f} s (log: {self.logs['hub']})", HUB_EXIT
            ) from None

    def _start_peers(self) -> None:
        _note(f"hub and dashboard at {self.hub_url}/ ; {self.k} peers of: {' '.join(self.command)}")
        _note(f"logs: {self.logs['hub']}, {self.out}/peer-*.log")
        base = {k: v for k, v in self.env.items() if k != "WEIGHTSYNC_TOKEN"}
        if self.token:
            base["WEIGHTSYNC_TOKEN"] = self.token
        base |= {"WEIGHTSYNC_HUB": self.hub_url, "WEIGHTSYNC_RUN": self.run, "WEIGHTSYNC_WORLD_SIZE": str(self.k)}
        for rank, name in enumerate(self.peers):
            env = base | {"WEIGHTSYNC_PEER": name, "WEIGHTSYNC_RANK": str(rank)}
            threads = max(1, _cores() // self.k)
            self.procs[name], self.logs[name] = _start(name, self.command, self.out, env, self.folders, threads)
        self.table.header()

    def wait(self, poll_seconds: float = 0.5) -> list[dict[str, Any]]:
        """Print rounds as they close until every peer has exited 0; return the table's rows.
        Raises :class:`LaunchError` as soon as a peer or the hub fails."""
        while True:
            self._show_rounds()
            self._check()
            if all(self.procs[p].poll() == 0 for p in self.peers):
                break
            time.sleep(poll_seconds)
        self._show_rounds()  # the last round closed while the peers were finishing
        return self.table.rows

    def _show_rounds(self) -> None:
        try:
            response = httpx.get(f"{self.hub_url}/v1/runs/{self.run}", headers=self.auth, timeout=10)
        except httpx.HTTPError as exc:  # the hub's health is _check's business; try again next time
            log.debug("run status: %s", exc)
            return
        if response.status_code == 200:  # 404 until the first peer creates the run
            self.table.update(response.json())

    def _check(self) -> None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is None or (code == 0 and name != "hub"):
                continue
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            raise LaunchError(
                f"{name} {how}: {_last_line(self.logs[name])} (log: {self.logs[name]})",
                HUB_EXIT if name == "hub" else PEER_EXIT,
            )

    def final_weights(self) -> tuple[int, str] | None:
        """The hub's last version of the run and its digest; None when no peer created the run."""
        response = httpx.get(f"{self.hub_url}/v1/runs/{self.run}/model", headers=self.auth, timeout=120)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return int(response.headers["X-Sync-Version"]), weights_sha256(safetensors.numpy.load(response.content))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for signum in self._handlers:  # a second Ctrl-C must not cut the stopping short
            signal.signal(signum, signal.SIG_IGN)
        # Peers first, while the hub still answers, so that they can leave the run.
        _stop([p for name, p in self.procs.items() if name != "hub"], [signal.SIGINT, signal.SIGTERM])
        _stop([p for name, p in self.procs.items() if name == "hub"], [signal.SIGTERM])
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers.clear()


def launch(
    command: Sequence[str],
    *,
    peers: int,
    out: Path,
    run: str,
    token: str | None = None,
    metric: str = "loss",
    env: Mapping[str, str] | None = None,
    folders: Folders = HERE,
    serial: Sequence[str] | None = None,
    curve: Callable[[Path], list[tuple[int, float]]] | None = None,
) -> int:
    """A fresh run (``out/hub`` removed first) of ``peers`` peers of ``command`` (each started as
    ``folders`` says, :mod:`syncserver.workdirs`; by default where the launcher runs), then the check
    of their final weights, ``serial`` alone if given (the serial baseline: no hub, every core),
    ``out/results.json`` and the plot of ``metric``:
    ``curve(folder)`` of each process if given, else what each peer sent with its updates. 0, or
    :data:`PEER_EXIT` when a peer's final weights differ from the hub's; :class:`LaunchError` when a
    child fails, on a bad hub setting and when interrupted."""
    t0 = time.time()
    settings = hub_settings_for(out, peers, token)
    shutil.rmtree(out / "hub", ignore_errors=True)
    try:
        with LocalRun(
            command, peers=peers, out=out, settings=settings, run=run, metric=metric, env=env, folders=folders
        ) as launched:
            rows = launched.wait()
            hub = launched.final_weights()
        wall = {"peers": round(time.time() - t0, 2)}
        logs = {p: launched.logs[p] for p in launched.peers}
        if serial is not None:
            logs["serial"] = _run_serial(serial, out, env, folders)
            wall["serial"] = round(time.time() - t0 - wall["peers"], 2)
    except KeyboardInterrupt:
        raise LaunchError("interrupted: stopped the hub and the peers", INTERRUPTED_EXIT) from None
    if hub is None:
        _note(f"no run {run!r} on the hub: no peer joined it")
        return 0
    _print(f"hub: run {run!r} ended at version {hub[0]}; weights sha256 {hub[1]}")
    final = {p: _left(logs[p]) for p in launched.peers}
    check = check_final(final, hub)
    for name, log in logs.items():
        _print(f"{name}: {_last_line(log)}")
    results: dict[str, Any] = {"command": list(command), "run": run, "metric": metric, "rounds": rows}
    results |= {"final": final, "hub_version": hub[0], "hub_weights_sha256": hub[1], **check, "wall_seconds": wall}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    curves = {p: curve(out / p) if curve else _table_curve(rows, p, metric) for p in logs}
    plotted = _plot(curves, [r["step"] for r in rows if r["step"] is not None], out / f"{metric}.png", metric)
    took = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in wall.items())
    _print(f"wall time: {took}; results in {out / 'results.json'}" + (f", plot {plotted}" if plotted else ""))
    return PEER_EXIT if check.get("weights_equal_hub") is False else 0


def _left(log: Path) -> dict[str, Any] | None:
    """The version and weights digest a peer printed as it left the run (its last such line), if it did."""
    found = LEFT.findall(log.read_text(errors="replace"))
    return {"version": int(found[-1][2]), "weights_sha256": found[-1][3]} if found else None


def check_final(final: dict[str, dict[str, Any] | None], hub: tuple[int, str]) -> dict[str, bool]:
    """Whether the peers that printed their digest as they left (``final``: peer -> version and
    digest, or None) hold identical weights, and those that left at the hub's last version hold
    exactly it (``hub``: version, digest); printed. One that left earlier is named, not failed."""
    left = {p: f for p, f in final.items() if f is not None}
    if not left:
        return {}
    at_last = {f["weights_sha256"] for f in left.values() if f["version"] == hub[0]}
    check = {
        "weights_identical": len({f["weights_sha256"] for f in left.values()}) == 1,
        "weights_equal_hub": at_last == {hub[1]},
    }
    yes = {k: "yes" if v else "NO" for k, v in check.items()}
    early = "".join(f"; {p} left at version {f['version']}" for p, f in left.items() if f["version"] != hub[0])
    line = f"final weights identical across peers: {yes['weights_identical']}; equal to the hub's version {hub[0]}: "
    _print(line + yes["weights_equal_hub"] + early)
    return check


def _run_serial(command: Sequence[str], out: Path, env: Mapping[str, str] | None, folders: Folders) -> Path:
    """The serial baseline: ``command`` alone, no hub, with every core; its log."""
    _note(f"serial baseline: one process, in {(out / 'serial').absolute()} (log: {out / 'serial.log'}) ...")
    base = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("WEIGHTSYNC_")}
    proc, log = _start("serial", command, out, base, folders, _cores())
    try:
        code = proc.wait()
    finally:
        _stop([proc], [signal.SIGINT])  # interrupted: it has a session of its own, Ctrl-C did not reach it
    if code != 0:
        raise LaunchError(f"the serial baseline exited with code {code}: {_last_line(log)} (log: {log})", PEER_EXIT)
    return log


def _table_curve(rows: list[dict[str, Any]], peer: str, metric: str) -> list[tuple[int, float]]:
    """``metric`` as ``peer`` sent it with each update (none for the serial baseline)."""
    values = ((r["step"], (r["metrics"].get(peer) or {}).get(metric)) for r in rows)
    return [(step, value) for step, value in values if step is not None and value is not None]


def _plot(curves: dict[str, list[tuple[int, float]]], syncs: list[int], path: Path, metric: str) -> Path | None:
    """``metric`` against the step, a line per process (the serial baseline dashed), syncs in grey;
    log scale when it spans a decade (perplexity). None when there is nothing to draw, or no matplotlib."""
    curves = {name: points for name, points in curves.items() if points}
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None
    if not curves:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name, points in curves.items():
        style = {"ls": "--", "color": "black"} if name == "serial" else {"marker": "."}
        ax.plot(*zip(*points, strict=True), alpha=0.8, label=name, **style)  # type: ignore[arg-type]
    for step in sorted(set(syncs)):
        ax.axvline(step, color="grey", lw=0.5, alpha=0.4)
    values = [v for points in curves.values() for _, v in points]
    if min(values) > 0 and max(values) > 10 * min(values):
        ax.set_yscale("log")
    peers = sum(name != "serial" for name in curves)
    ax.set(xlabel="optimizer step (per peer)", ylabel=metric, title=f"{metric}: {peers} peer(s), syncs in grey")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _start(
    name: str, cmd: Sequence[str], out: Path, env: dict[str, str], folders: Folders, threads: int
) -> tuple[subprocess.Popen[bytes], Path]:
    """``cmd`` as ``name``, and its log ``out/<name>.log``: its folder ``out/<name>``, where and how
    ``folders`` says, named in ``WEIGHTSYNC_PEER_DIR``; ``OMP_NUM_THREADS`` ``threads`` unless set,
    and a session of its own (Ctrl-C reaches only the launcher)."""
    folder, log = (out / name).absolute(), out / f"{name}.log"  # absolute: the child may run in it
    folder.mkdir(parents=True, exist_ok=True)
    cwd, mine, enter = folders.start(folder)
    env = _child_env({"OMP_NUM_THREADS": str(threads), **env, "WEIGHTSYNC_PEER_DIR": str(mine)})
    with log.open("wb") as f:  # the child keeps its own handle
        try:
            popen = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True, preexec_fn=enter
            )
        except subprocess.SubprocessError:  # the overlay, refused after the probe allowed it
            raise LaunchError(f"cannot start {name}: its folder could not be mounted", PEER_EXIT) from None
        except OSError as exc:
            raise LaunchError(f"cannot start {name}: {' '.join(cmd)}: {exc.strerror}", PEER_EXIT) from None
    return popen, log


def _stop(procs: list[subprocess.Popen[bytes]], signals: list[signal.Signals]) -> None:
    """Send each signal in turn to those still running, a grace period each; then SIGKILL."""
    for signum in signals:
        running = [p for p in procs if p.poll() is None]
        if not running:
            return
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)
        deadline = time.monotonic() + GRACE_SECONDS
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _child_env(env: dict[str, str]) -> dict[str, str]:
    """The children import this very syncserver, also when it runs from a checkout."""
    root = str(Path(syncserver.__file__).resolve().parents[1])
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))}


def _last_line(path: Path) -> str:
    """The program's own last line: not the hooks' notes on the way out (``weightsync: ...``)."""
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("weightsync: ")] or lines
    return lines[-1] if lines else "(no output)"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _print(line: str) -> None:
    print(line, flush=True)


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
