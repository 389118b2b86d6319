"""Ctrl-C and preemption during `rewrite train`: a SIGINT to its launcher (which forwards it)
or a SIGTERM to the workers stops every rank after the step in flight, saves the training state there
and says so in one line; a second SIGINT stops at once, saving nothing more, the last checkpoint intact."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rewrite.checkpoint.training_state import latest_checkpoint
from tests.launched import end, workers as _workers
from tests.paths import ROOT

pytestmark = [pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc"),
              pytest.mark.timeout(240)]


def _interrupt(tmp_path: Path, send, *extra: str, torchrun: bool = True) -> tuple[str, int]:
    """Train on 2 ranks (pp 2) until 3 steps ran, then `send(agent pid, {local rank: worker pid})`; (the log, status).
    Launched by torchrun, or by `rewrite train --nproc-per-node 2`."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    train = ["train", "plans/llama-pp2.yaml", "--steps", "100000", "--seq-len", "16", "--batch-size", "1",
             "--no-parity", "--no-progress", "--out", str(out), "--ckpt", str(ckpt), *extra]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.2",
            "-m", "rewrite", *train] if torchrun else [sys.executable, "-m", "rewrite", *train, "--nproc-per-node", "2"])
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    workers = {}
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert set(workers) == {0, 1}, (tmp_path / "log.txt").read_text()[-3000:]
        send(proc.pid, workers)
        proc.wait(timeout=60)
    finally:
        end(proc, workers.values())
    return (tmp_path / "log.txt").read_text(), proc.returncode


def _stopped_and_saved(said: str, name: str, ckpt: Path) -> None:
    lines = [line for line in said.splitlines() if line.startswith(f"stopped by {name}")]
    assert len(lines) == 1, said[-3000:]
    step = int(re.match(rf"stopped by {name} after step (\d+) of 100000: its training state is saved in ", lines[0])[1])
    assert lines[0].endswith("; the same command with --resume continues from it"), lines[0]
    assert latest_checkpoint(ckpt)[0] == step, lines[0]  # whole, named by `latest`
    assert "Traceback" not in said.split("stopped by")[0], said[-3000:]  # no worker's traceback before it


def test_ctrl_c_on_the_launcher_stops_after_the_step_saved_with_one_line(tmp_path):
    said, status = _interrupt(tmp_path, lambda agent, workers: os.kill(agent, signal.SIGINT), torchrun=False)
    _stopped_and_saved(said, "SIGINT", tmp_path / "ckpt")
    assert said.rstrip().splitlines()[-1].startswith("stopped by SIGINT") and status == 130, said[-2000:]  # the last word


def test_sigterm_to_the_workers_stops_after_the_step_saved(tmp_path):
    said, status = _interrupt(tmp_path, lambda agent, workers: [os.kill(p, signal.SIGTERM) for p in workers.values()])
    _stopped_and_saved(said, "SIGTERM", tmp_path / "ckpt")
    assert status != 0


def test_a_second_ctrl_c_stops_at_once_and_leaves_the_last_checkpoint_whole(tmp_path):
    def twice(agent, workers):
        for _ in range(2):
            for pid in workers.values():
                os.kill(pid, signal.SIGINT)
            time.sleep(0.01)

    said, status = _interrupt(tmp_path, twice, "--save-every", "1")
    assert said.count("interrupted: stopped at once, nothing more saved") == 1, said[-3000:]
    assert "stopped by SIGINT" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    step, path = latest_checkpoint(tmp_path / "ckpt")
    assert step >= 2 and (path / ".metadata").is_file()  # steps 1 and 2 were saved before the 3rd was logged
