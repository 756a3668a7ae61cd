""".ci/install-chromium.sh (run by ``make test``): never touches apt when a Chromium is there,
and says what it installs when it does. apt-get and sudo are stand-ins that record their calls."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / ".ci" / "install-chromium.sh"


def _executable(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A PATH holding only ``id`` and recording stand-ins for ``apt-get`` and ``sudo``: a real
    chromium on this machine cannot leak in, and nothing is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").symlink_to(shutil.which("id") or "/usr/bin/id")
    log = tmp_path / "calls.log"
    # `apt-get install` "installs" a chromium, so the script's final check finds it
    chmod = shutil.which("chmod") or "/bin/chmod"
    _executable(
        bin_dir / "apt-get",
        f'echo "apt-get $*" >> {log}\n'
        f'case "$1" in install) printf "#!/bin/sh\\n" > {bin_dir}/chromium; {chmod} +x {bin_dir}/chromium;; esac',
    )
    _executable(bin_dir / "sudo", f'echo "sudo $*" >> {log}\nexec "$@"')
    return bin_dir


def run(bin_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", str(SCRIPT)], env={"PATH": str(bin_dir), **env}, capture_output=True, text=True, timeout=30
    )


def calls(bin_dir: Path) -> str:
    log = bin_dir.parent / "calls.log"
    return log.read_text() if log.exists() else ""


def test_skips_when_chromium_is_on_path(bin_dir: Path) -> None:
    _executable(bin_dir / "chromium", "exit 0")
    out = run(bin_dir)
    assert out.returncode == 0, out.stderr
    assert "already installed" in out.stdout
    assert calls(bin_dir) == ""


def test_skips_when_chromium_env_names_one(bin_dir: Path, tmp_path: Path) -> None:
    browser = _executable(tmp_path / "my-chrome", "exit 0")
    out = run(bin_dir, CHROMIUM=str(browser))
    assert out.returncode == 0, out.stderr
    assert f"using CHROMIUM={browser}" in out.stdout
    assert calls(bin_dir) == ""


def test_refuses_a_chromium_env_that_is_no_executable(bin_dir: Path, tmp_path: Path) -> None:
    out = run(bin_dir, CHROMIUM=str(tmp_path / "nothing"))
    assert out.returncode == 1
    assert "is not an executable" in out.stderr
    assert calls(bin_dir) == ""


def test_says_what_it_installs_system_wide(bin_dir: Path) -> None:
    out = run(bin_dir)
    assert out.returncode == 0, out.stderr
    assert "system-wide with apt-get" in out.stderr and "MB" in out.stderr
    assert "apt-get install -y -q chromium" in calls(bin_dir)
