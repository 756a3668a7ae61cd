"""``weightsync-run``: run a training program unchanged, with the weightsync SDK hooked in.

On two GPU machines and a hub (each line on its own machine; ``--min-peers 2``: the run starts
once both peers joined, so they start from the same weights and meet at every sync):

    syncserver serve --host 0.0.0.0 --port 8000
    weightsync-run --hub http://hub:8000 --run imdb --min-peers 2 -- python train.py --epochs 3
    weightsync-run --hub http://hub:8000 --run imdb --min-peers 2 -- python train.py --epochs 3

On one machine, an embedded hub and K peers:

    weightsync-run --local-peers 2 -- python examples/plain_loop.py
    python -m weightsync_run --local-peers 2 --sync-every 20 -- python -m mypackage.train

It runs COMMAND as it is, with hooks that find what it trains (:mod:`syncclient.hooks`; a program
in which none is found runs unchanged and says so). The run settings are flags generated from the
table both sides read (:data:`syncwire.runsettings.RUN_SETTINGS`); every option is also a
``WEIGHTSYNC_*`` variable (a flag beats its variable). With ``--hub`` the command *becomes*
COMMAND (``exec``: same process, signals, exit code). With ``--local-peers K`` it runs an embedded
hub and K copies of COMMAND through :func:`syncserver.local.launch` (``weightsync[server]``), each
in the folder you launch from, as on a VM of its own: what it writes lands in ``OUT/peer-k``
(:mod:`syncserver.workdirs`; its console in ``OUT/peer-k.log``), and checks at the end that every
peer left with the hub's last version, bit for bit (docs/launcher.md).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from syncclient.hooks import SITE
from syncclient.hooks.session import MARKER
from syncclient.hooks.settings import DEFAULT_SYNC_EVERY, ENV, HookSettings, SettingsError, flag_name
from syncclient.peerlr import DEFAULT_PEER_LR, LR_SCALINGS
from syncclient.preemption import METADATA_URL, MODES
from syncwire.runsettings import RUN_SETTINGS

__all__ = ["build_parser", "main"]

LOCAL_RUN = "local"  # the run's name under --local-peers, unless --run says otherwise


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block: the line names the flag, --help has the rest."""
        _fail(f"{message} (see weightsync-run --help)", 2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="weightsync-run",
        description="Run a training program unchanged, its model averaged with other peers' through a weightsync hub.",
        epilog="Exit code: 2 bad input (one line on stderr); with --hub 3 when the hub does not answer, 126/127 "
        "when COMMAND cannot run, else COMMAND's own; with --local-peers 0 when all peers succeeded, 1 a peer "
        "failed (or ended with weights other than the hub's), 3 the hub failed, 130 interrupted.",
        allow_abbrev=False,  # every flag spelled out: COMMAND's own flags follow
    )
    add = p.add_argument_group("the run").add_argument
    add("--hub", metavar="URL", help="the hub to join, e.g. https://hub:8000 [WEIGHTSYNC_HUB]")
    add("--run", metavar="NAME", help=f"the run to join [WEIGHTSYNC_RUN; with --local-peers: {LOCAL_RUN}]")
    add("--token", metavar="TOKEN", help="the run's bearer token [WEIGHTSYNC_TOKEN]")
    add(
        "--peer", metavar="NAME", help="this peer's name, unique; ranks follow sorted names [WEIGHTSYNC_PEER; host-pid]"
    )
    every = (
        "sync every N optimizer steps, or on a schedule EVERY:UNTIL,...,EVERY (5:60,15: every 5 until step 60, then "
    )
    every += "every 15), or auto: the hub picks each interval, keeping --utilization of the time computing "
    every += f"[WEIGHTSYNC_SYNC_EVERY; default {DEFAULT_SYNC_EVERY}; not with --round-samples, but async]"
    add("--sync-every", metavar="N|auto", help=every)
    scaling = "each peer's learning rate: the program's (serial's, at the global batch) x 1, x sqrt(N) or x N with N "
    scaling += f"peers [WEIGHTSYNC_LR_SCALING; default {DEFAULT_PEER_LR.scaling}]"
    add("--lr-scaling", metavar="|".join(LR_SCALINGS), help=scaling)
    warmup = "optimizer steps over which that factor ramps in from 1 [WEIGHTSYNC_LR_SCALING_WARMUP; default: one round]"
    add("--lr-scaling-warmup", metavar="STEPS", help=warmup)
    shard = "do not shard the training data by rank (the program shards it itself) [WEIGHTSYNC_SHARD=0]"
    add("--no-shard", action="store_const", const="0", dest="shard", help=shard)
    seed = "keep the program's seeds as they are (by default a constant seed becomes seed + rank, so peers draw "
    seed += "different batches and dropout masks) [WEIGHTSYNC_SEED=0]"
    add("--same-seed", action="store_const", const="0", dest="seed", help=seed)
    given = "a new run takes its first peer's; a peer joining a run that exists must agree with each one it gives. "
    given += "Unset: the run's, or for a new run the hub's default (its SYNC_* settings)"
    add = p.add_argument_group("run settings", given).add_argument
    for setting in RUN_SETTINGS:
        metavar = setting.metavar or "|".join(setting.choices)
        add(flag_name(setting.name), metavar=metavar, help=f"{setting.help} [{ENV[setting.name]}]")
    add = p.add_argument_group("on this machine").add_argument
    notice = "act on the machine's end: the cloud's preemption notice (auto finds it) and SIGTERM: hand in the steps "
    notice += "since the last sync, leave, exit 143 [WEIGHTSYNC_PREEMPTION; default auto]"
    add("--preemption", metavar="|".join(MODES), help=notice)
    where = f"the cloud's metadata server [WEIGHTSYNC_METADATA_URL; default {METADATA_URL}]"
    add("--metadata-url", metavar="URL", help=where)
    add("--local-peers", metavar="K", help="run an embedded hub and K peers of COMMAND [WEIGHTSYNC_LOCAL_PEERS]")
    add("--out", metavar="DIR", help="the peers' folders, the hub's data and logs [WEIGHTSYNC_OUT; ./weightsync-local]")
    add(
        "--metric",
        metavar="NAME",
        help="the metric of the peers' updates the round table shows [WEIGHTSYNC_METRIC; loss]",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the program to run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        _fail("give the program to run after --, e.g. -- python train.py", 2)
    env: Mapping[str, str] = os.environ
    try:
        if args.local_peers is not None:
            peers = _count(args.local_peers, "--local-peers")
        else:
            peers = _count(env.get("WEIGHTSYNC_LOCAL_PEERS"), "WEIGHTSYNC_LOCAL_PEERS")
        if peers and args.hub:
            raise SettingsError("--local-peers runs its own hub: drop --hub")
        fields = ["hub", "run", "token", "peer", "sync_every", "shard", "seed", "lr_scaling", "lr_scaling_warmup"]
        fields += ["preemption", "metadata_url"]
        flags = {field: getattr(args, field) for field in fields}
        flags |= {setting.name: getattr(args, setting.name) for setting in RUN_SETTINGS}
        if peers:  # the launcher gives each peer its hub, run, name and rank, and waits for all K
            for field in ("peer", "min_peers"):
                if getattr(args, field) is not None:
                    raise SettingsError(f"{flag_name(field)}: --local-peers names its peers and waits for all K")
            flags["run"] = args.run or env.get(ENV["run"]) or LOCAL_RUN
            mine = (ENV["hub"], ENV["peer"], ENV["rank"], ENV["world_size"], ENV["min_peers"])
            env = {k: v for k, v in env.items() if k not in mine}
        settings = HookSettings.resolve(flags, env, launched=bool(peers))
    except SettingsError as exc:
        _fail(str(exc), 2)
    missing = missing_script(command)
    if missing is not None:
        _fail(f"no such script: {missing} (COMMAND runs from {Path.cwd()})", 2)
    if peers:
        out = Path(args.out or env.get("WEIGHTSYNC_OUT") or "weightsync-local")
        return run_local(
            settings, command, peers=peers, out=out, metric=args.metric or env.get("WEIGHTSYNC_METRIC") or "loss"
        )
    exec_peer(settings, command)


def hook_env(settings: HookSettings, base: Mapping[str, str], *, local: bool) -> dict[str, str]:
    """``base`` with the hooks on: their folder first on ``PYTHONPATH`` (with this checkout's root,
    for a ``syncclient`` not installed) and the settings as variables (under ``--local-peers`` the
    launcher sets the hub, run, token, name and rank itself)."""
    env = {k: v for k, v in base.items() if k not in ENV.values() and k != MARKER}
    given = settings.to_env()
    if local:
        given = {k: v for k, v in given.items() if k not in (ENV["run"], ENV["token"])}
    root = str(Path(SITE).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, root, base.get("PYTHONPATH")]))
    return env | given


def exec_peer(settings: HookSettings, command: list[str]) -> NoReturn:
    """Become COMMAND, hooked: its process, its signals, its exit code; once the hub answers."""
    problem = hub_problem(settings.hub)
    if problem is not None:
        _fail(f"no hub at {settings.hub}: {problem}", 3)
    env = hook_env(settings, os.environ, local=False)
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        _fail(f"cannot run {command[0]!r}: no such program", 127)
    except PermissionError:
        _fail(f"cannot run {command[0]!r}: not executable", 126)
    except OSError as exc:
        _fail(f"cannot run {command[0]!r}: {exc.strerror}", 126)


def run_local(settings: HookSettings, command: list[str], *, peers: int, out: Path, metric: str) -> int:
    """An embedded hub and ``peers`` hooked copies of COMMAND, each in this folder as its own; then the
    launcher's check (each peer's final weights against the hub's), results.json and plot."""
    try:
        from syncserver.local import LaunchError, launch
    except ModuleNotFoundError as exc:
        _fail(f"--local-peers runs a hub, which needs {exc.name}: pip install 'weightsync[server]'", 2)
    from syncserver.workdirs import choose

    env = hook_env(settings, os.environ, local=True)
    folders, refused = choose(Path.cwd(), out)
    if refused:
        _note(refused)
    where: dict[str, Any] = {"peers": peers, "out": out, "run": settings.run, "token": settings.token}
    try:
        return launch(command, metric=metric, env=env, folders=folders, **where)
    except LaunchError as exc:
        _fail(str(exc), exc.exit_code)


# Python's options that take a value (``-W error``, ``-X dev``): the word after them is no script
_PYTHON_VALUE_OPTIONS = {"-W", "-X", "--check-hash-based-pycs"}


def missing_script(command: Sequence[str]) -> str | None:
    """The script of ``python [options] SCRIPT ...`` when it does not exist (else None): Python
    would say so only after the hooks had started. ``-c``, ``-m`` and other programs: None."""
    if not re.fullmatch(r"python[\d.]*", os.path.basename(command[0])):
        return None
    words = iter(command[1:])
    for word in words:
        if word in _PYTHON_VALUE_OPTIONS:
            next(words, None)
        elif word == "-" or word.startswith(("-c", "-m")) or word == "--":
            return None
        elif not word.startswith("-"):
            return None if os.path.exists(word) else word
    return None


def hub_problem(hub: str, *, wait: float = 5.0) -> str | None:
    """Why ``hub`` does not answer ``GET /healthz`` within ``wait`` seconds (None: it does). The SDK
    would retry a join for minutes; a hub that is not there is far more often a typo than a slow
    start, so the launcher says so in one line first."""
    import httpx

    deadline = time.monotonic() + wait
    while True:
        try:
            response = httpx.get(f"{hub}/healthz", timeout=min(5.0, wait))  # verified as the SDK does
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            if response.status_code == 200:
                return None
            return f"GET /healthz answered {response.status_code}: is it a weightsync hub?"
        if time.monotonic() >= deadline:
            return reason
        time.sleep(0.5)


def _count(raw: str | None, source: str) -> int:
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{source}: expected an integer, got {raw!r}") from None
    if value < 1:
        raise SettingsError(f"{source}: must be >= 1, got {value}")
    return value


def _note(line: str) -> None:
    print(f"weightsync-run: {line}", file=sys.stderr, flush=True)


def _fail(line: str, code: int) -> NoReturn:
    print(f"weightsync-run: error: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
