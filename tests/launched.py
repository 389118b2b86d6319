"""Runs a launcher started (torchrun, `rewrite train --nproc-per-node`), seen from a test: its workers by local
rank, whether one is alive, and ending every process of the run, stopped ones included."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def workers(agent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the workers the launcher `agent` started (its children)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent != agent:
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for item in env:
            if item.startswith(b"LOCAL_RANK="):
                found[int(item.split(b"=", 1)[1])] = int(pid)
    return found


def alive(pid: int) -> bool:
    """The process runs (or is stopped), neither gone nor a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def end(proc: subprocess.Popen, pids=()) -> None:
    """SIGKILL the launcher's session (started with start_new_session) and each of `pids`: workers live in
    sessions of their own, and a stopped one would outlive the test."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), *(lambda p=p: os.kill(p, signal.SIGKILL) for p in pids)):
        try:
            kill()
        except ProcessLookupError:
            pass
    proc.wait()
