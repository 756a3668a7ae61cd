"""A local peer runs in the folder the command was typed in, as on a VM of its own (syncserver/workdirs.py).

A script launched as its README says reads a helper module and its data relative to its folder,
and writes into folders that are there. Under ``weightsync-run --local-peers 2`` each peer reads
them where they are, and what each writes is its own, found in ``OUT/peer-k`` afterwards; the
launch folder is never written. Where the kernel refuses the overlay, the peers run in their
folders with links to what is there, and the launcher says what changed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from syncserver import workdirs
from syncserver.workdirs import Links, Overlay, choose
from tests.test_zero_code import finish, launch

TRAIN = """
import os, sys
import helper                                   # a module beside the script
rank = os.environ["WEIGHTSYNC_RANK"]
data = open("data/words.txt").read().strip()    # data relative to the working folder
with open("out/result.txt", "w") as f:          # an output file that exists in the launch folder
    f.write(f"{helper.WHO} {rank} read {data}")
open("new.txt", "w").write(rank)
print("cwd", os.getcwd(), "peer dir", os.environ["WEIGHTSYNC_PEER_DIR"])
"""


def make_launch_folder(root: Path) -> Path:
    launch_folder = root / "repo"
    (launch_folder / "data").mkdir(parents=True)
    (launch_folder / "out").mkdir()
    (launch_folder / "train.py").write_text(TRAIN)
    (launch_folder / "helper.py").write_text("WHO = 'peer'\n")
    (launch_folder / "data" / "words.txt").write_text("hello")
    (launch_folder / "out" / "result.txt").write_text("the launch folder's own")
    (launch_folder / "bin").mkdir()
    (launch_folder / "bin" / "python").symlink_to(sys.executable)  # a venv's python is a symlink
    return launch_folder


def test_each_peer_reads_the_launch_folder_and_writes_its_own(tmp_path: Path) -> None:
    repo = make_launch_folder(tmp_path)
    # OUT inside the launch folder (the default, ./weightsync-local); a relative venv python
    proc = finish(launch("--local-peers", "2", "--", "bin/python", "train.py", cwd=repo))
    assert proc.returncode == 0, proc.stderr
    assert "refused" not in proc.stderr  # the overlay, on this kernel
    assert (repo / "out" / "result.txt").read_text() == "the launch folder's own"
    assert not (repo / "new.txt").exists()
    out = repo / "weightsync-local"
    for rank in (0, 1):
        mine = out / f"peer-{rank}"
        assert (mine / "out" / "result.txt").read_text() == f"peer {rank} read hello"
        assert (mine / "new.txt").read_text() == str(rank)
        assert not (mine / "data").exists()  # only what it wrote
        assert f"cwd {repo} peer dir {repo}" in (out / f"peer-{rank}.log").read_text()


def test_python_m_runs_from_the_launch_folder(tmp_path: Path) -> None:
    repo = make_launch_folder(tmp_path)
    (repo / "pkg").mkdir()
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "train.py").write_text(TRAIN)
    proc = finish(launch("--local-peers", "2", "--out", str(tmp_path / "o"), "--", sys.executable, "-m", "pkg.train",
                         cwd=repo))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "o" / "peer-1" / "out" / "result.txt").read_text() == "peer 1 read hello"


def test_where_the_kernel_refuses_the_overlay_peers_run_beside_links(tmp_path: Path) -> None:
    repo = make_launch_folder(tmp_path / "a,b")  # ',' separates overlayfs's options: refused
    out = repo / "weightsync-local"
    folders, line = choose(repo, out)
    assert isinstance(folders, Links) and line is not None
    refused = f"the kernel refused an overlay of {repo} (Invalid argument): each peer runs in {out}/peer-k"
    assert line.startswith(refused)
    mine = out / "peer-0"
    mine.mkdir(parents=True)
    (mine / "new.txt").write_text("kept from an earlier launch")
    cwd, peer_dir, enter = folders.start(mine)
    assert cwd == peer_dir == mine and enter is None
    assert (mine / "helper.py").resolve() == repo / "helper.py"
    assert (mine / "new.txt").read_text() == "kept from an earlier launch"
    assert not (mine / "weightsync-local").exists()  # OUT itself is not linked into its peers
    run = subprocess.run([sys.executable, "train.py"], cwd=cwd, env={"WEIGHTSYNC_RANK": "0",
                         "WEIGHTSYNC_PEER_DIR": str(peer_dir)}, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert (mine / "new.txt").read_text() == "0"
    assert (repo / "out" / "result.txt").read_text() == "peer 0 read hello"  # shared: what the line says


def test_the_overlay_is_chosen_where_the_kernel_allows_it(tmp_path: Path) -> None:
    repo = make_launch_folder(tmp_path)
    folders, line = choose(repo, tmp_path / "o")
    assert isinstance(folders, Overlay) and line is None
    assert not any((tmp_path / "o" / ".overlay").iterdir())  # the probe cleaned up after itself


AS_A_USER = """
import subprocess, sys
from pathlib import Path
from workdirs import Overlay, choose
launch = Path.cwd()
folders, line = choose(launch, launch / "weightsync-local")
assert isinstance(folders, Overlay), line
mine = launch / "weightsync-local" / "peer-0"
mine.mkdir()
cwd, _, enter = folders.start(mine)
subprocess.run(["sh", "-c", "cat data/words.txt > out/result.txt"], cwd=cwd, preexec_fn=enter, check=True)
"""


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.base_prefix + "/bin/python3"


def test_a_user_who_is_not_root_gets_the_overlay_through_a_user_namespace() -> None:
    """As ``nobody`` (no CAP_SYS_ADMIN): a user namespace of the peer's own, in which overlayfs
    mounts (Linux >= 5.11). The module needs only the standard library: a copy of it is run by the
    system's Python, which ``nobody`` may read."""
    root = Path(tempfile.mkdtemp(prefix="workdirs-"))
    try:
        root.chmod(0o755)
        repo = make_launch_folder(root)
        (root / "workdirs.py").write_text(Path(workdirs.__file__).read_text())
        subprocess.run(["chown", "-R", "65534:65534", str(root)], check=True)
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c",
             AS_A_USER], cwd=repo, env={"PYTHONPATH": str(root), "HOME": str(root)}, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (repo / "weightsync-local" / "peer-0" / "out" / "result.txt").read_text() == "hello"
        assert (repo / "out" / "result.txt").read_text() == "the launch folder's own"
    finally:
        shutil.rmtree(root)
