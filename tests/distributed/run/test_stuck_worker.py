"""A stuck worker (SIGSTOP) fails the run within `--timeout`: the ranks still running stop with a
message naming the timeout, and torchrun then ends the stuck one (after its own shutdown grace)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.run.test_train_resume import _workers
from tests.paths import ROOT

TIMEOUT_S = 8
TORCHRUN_GRACE_S = 30  # torchrun's SIGTERM -> SIGKILL wait for a worker after another failed (torch 2.13)
MARGIN_S = 20


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
@pytest.mark.timeout(300)
def test_a_stopped_worker_fails_the_run_within_the_timeout(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.2",
           "-m", "rewrite", "train", "plans/llama-pp2.yaml", "--steps", "100000", "--seq-len", "16", "--batch-size", "1",
           "--timeout", str(TIMEOUT_S), "--no-parity", "--no-progress", "--out", str(out)]
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    stopped = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:  # until it trains: past the rendezvous
            if (out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        workers = _workers(proc.pid)
        assert set(workers) == {0, 1}, (tmp_path / "log.txt").read_text()[-3000:]
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while _alive(workers[0]) and time.monotonic() - stopped < TIMEOUT_S + MARGIN_S:
            time.sleep(0.1)
        rank0_s = time.monotonic() - stopped
        proc.wait(timeout=TIMEOUT_S + TORCHRUN_GRACE_S + MARGIN_S)
        total_s = time.monotonic() - stopped
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        proc.wait()
    said = (tmp_path / "log.txt").read_text()
    assert TIMEOUT_S - 1 <= rank0_s < TIMEOUT_S + MARGIN_S, (rank0_s, said[-3000:])
    assert total_s < TIMEOUT_S + TORCHRUN_GRACE_S + MARGIN_S, (total_s, said[-3000:])
    assert proc.returncode != 0
    named = f"[rank 0] error: no answer from a peer within --timeout {TIMEOUT_S} s (a rank stuck, stopped or gone)"
    assert said.count(named) == 1, said[-3000:]
    assert "[rank0]: Traceback" not in said, said[-3000:]  # the message, not a worker's traceback
