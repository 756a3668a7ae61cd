"""Benchmark 1 of "Bytes and speed": one sync round of GPT-2 124M through the real hub.

    python bench/round.py                                        # N = 2 4 8, all codecs, GPT-2 124M
    python bench/round.py --peers 2 4 --codecs fp32 int8         # a subset
    python bench/round.py --model tiny --peers 2 --codecs fp32 int8   # seconds (the smoke test)
    python bench/round.py --peers 8 --codecs int8 int4 --baselines limit gloo   # what fits 24 GiB at 8
    python bench/round.py --peers 2 --codecs fp32 --profile --data-root /dev/shm # py-spy; hub off disk

For each N and codec: a real hub process (``python -m syncserver serve`` on a loopback
port the OS picks, its own temp data dir, ``--min-peers N``) and N peer processes driving the real
``SyncClient``. Each peer holds a lean module with GPT-2's parameter names and shapes (no
transformers model: 8 peers must fit in 24 GiB), perturbs its weights (its delta), and all
call ``sync()`` at the same instant. After every round all peers must hold the hub's latest
version bit for bit (checked by sha-256, peers against each other and against the hub's file).

Measured in the same run, on the same peer processes and payload sizes:

- **round**: from the first peer's first upload byte (its PUT is sent) to the last peer
  holding the new version (``sync()`` returned); ``sync`` also counts the client's encoding
  before the upload (from the common start instant).
- **limit**: the same N processes stream the same number of bytes (a payload of the same
  codec and layout) with httpx to a trivial uvicorn endpoint that discards them
  (``bench/baselines/limit_server.py``), then each downloads one copy of the result's size
  once all N uploads are in. Timed from the first upload byte to the last byte downloaded.
- **gloo**: ``torch.distributed.all_reduce`` of the same float32 parameters among N ranks on
  127.0.0.1, in 25 MB buckets like DDP, then divided by N (median of ``--gloo-reps``).
- **origin**: the origin design (``bench/baselines/pickle_hub.py``: whole-body pickle over
  HTTP with ``requests``, every peer downloads every other peer's weights and averages locally).
  Only for N in ``--pickle-peers`` (default 2): at 4 peers the original ran out of memory.

Hub peak RSS is VmHWM of the hub process, reset (``/proc/<pid>/clear_refs``) before each
round, so it is the peak of that round (file pages the hub maps count too). **Hub CPU-s** is
the hub process's own user + system seconds over the round (its CPU clock, :func:`cpu_seconds`; its threads
included, its children not: other processes' load does not count), beside the limit server's
and the origin pickle hub's over theirs; the median of the rounds. Seconds are the
best of ``--rounds`` rounds (of ``--gloo-reps`` for gloo), the same statistic for every
column; the JSON also has the medians and every repetition. Results: a markdown table on stdout and
``bench/results/round-<date>.json`` (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(REPO), str(BENCH)]

import record  # noqa: E402 (bench/record.py: the targets table)

# -----------------------------------------------------------------------------
# settings
parser = argparse.ArgumentParser(description="One sync round through the real hub, with baselines.")
parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8], help="numbers of peers (N)")
parser.add_argument("--codecs", nargs="+", default=["fp32", "bf16", "int8", "int4"], help="run codecs")
parser.add_argument(
    "--model",
    choices=["gpt2", "small", "tiny"],
    default="gpt2",
    help="gpt2: GPT-2 124M (498 MB fp32); small: 2 layers, d=256; tiny: the tests' 40k values",
)
parser.add_argument("--rounds", type=int, default=2, help="rounds per (N, codec); seconds are the best of them")
parser.add_argument("--gloo-reps", type=int, default=3, help="timed gloo all_reduce repetitions")
parser.add_argument(
    "--pickle-peers",
    type=int,
    nargs="*",
    default=[2],
    help="N for which to run the origin's pickle hub (memory: ~3x652 MB per peer)",
)
parser.add_argument(
    "--baselines",
    nargs="*",
    choices=["limit", "gloo", "origin"],
    default=["limit", "gloo", "origin"],
    help="which baselines to run beside the hub (origin: only for N in --pickle-peers)",
)
parser.add_argument("--no-baselines", action="store_true", help="only the hub rounds (same as --baselines)")
parser.add_argument("--out", type=Path, default=BENCH / "results", help="folder for the JSON")
parser.add_argument("--hub-log", type=Path, default=None, help="append the hubs' logs here")
parser.add_argument(
    "--data-root",
    type=Path,
    default=None,
    help="where the hubs' data dirs go (default: the system temp dir, on disk); /dev/shm shows the "
    "hub without the disk's cost (a diagnostic: tmpfs is not durable)",
)
parser.add_argument(
    "--go-delay",
    type=float,
    default=0.5,
    help="seconds from sending a timed phase's common start instant to that instant: room for every peer "
    "to get its command first (the smoke test's tiny model needs less)",
)
parser.add_argument(
    "--profile",
    action="store_true",
    help="sample each hub with py-spy during its rounds: <out>/hub-<N>-<codec>.raw (collapsed stacks)",
)


def _now() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine


def _sleep_until(t: float) -> None:
    delay = t - _now()
    if delay > 0:
        time.sleep(delay)


#: (layers, width, vocabulary, context) of the models the benchmark can sync
MODELS = {"gpt2": (12, 768, 50257, 1024), "small": (2, 256, 50257, 1024), "tiny": (1, 32, 256, 32)}


def model_schema(kind: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of ``GPT2LMHeadModel``'s synced tensors, in its order (the tied
    ``lm_head.weight`` travels once, as ``transformer.wte.weight``). Written out rather than
    built with transformers: the same list (checked), without a multi-second import."""
    layers, d, vocab, ctx = MODELS[kind]
    schema = {"transformer.wte.weight": (vocab, d), "transformer.wpe.weight": (ctx, d)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        schema |= {
            p + "ln_1.weight": (d,),
            p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (d, 3 * d),
            p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d),
            p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,),
            p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (d, 4 * d),
            p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (4 * d, d),
            p + "mlp.c_proj.bias": (d,),
        }
    return schema | {"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}


# -----------------------------------------------------------------------------
# the peer process: a lean model, a SyncClient, and the baselines' client sides
def lean_model(schema: dict[str, tuple[int, ...]], seed: int) -> Any:
    """An nn.Module holding only parameters with the model's names and shapes."""
    import torch

    root = torch.nn.Module()
    gen = torch.Generator().manual_seed(seed)
    for name, shape in schema.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        tensor = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def _digest(view: Any) -> str:
    """sha-256 of the weights in schema order: equals the hub's version file's data section."""
    h = hashlib.sha256()
    for t in view.tensors.values():
        h.update(t.detach().numpy().reshape(-1).view("u1"))
    return h.hexdigest()


class Peer:
    """Commands from the benchmark, run in a peer process (see :func:`peer_main`)."""

    def __init__(self, rank: int, schema: dict[str, tuple[int, ...]]) -> None:
        from syncclient.weights import ModelView

        self.rank, self.schema = rank, schema
        self.model = lean_model(schema, seed=1000 + rank)
        self.view = ModelView(self.model)
        self.client: Any = None
        self.marks: dict[str, float] = {}

    def join(self, url: str, run: str, codec: str, world: int) -> dict[str, Any]:
        from syncclient import SyncClient

        self.client = SyncClient(
            url,
            run=run,
            peer=f"peer{self.rank:02d}",
            codec=codec,
            min_peers=world,
            round_timeout=900,
            timeout=600,
            retry_seconds=60,
        )
        info = self.client.join(self.model)
        # The benchmark's only reach into the client: httpx event hooks time the first upload
        # byte (the PUT is sent), the ack (its response) and the result (200 response headers).
        self.client._transport.http.event_hooks = {"request": [self._on_request], "response": [self._on_response]}
        return {"version": info.version, "rank": info.rank, "digest": _digest(self.view)}

    def _on_request(self, request: Any) -> None:
        # an update goes up by PUT to the hub, or (a hub with an object store) to presigned URLs
        # the hub hands out at .../presign: either request to the hub starts the upload
        path = request.url.path
        if "/updates/" in path and (request.method == "PUT" or path.endswith("/presign")):
            self.marks.setdefault("put", _now())

    def _on_response(self, response: Any) -> None:
        # acknowledged: the PUT's answer, or the answer to .../uploaded (the object is checked);
        # the result: the hub's 200 with its body, or its 307 to the object store's copy
        path, method = response.request.url.path, response.request.method
        if "/updates/" in path and (method == "PUT" or path.endswith("/uploaded")):
            self.marks["ack"] = _now()
        elif path.endswith("/result") and response.status_code in (200, 307):
            self.marks.setdefault("result", _now())

    def perturb(self, round_: int) -> None:
        """This peer's local work: a small random delta on every weight."""
        import torch

        gen = torch.Generator().manual_seed(round_ * 1000 + self.rank)
        for t in self.view.tensors.values():
            t.data.add_(torch.randn(t.shape, generator=gen), alpha=1e-3)

    def sync(self, go: float) -> dict[str, Any]:
        _sleep_until(go)
        self.marks = {}
        result = self.client.sync(self.model, samples=1000 + self.rank)
        done = _now()
        return {
            **{f"t_{k}": v for k, v in self.marks.items()},
            "t_go": go,
            "t_done": done,
            "bytes_up": result.bytes_up,
            "bytes_down": result.bytes_down,
            "version": result.version,
            "caught_up": result.caught_up,
            "upload_seconds": result.upload_seconds,
            "wait_seconds": result.wait_seconds,
            "digest": _digest(self.view),
        }

    def leave(self) -> None:
        if self.client is not None:
            self.client.leave()
            self.client = None
        import gc

        gc.collect()

    def limit(self, url: str, codec: str, round_: str, world: int, down: int, go: float) -> dict[str, Any]:
        """Stream a payload of the codec's exact layout and size to the discard endpoint."""
        import httpx
        import torch

        from syncwire import encode_model, get_codec, iter_chunks

        gen = torch.Generator().manual_seed(7 + self.rank)
        arrays = {n: torch.randn(s, generator=gen).mul_(1e-3).numpy() for n, s in self.schema.items()}
        parts = [(wire, a, dtype) for _, wire, a, dtype in encode_model(get_codec(codec), arrays)]
        del arrays
        size = sum(len(c) for c in iter_chunks(parts))
        got = 0
        with httpx.Client(timeout=600) as http:
            _sleep_until(go)
            t_put = _now()
            http.put(f"{url}/up", params={"round": round_}, content=iter_chunks(parts)).raise_for_status()
            t_up = _now()
            params = {"round": round_, "n": world, "size": down}
            with http.stream("GET", f"{url}/down", params=params) as r:
                for chunk in r.iter_raw():
                    got += len(chunk)
            t_done = _now()
        return {"t_put": t_put, "t_up": t_up, "t_done": t_done, "bytes_up": size, "bytes_down": got}

    def gloo(self, store: str, world: int, reps: int) -> dict[str, Any]:
        """all_reduce of the float32 parameters in 25 MB buckets (DDP's default), then / N."""
        import datetime as dt

        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=self.rank,
            world_size=world,
            timeout=dt.timedelta(minutes=10),
        )
        buckets, pending, size = [], [], 0
        for t in self.view.tensors.values():
            pending.append(t.detach().reshape(-1))
            size += t.numel() * 4
            if size >= 25 * 2**20:
                buckets.append(torch.cat(pending))
                pending, size = [], 0
        if pending:
            buckets.append(torch.cat(pending))
        times = []
        for _ in range(reps + 1):  # the first one warms up gloo's connections and buffers
            dist.barrier()
            start = _now()
            for b in buckets:
                dist.all_reduce(b)
            for b in buckets:
                b.div_(world)
            times.append(_now() - start)
        dist.barrier()
        dist.destroy_process_group()
        return {"times": times[1:], "bytes": sum(b.numel() * 4 for b in buckets)}

    def origin(self, url: str, world: int, go: float) -> dict[str, Any]:
        """One round of the origin design (pickle over HTTP, averaging on every peer)."""
        from baselines.pickle_hub import sync_round

        state = {name: t.detach().numpy() for name, t in self.view.tensors.items()}
        if "transformer.wte.weight" in state:
            # the origin pickled a state dict holding lm_head.weight too: a second array object
            # over the same memory, which pickle writes a second time (652 MB, not 498 MB)
            state["lm_head.weight"] = self.view.tensors["transformer.wte.weight"].detach().numpy()
        _sleep_until(go)
        out = sync_round(url, self.rank, world, state)
        averaged = out.pop("averaged")
        self.view.load({name: averaged[name] for name in self.schema})
        out["t_done"] = _now()
        return out

    def stats(self) -> dict[str, Any]:
        import resource

        return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def peer_main(rank: int, conn: Any, schema: dict[str, tuple[int, ...]], kind: type[Peer] = Peer) -> None:
    """A peer process: build the model, then run the benchmark's commands until told to stop
    (``kind``: a :class:`Peer` with more commands, bench/wire.py's)."""
    import logging

    import torch

    torch.set_num_threads(1)  # N peers share 2 cores: one thread each, no oversubscription
    logging.basicConfig(level=logging.WARNING)
    try:
        peer = kind(rank, schema)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        command, kwargs = conn.recv()
        if command == "exit":
            return
        try:
            conn.send(("ok", getattr(peer, command)(**kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


# -----------------------------------------------------------------------------
# the benchmark's side
class Peers:
    """N peer processes, commanded in parallel."""

    def __init__(
        self,
        n: int,
        schema: dict[str, tuple[int, ...]],
        target: Callable[..., None] = peer_main,
        first_args: Callable[[int], tuple[Any, ...]] = lambda rank: (),
    ) -> None:
        """``target(*first_args(rank), rank, conn, schema)`` runs in each (bench/wire.py puts
        each peer in its own network namespace that way)."""
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(*first_args(rank), rank, child, schema), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect()

    def _collect(self) -> list[Any]:
        return [self._answer(rank) for rank in range(len(self.conns))]

    def _answer(self, rank: int) -> Any:
        status, value = self.conns[rank].recv()
        if status != "ok":
            raise RuntimeError(f"peer {rank} failed:\n{value}")
        return value

    def all(self, command: str, each: Any = None, **kwargs: Any) -> list[Any]:
        """Run ``command`` on every peer at once; ``each(rank)`` adds per-peer arguments."""
        for rank, conn in enumerate(self.conns):
            conn.send((command, {**kwargs, **(each(rank) if each else {})}))
        return self._collect()

    def one(self, rank: int, command: str, **kwargs: Any) -> Any:
        """Run ``command`` on peer ``rank`` alone."""
        self.conns[rank].send((command, kwargs))
        return self._answer(rank)

    def close(self, wait: float = 30) -> None:
        """Ask every peer to exit; kill those still there after ``wait`` seconds each."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("exit", {}))
        for proc in self.procs:
            proc.join(wait)
            if proc.is_alive():
                proc.kill()


class Server:
    """A server process on a port the OS picks (:class:`syncserver.process.ServerProcess`),
    with its peak RSS watched."""

    def __init__(
        self, args: list[str], log: Path, prefix: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> None:
        """``prefix``: a command that runs the Python one (bench/wire.py: ``ip netns exec NS``);
        ``env``: variables added to this process's, less its ``SYNC_*`` (the store's ``AWS_*``)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")} | dict(env or {})
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(BENCH), env.get("PYTHONPATH", "")])
        # imported here, not with this module: the `syncserver` package imports the hub's app
        # (~0.7 CPU-s), which the peer processes and torchrun ranks importing this module never use
        from syncserver.process import ServerProcess

        self.server = ServerProcess([*prefix, sys.executable, *args], log=log, env=env, cwd=REPO)
        self.url = self.server.start()
        assert self.server.proc is not None
        self.proc = self.server.proc

    def cpu_seconds(self) -> float:
        """The process's user + system CPU seconds so far (all its threads; not its children)."""
        return cpu_seconds(self.proc.pid)

    def _status(self) -> dict[str, int]:
        values = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    values[key] = int(rest.split()[0]) * 1024
        return values

    @contextlib.contextmanager
    def watch(self, into: dict[str, Any]) -> Any:
        """Peak RSS while the block runs: VmHWM after a reset, plus sampled RssAnon/RssFile; and
        the process's CPU seconds (user + system) it took (``cpu_s``)."""
        cpu = self.cpu_seconds()
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # reset VmHWM to VmRSS
        stop = threading.Event()
        peak = {"anon": 0, "file": 0}

        def sample() -> None:
            while not stop.wait(0.01):
                with contextlib.suppress(OSError):
                    s = self._status()
                    peak["anon"] = max(peak["anon"], s["RssAnon"])
                    peak["file"] = max(peak["file"], s["RssFile"])

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            into["hwm"] = self._status()["VmHWM"]
            into["anon"], into["file"] = peak["anon"], peak["file"]
            into["cpu_s"] = self.cpu_seconds() - cpu

    def stop(self) -> None:
        self.server.stop(timeout=20)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far: its threads, the exited ones too, its
    children not. Read from the process's CPU clock (``clock_getcpuclockid``: Linux numbers it
    ``~pid << 3 | CPUCLOCK_SCHED``), to the nanosecond: ``/proc/<pid>/stat`` counts clock ticks
    (10 ms), and a store hub's round of a tiny model took less than one (0.0 s a round)."""
    return time.clock_gettime(((~pid) << 3) | 2)


def version_digest(url: str, data_dir: Path, run: str) -> tuple[int, str]:
    """The hub's latest version file: its number and the sha-256 of its data section.

    The hub writes a version's file after the round commits (peers get the result first), and
    answers a model request once it is written: a one-byte request waits for it."""
    import httpx

    httpx.get(f"{url}/v1/runs/{run}/model", headers={"Range": "bytes=0-0"}, timeout=120).raise_for_status()
    path = max((data_dir / "runs" / run / "versions").glob("*.safetensors"))
    return int(path.stem), file_digest(path)


def file_digest(path: Path) -> str:
    """sha-256 of a version file's data section (what :func:`_digest` hashes on a peer)."""
    import struct

    h = hashlib.sha256()
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def git_state() -> str:
    """The commit measured, and whether the working tree differed from it (other engineers
    edit the same tree: a dirty tree means the numbers are for HEAD plus those edits)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def machine() -> dict[str, Any]:
    """What the figures were measured on, and how busy it was (the load at the end)."""
    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_at_end": os.getloadavg(),
    }


def write_result(
    name: str, args: argparse.Namespace, started: datetime.datetime, schema: dict[str, tuple[int, ...]], **fields: Any
) -> None:
    """``<args.out>/<name>-<date>.json``: when, what command on what machine and code, the model
    and the settings, then ``fields`` (rows, targets, table...)."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}-{started.date().isoformat()}.json"
    result = {
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "code": git_state(),
        "model": {
            "kind": args.model,
            "tensors": len(schema),
            "fp32_bytes": sum(math.prod(s) * 4 for s in schema.values()),
        },
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **fields,
    }
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}")


def peer_memory(codec: str, model_bytes: int) -> float:
    """A peer's peak during a round: the model, the SDK's base copy, the error-feedback residual
    (lossy codecs), the encoded update it sends and the result it downloads (the codec's share
    of the model each), and ~0.4 GB of torch. (The baselines need less: see each command.)"""
    from syncwire import get_codec, layout_bytes, wire_layout

    c = get_codec(codec)
    share = layout_bytes(wire_layout(c, {"x": (1 << 20,)})) / (4 << 20)
    return model_bytes * (2 + (0 if c.lossless else 1) + 2 * share) + 400e6


def mem_available() -> float:
    """MemAvailable from /proc/meminfo, in bytes.

    A peer holds, at its peak, the model, the client's base copy, the encoded update it is
    sending (fp32: a model) and the downloaded result (fp32: a model), plus ~0.4 GB of
    torch; the hub and the page cache of its files need a few models more. 8 fp32 peers of
    GPT-2 therefore need ~19 GB: the benchmark skips an N that would not fit rather than
    push the machine into swapping or the OOM killer, and says so.
    """
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return float("inf")


def best(values: list[float]) -> float:
    """Best of the repetitions: on a shared 2-core VM noise only ever adds time (as timeit)."""
    return float(min(values))


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def run_hub_rounds(
    peers: Peers,
    n: int,
    codec: str,
    rounds: int,
    model_bytes: int,
    work: Path,
    hub_log: Path,
    profile: Path | None,
    go_delay: float,
) -> dict[str, Any]:
    """Start a hub, join N peers, time ``rounds`` rounds; check identical weights after each."""
    import httpx

    data_dir = work / f"hub-{n}-{codec}"
    hub = Server(
        [
            "-m",
            "syncserver",
            "serve",
            "--host",
            "127.0.0.1",
            "--data-dir",
            str(data_dir),
            "--min-peers",
            str(n),
            "--codec",
            codec,
            "--round-timeout",
            "900",
            "--log-level",
            "warning",
        ],
        hub_log,
    )
    run = f"bench-{codec}"
    try:
        joined = peers.all("join", url=hub.url, run=run, codec=codec, world=n)
        spy = None
        if profile is not None:  # py-spy (pip install py-spy): wall-clock samples of every thread
            spy = subprocess.Popen(
                [
                    shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
                    "record",
                    "-p",
                    str(hub.proc.pid),
                    "-r",
                    "200",
                    "--idle",
                    "--threads",
                    "-f",
                    "raw",
                    "-o",
                    str(profile),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        if len({j["digest"] for j in joined}) != 1:
            raise AssertionError("peers do not start from identical weights")
        per_round = []
        for r in range(rounds):
            peers.all("perturb", round_=r + 1)
            rss: dict[str, Any] = {}
            with hub.watch(rss):
                go = _now() + go_delay
                results = peers.all("sync", go=go)
            version, hub_digest = version_digest(hub.url, data_dir, run)
            digests = {res["digest"] for res in results}
            if digests != {hub_digest} or {res["version"] for res in results} != {version}:
                raise AssertionError(f"round {r}: peers and hub disagree: {digests} vs {hub_digest} (v{version})")
            if any(res["caught_up"] for res in results):
                raise AssertionError(f"round {r}: a peer was dropped from the round")
            first = min(res["t_put"] for res in results)
            last = max(res["t_done"] for res in results)
            per_round.append(
                {
                    "round_s": last - first,
                    "sync_s": last - go,
                    "encode_s": max(res["t_put"] for res in results) - go,
                    "upload_s": max(res["t_ack"] for res in results) - first,
                    "result_s": max(res["t_result"] for res in results) - first,
                    "hub_rss": rss,
                    "hub_cpu_s": rss["cpu_s"],
                    "bytes_up": [res["bytes_up"] for res in results],
                    "bytes_down": [res["bytes_down"] for res in results],
                }
            )
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(60)
        status = httpx.get(f"{hub.url}/v1/runs/{run}", timeout=30).json()
        peers.all("leave")
    finally:
        hub.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    hub_timings = [r.get("timings", {}) for r in status.get("rounds", [])]
    up, down = per_round[-1]["bytes_up"], per_round[-1]["bytes_down"]
    peak = max(r["hub_rss"]["hwm"] for r in per_round)
    return {
        "peers": n,
        "codec": codec,
        "round_s": best([r["round_s"] for r in per_round]),
        "round_s_median": median([r["round_s"] for r in per_round]),
        "sync_s": best([r["sync_s"] for r in per_round]),
        "encode_s": best([r["encode_s"] for r in per_round]),
        "upload_s": best([r["upload_s"] for r in per_round]),
        "result_s": best([r["result_s"] for r in per_round]),
        "hub_peak_rss": peak,
        "hub_peak_rss_x_model": peak / model_bytes,
        "hub_cpu_s": median([r["hub_cpu_s"] for r in per_round]),
        "bytes_up": max(up),
        "bytes_down": max(down),
        "bytes_up_x_fp32": max(up) / model_bytes,
        "bytes_down_x_fp32": max(down) / model_bytes,
        "hub_timings": hub_timings,
        "rounds": per_round,
    }


def run_limit(peers: Peers, n: int, codec: str, down: int, reps: int, work: Path, go_delay: float) -> dict[str, Any]:
    server = Server([str(BENCH / "baselines" / "limit_server.py")], work / "limit.log")
    try:
        times, up_bytes, rss_all, cpu = [], 0, [], []
        for r in range(reps):
            go = _now() + go_delay
            rss: dict[str, Any] = {}
            with server.watch(rss):
                results = peers.all(
                    "limit", url=server.url, codec=codec, round_=f"{codec}-{r}", world=n, down=down, go=go
                )
            times.append(max(x["t_done"] for x in results) - min(x["t_put"] for x in results))
            up_bytes = max(x["bytes_up"] for x in results)
            rss_all.append(rss["hwm"])
            cpu.append(rss["cpu_s"])
            if any(x["bytes_down"] != down for x in results):
                raise AssertionError("limit download size mismatch")
    finally:
        server.stop()
    return {
        "limit_s": best(times),
        "limit_s_median": median(times),
        "limit_all": times,
        "limit_bytes_up": up_bytes,
        "limit_rss": max(rss_all),
        "limit_cpu_s": median(cpu),
    }


def run_gloo(peers: Peers, n: int, reps: int, work: Path) -> dict[str, Any]:
    store = work / f"gloo-{n}.store"  # a file rendezvous: no port to pick
    store.unlink(missing_ok=True)
    results = peers.all("gloo", store=str(store), world=n, reps=reps)
    times = [max(r["times"][i] for r in results) for i in range(reps)]
    return {"gloo_s": best(times), "gloo_s_median": median(times), "gloo_all": times, "gloo_bytes": results[0]["bytes"]}


def run_origin(peers: Peers, n: int, reps: int, work: Path, go_delay: float) -> dict[str, Any]:
    import httpx

    server = Server([str(BENCH / "baselines" / "pickle_hub.py")], work / "pickle.log")
    try:
        times, syncs, rss_all, last, cpu = [], [], [], [], []
        for _ in range(reps):
            httpx.post(f"{server.url}/reset", timeout=30)
            rss: dict[str, Any] = {}
            go = _now() + go_delay
            with server.watch(rss):
                last = peers.all("origin", url=server.url, world=n, go=go)
            times.append(max(x["t_done"] for x in last) - min(x["t_put"] for x in last))
            syncs.append(max(x["t_done"] for x in last) - go)
            rss_all.append(rss["hwm"])
            cpu.append(rss["cpu_s"])
    finally:
        server.stop()
    return {
        "origin_s": best(times),
        "origin_s_median": median(times),
        "origin_sync_s": best(syncs),
        "origin_all": times,
        "origin_hub_peak_rss": max(rss_all),
        "origin_cpu_s": median(cpu),
        "origin_bytes_up": max(x["bytes_up"] for x in last),
        "origin_bytes_down": max(x["bytes_down"] for x in last),
    }


def check_targets(rows: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each as measured ratio vs threshold."""
    by = {(r["peers"], r["codec"]): r for r in rows}
    out: list[dict[str, Any]] = []

    def target(name: str, value: float | None, limit: float, better: str) -> None:
        if value is None:
            out.append({"target": name, "value": None, "threshold": limit, "met": None})
            return
        met = value <= limit if better == "le" else value >= limit
        out.append({"target": name, "value": round(value, 3), "threshold": limit, "met": met})

    r = by.get((4, "fp32"))
    target(
        "fp32, 4 peers: round / limit <= 1.3",
        r and r["round_s"] / r["limit_s"] if r and "limit_s" in r else None,
        1.3,
        "le",
    )
    r, b = by.get((2, "fp32")), base.get(2, {})
    target(
        "fp32, 2 peers: origin / round >= 5", b["origin_s"] / r["round_s"] if r and "origin_s" in b else None, 5.0, "ge"
    )
    for n in (2, 4):
        r, b = by.get((n, "int8")), base.get(n, {})
        target(
            f"int8, {n} peers: round / gloo all_reduce <= 1",
            r["round_s"] / b["gloo_s"] if r and "gloo_s" in b else None,
            1.0,
            "le",
        )
    for codec, limit in (("int8", 0.27), ("int4", 0.14)):
        found = [x for x in rows if x["codec"] == codec]
        worst = max((max(x["bytes_up_x_fp32"], x["bytes_down_x_fp32"]) for x in found), default=None)
        target(f"{codec}: bytes each way / fp32 model <= {limit}", worst, limit, "le")
    for n in sorted({x["peers"] for x in rows}):
        worst = max(x["hub_peak_rss_x_model"] for x in rows if x["peers"] == n)
        target(
            f"hub peak RSS / fp32 model, {n} peers <= 3.5" + ("" if n == 8 else " (target is at 8)"), worst, 3.5, "le"
        )
    return out


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def markdown(rows: list[dict[str, Any]], base: dict[int, dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    lines = [
        "| N | codec | round s | limit s | round / limit | sync s (with encode) | hub CPU-s / round "
        "| limit server CPU-s | hub peak RSS GB (x model) | MB up / peer | MB down / peer | bytes x fp32 (up, down) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        limit = f"{r['limit_s']:.2f}" if "limit_s" in r else "-"
        ratio = f"{r['round_s'] / r['limit_s']:.2f}" if "limit_s" in r else "-"
        limit_cpu = f"{r['limit_cpu_s']:.2f}" if "limit_cpu_s" in r else "-"
        lines.append(
            f"| {r['peers']} | {r['codec']} | {r['round_s']:.2f} | {limit} | {ratio} | {r['sync_s']:.2f} | "
            f"{r['hub_cpu_s']:.2f} | {limit_cpu} | "
            f"{gb(r['hub_peak_rss'])} ({r['hub_peak_rss_x_model']:.2f}x) | {r['bytes_up'] / 1e6:.1f} | "
            f"{r['bytes_down'] / 1e6:.1f} | {r['bytes_up_x_fp32']:.3f}, {r['bytes_down_x_fp32']:.3f} |"
        )
    if base:
        lines += [
            "",
            "| N | gloo all_reduce s | origin (pickle hub) s | origin sync s (with pickling) "
            "| origin hub CPU-s / round | origin hub peak RSS GB | origin MB up / peer | origin MB down / peer |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for n, b in sorted(base.items()):

            def f(key: str, scale: float = 1.0, fmt: str = "{:.2f}", b: dict[str, Any] = b) -> str:
                return fmt.format(b[key] / scale) if key in b else "-"

            lines.append(
                f"| {n} | {f('gloo_s')} | {f('origin_s')} | {f('origin_sync_s')} | {f('origin_cpu_s')} | "
                f"{f('origin_hub_peak_rss', 1e9)} | {f('origin_bytes_up', 1e6, '{:.1f}')} | "
                f"{f('origin_bytes_down', 1e6, '{:.1f}')} |"
            )
    lines += ["", *record.targets_table(targets)]
    return "\n".join(lines)


def main() -> None:
    args = parser.parse_args()
    baselines = set() if args.no_baselines else set(args.baselines)
    started = datetime.datetime.now(datetime.timezone.utc)
    schema = model_schema(args.model)
    model_bytes = sum(math.prod(s) * 4 for s in schema.values())
    print(
        f"model {args.model}: {len(schema)} tensors, {model_bytes / 1e6:.1f} MB fp32; load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="bench-round-", dir=args.data_root))
    hub_log = args.hub_log or work / "hub.log"
    rows: list[dict[str, Any]] = []
    base: dict[int, dict[str, Any]] = {}
    peer_rss: dict[int, int] = {}
    skipped: dict[int, str] = {}
    try:
        for n in args.peers:
            need = n * max(peer_memory(c, model_bytes) for c in args.codecs) + 2 * model_bytes
            available = mem_available()
            if need > available:
                print(f"N={n}: skipped, needs ~{need / 1e9:.1f} GB, {available / 1e9:.1f} GB available", flush=True)
                skipped[n] = f"needs ~{need / 1e9:.1f} GB of memory, {available / 1e9:.1f} GB were available"
                continue
            peers = Peers(n, schema)
            try:
                for codec in args.codecs:
                    profile = args.out / f"hub-{n}-{codec}.raw" if args.profile else None
                    if profile is not None:
                        args.out.mkdir(parents=True, exist_ok=True)
                    row = run_hub_rounds(
                        peers, n, codec, args.rounds, model_bytes, work, hub_log, profile, args.go_delay
                    )
                    if "limit" in baselines:
                        row.update(run_limit(peers, n, codec, row["bytes_down"], args.rounds, work, args.go_delay))
                        if row["limit_bytes_up"] != row["bytes_up"]:
                            raise AssertionError("the limit did not move the same bytes as the round")
                    rows.append(row)
                    print(
                        f"N={n} {codec}: round {row['round_s']:.2f}s, limit {row.get('limit_s', float('nan')):.2f}s, "
                        f"hub CPU {row['hub_cpu_s']:.2f} s/round (limit server's "
                        f"{row.get('limit_cpu_s', float('nan')):.2f}), hub RSS {gb(row['hub_peak_rss'])} GB",
                        flush=True,
                    )
                if "gloo" in baselines:
                    base[n] = run_gloo(peers, n, args.gloo_reps, work)
                    print(f"N={n} gloo {base[n]['gloo_s']:.2f}s", flush=True)
                if "origin" in baselines and n in args.pickle_peers:
                    base.setdefault(n, {}).update(run_origin(peers, n, args.rounds, work, args.go_delay))
                    print(
                        f"N={n} origin {base[n]['origin_s']:.2f}s, its hub's CPU {base[n]['origin_cpu_s']:.2f} s/round",
                        flush=True,
                    )
                peer_rss[n] = max(s["peak_rss"] for s in peers.all("stats"))
            finally:
                peers.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    targets = check_targets(rows, base)
    table = markdown(rows, base, targets)
    print(table)
    write_result(
        "round",
        args,
        started,
        schema,
        rows=rows,
        baselines={str(n): b for n, b in base.items()},
        peer_peak_rss={str(n): v for n, v in peer_rss.items()},
        skipped={str(n): why for n, why in skipped.items()},
        targets=targets,
        table=table,
    )


if __name__ == "__main__":
    main()
