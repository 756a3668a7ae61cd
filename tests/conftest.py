"""Shared fixtures: real hubs on 127.0.0.1 (port 0: the OS picks a free one), tiny real models.

``hub_factory`` starts ``python -m syncserver serve`` as a real process on port 0 (it writes
the port it got to a ready file: :mod:`syncserver.process`), so tests can kill it with SIGKILL
and start it again on the same data dir and URL. ``hub`` is one such hub.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401  (imported once here: lazy imports race in threads)

from syncserver.process import ServerProcess
from tests.budget import pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401  (the time budget)
from tests.s3server import s3, seaweedfs  # noqa: F401  (a real S3 server, started on first use; a proxy to it)
from tests.smallvocab import small_vocab_data as small_vocab

torch.set_num_threads(1)  # OMP_NUM_THREADS (tests/__init__.py) comes too late if a plugin imported torch first

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
#: for tests that read the offline IMDB parquet or tokenizer (../shared/data): a checkout without it skips them
needs_data = pytest.mark.skipif(
    not (SHARED_DATA / "imdb" / "train.parquet").exists(), reason=f"no offline data in {SHARED_DATA}"
)

PROCESS_MODULES = frozenset(
    {
        "test_bench_smoke",  # the benchmarks' own command lines
        "test_ci_scripts",  # .ci scripts
        "test_cli",
        "test_crash",  # SIGKILLed hubs and peers
        "test_docs",  # mkdocs build
        "test_exports",  # what a fresh interpreter imports
        "test_faults",  # SIGKILLed peers; a module hub behind fault proxies
        "test_finetune",  # the reference job
        "test_group",  # torchrun
        "test_hooks",  # weightsync-run's hooks in programs of their own
        "test_lightning",
        "test_load_smoke",
        "test_local",  # --local-peers
        "test_policies",  # a module hub
        "test_public_scripts",  # weightsync-run on public training scripts (tests/public)
        "test_schemathesis",
        "test_status_cli",
        "test_store_wire",  # hubs with --store, `syncserver serve` refusing a store, bench/storebytes.py
        "test_timeouts",
        "test_tls",
        "test_zero_code",  # weightsync-run
    }
)
"""Modules whose tests start programs of their own (besides hubs from ``hub_factory``, which mark
a test by themselves; a module's own shared hub does not): ``make check`` leaves these out,
``make test`` and CI run everything."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``process`` every test that starts a process per test: ``pytest -m "not process"`` is
    the in-process tier (``make check``)."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if "hub_factory" in item.fixturenames or module in PROCESS_MODULES:
            item.add_marker(pytest.mark.process)


class Hub:
    """A hub process (``python -m syncserver serve``) on a port the OS picked; ``url`` stays the
    same across restarts (a restart asks for the port the first start got)."""

    def __init__(self, data_dir: Path, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.data_dir = data_dir
        serve = [sys.executable, "-m", "syncserver", "serve", "--host", "127.0.0.1", "--data-dir", str(data_dir)]
        self.server = ServerProcess([*serve, "--log-level", "warning", *args], log=log_path, env=env)

    @property
    def url(self) -> str:
        assert self.server.url is not None, "start the hub first"
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.server.proc

    def start(self, timeout: float = 30.0) -> Hub:
        self.server.start(timeout)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as when a VM dies."""
        self.server.kill()

    def stop(self) -> None:
        self.server.stop()

    def log(self) -> str:
        """Everything the hub has logged so far (all its starts)."""
        try:
            return self.server.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@pytest.fixture
def hub_factory(tmp_path: Path) -> Iterator[Callable[..., Hub]]:
    """``hub_factory("--min-peers", "2", env={"SYNC_TOKEN": "t"})`` -> a started Hub."""
    hubs: list[Hub] = []

    def make(*args: str, env: dict[str, str] | None = None, data_dir: Path | None = None, start: bool = True) -> Hub:
        n = len(hubs)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
        full_env.update(env or {})
        hub = Hub(data_dir or tmp_path / f"hub{n}", list(args), full_env, tmp_path / f"hub{n}.log")
        hubs.append(hub)
        return hub.start() if start else hub

    yield make
    for hub in hubs:
        hub.stop()


@pytest.fixture
def hub(hub_factory: Callable[..., Hub]) -> Hub:
    return hub_factory()


@contextlib.contextmanager
def shared_hub(
    tmp_path_factory: pytest.TempPathFactory, name: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[Hub]:
    """A started hub for a module-scoped fixture (``args``: its flags; ``env``: SYNC_* settings
    over a clean environment), stopped after the ``with``."""
    tmp = tmp_path_factory.mktemp(name)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SYNC_")}
    full_env.update(env or {})
    hub = Hub(tmp / "hub", list(args), full_env, tmp / "hub.log").start()
    try:
        yield hub
    finally:
        hub.stop()


@pytest.fixture(scope="module")
def module_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One hub of the default settings for a module's tests that neither kill, restart nor
    reconfigure it, nor read its whole log, each on runs of its own names: a module makes it its
    ``hub`` (``def hub(module_hub)``). A hub start and stop is ~1.5 CPU-s, 2-4 s on a busy 2-core VM."""
    with shared_hub(tmp_path_factory, "module-hub") as hub:
        yield hub


SMALL_SAMPLE_EVERY = 5  # every 5th review of each split: 400 train, 100 test, both labels in each


@pytest.fixture(scope="session")
def small_sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline data folder with ``imdb/sample.parquet`` cut to every SMALL_SAMPLE_EVERY-th
    review of each split, for the examples' runs (``examples/imdb.py``). Their hashed bag of words
    is pure Python: ~3 CPU-s a process on the full 2,500 reviews, more than the training, and
    nothing a test of them checks depends on how many reviews there are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(SHARED_DATA / "imdb" / "sample.parquet", columns=["text", "label", "split"])
    rows = table.to_pydict()
    keep: list[int] = []
    for split in ("train", "test"):
        keep += [i for i, s in enumerate(rows["split"]) if s == split][::SMALL_SAMPLE_EVERY]
    data = tmp_path_factory.mktemp("small-sample-data")
    (data / "imdb").mkdir()
    pq.write_table(table.take(pa.array(keep)), data / "imdb" / "sample.parquet")
    return data


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference job's tokenized-data cache (``$WEIGHTSYNC_CACHE_DIR``) for the scripts the tests
    start: one per session worker, in pytest's temporary folders, never the user's ``~/.cache``."""
    folder = tmp_path_factory.mktemp("data-cache")
    os.environ["WEIGHTSYNC_CACHE_DIR"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def small_vocab_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline data folder (``imdb/``, ``gpt2-tokenizer/``) with GPT-2's tokenizer cut to its
    first merges (:mod:`tests.smallvocab`), for the runs of real scripts that
    train a random-init GPT-2; nothing the tests check depends on the vocabulary's size."""
    return small_vocab(SHARED_DATA, tmp_path_factory.mktemp("small-vocab-data") / "data")
