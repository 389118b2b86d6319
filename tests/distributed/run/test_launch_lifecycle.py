"""`rewrite.launch` leaves nothing behind: no worker outlives its launching process, and no
file is left in the temp folder, whether the launch returns, a rank fails, the deadline
passes, or the launching process is SIGKILLed mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import rewrite
from tests.paths import ROOT


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie nobody has reaped yet counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"after {timeout_s:.0f}s still not: {what}")
        time.sleep(0.05)


def kill_leftovers(pids: list[int]) -> None:
    """Never leave a worker of a failed test running."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _record_then(mode: str, folder: str, tmp: str):
    """Worker: note this pid and what the temp folder holds mid-run, then end as `mode` says."""
    import os
    import time

    rank = int(os.environ["RANK"])
    seen = sorted(os.listdir(tmp))
    with open(os.path.join(folder, f"pid{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()}\n{seen!r}\n")
    os.replace(os.path.join(folder, f"pid{rank}.tmp"), os.path.join(folder, f"pid{rank}"))
    if mode == "return":
        return rank
    if mode == "raise" and rank == 1:
        for _ in range(600):  # once rank 0 is stuck for sure, with its pid noted
            if os.path.exists(os.path.join(folder, "pid0")):
                break
            time.sleep(0.1)
        raise RuntimeError("rank 1 gives up")
    time.sleep(600)  # "hang"; and in "raise", rank 0 left stuck


def recorded(folder: Path, nprocs: int) -> list[tuple[int, str]]:
    """(pid, temp folder listing) each worker wrote."""
    out = []
    for rank in range(nprocs):
        pid, seen = (folder / f"pid{rank}").read_text().splitlines()
        out.append((int(pid), seen))
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["return", "raise", "hang"])
def test_every_ending_leaves_no_worker_and_no_file(mode, tmp_path, monkeypatch):
    tmp, folder = tmp_path / "tmp", tmp_path / "pids"
    tmp.mkdir()
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # launch's temporary files go here, if anywhere
    try:
        if mode == "return":
            assert rewrite.launch(_record_then, 2, mode, str(folder), str(tmp), timeout_s=120, echo=False) == [0, 1]
        elif mode == "raise":
            with pytest.raises(rewrite.LaunchError, match="rank 1 of 2 failed"):
                rewrite.launch(_record_then, 2, mode, str(folder), str(tmp), timeout_s=120, echo=False)
        else:
            with pytest.raises(rewrite.LaunchError, match=r"timed out after 30s on 2 ranks"):
                rewrite.launch(_record_then, 2, mode, str(folder), str(tmp), timeout_s=30, init_process_group=False, echo=False)
        workers = recorded(folder, 2)
        for rank, (pid, seen) in enumerate(workers):
            assert seen == "[]", f"rank {rank} saw {seen} in the temp folder mid-run: the payload has a name"
            assert not alive(pid), f"rank {rank} (pid {pid}) still runs after launch returned"
        assert os.listdir(tmp) == []
    finally:
        kill_leftovers([int(p.read_text().split()[0]) for p in folder.glob("pid?")])


PARENT = """
import os, sys, rewrite

def spin(folder, tmp):
    import os, time
    import torch, torch.distributed as dist

    rank = dist.get_rank()
    seen = sorted(os.listdir(tmp))
    with open(os.path.join(folder, f"pid{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()}\\n{seen!r}\\n")
    os.replace(os.path.join(folder, f"pid{rank}.tmp"), os.path.join(folder, f"pid{rank}"))
    x = torch.zeros(1)
    while True:  # "training": in and out of collectives until killed
        dist.all_reduce(x)
        time.sleep(0.01)

rewrite.launch(spin, 2, sys.argv[1], os.environ["TMPDIR"], timeout_s=300, echo=False)
"""


@pytest.mark.timeout(150)
def test_sigkilled_parent_takes_its_workers_and_files_with_it(tmp_path):
    tmp, folder = tmp_path / "tmp", tmp_path / "pids"
    tmp.mkdir()
    folder.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, str(script), str(folder)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        wait_until(lambda: all((folder / f"pid{r}").exists() for r in range(2)) or parent.poll() is not None,
                   120, "both workers started")
        assert parent.poll() is None, f"the launching process ended early with {parent.returncode}"
        workers = recorded(folder, 2)
        pids = [pid for pid, _ in workers]
        assert all(seen == "[]" for _, seen in workers), workers
        assert all(alive(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        wait_until(lambda: not any(alive(pid) for pid in pids), 5, f"workers {pids} gone")
        assert os.listdir(tmp) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        kill_leftovers(pids)


WATCHED = """
import os, sys, time
from rewrite.run.launch_worker import watch_parent

watch_parent(int(sys.argv[1]), interval_s=0.1)
with open(sys.argv[2], "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""

MIDDLE = """
import os, subprocess, sys, time

subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
time.sleep(600)
"""


@pytest.mark.timeout(150)
def test_watchdog_alone_ends_an_orphaned_worker(tmp_path):
    """The fallback where the kernel does not kill the worker: no prctl in this child."""
    pid_file = tmp_path / "pid"
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, WATCHED, str(pid_file)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid = None
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text() or middle.poll() is not None, 120,
                   "the watched process started")
        assert middle.poll() is None, f"the middle process ended early with {middle.returncode}"
        pid = int(pid_file.read_text())
        assert alive(pid)
        middle.send_signal(signal.SIGKILL)
        middle.wait(timeout=30)
        wait_until(lambda: not alive(pid), 5, f"orphan {pid} gone")
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait(timeout=30)
        if pid is not None:
            kill_leftovers([pid])
