"""A stuck worker (SIGSTOP) fails the run within `--timeout`: the rank still running stops with one
report naming the timeout, the step and the action it waited in, and the rank that sent no report (at
pp 2 and at dp 2), and torchrun then ends the stuck one (after its own shutdown grace)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launched import alive as _alive, end, workers as _workers
from tests.paths import ROOT

TIMEOUT_S = 8
TORCHRUN_GRACE_S = 30  # torchrun's SIGTERM -> SIGKILL wait for a worker after another failed (torch 2.13)
MARGIN_S = 20
# Where rank 0 can be when rank 1 stops: a transfer to or from it (pp), an action (FSDP2's gathers and reduces
# run inside them at dp), or one of the step's all-reduces.
WHERE = (r"(recv [FB]\d+ for stage 0 from rank 1|the step's last sends, to rank 1|[FBIW]\d+ of stage 0"
         r"|the data-parallel gradient reduce over dp|the .+ all-reduce over every rank|the step's input checks .+)")


def _stop_rank_1(tmp_path: Path, plan: str, *, wait_for_torchrun: bool) -> tuple[str, float, float | None, int]:
    """Train under `plan` on 2 ranks, SIGSTOP rank 1 once steps run; (the log, seconds until rank 0 ended, until
    torchrun ended (None when not waited for), torchrun's status)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.2",
           "-m", "rewrite", "train", plan, "--steps", "100000", "--seq-len", "16", "--batch-size", "1",
           "--timeout", str(TIMEOUT_S), "--no-parity", "--no-progress", "--out", str(out)]
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    total_s, workers = None, {}
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
        if wait_for_torchrun:
            proc.wait(timeout=TIMEOUT_S + TORCHRUN_GRACE_S + MARGIN_S)
            total_s = time.monotonic() - stopped
    finally:
        end(proc, workers.values())  # the stopped rank too: in a session of its own, killpg misses it
    return (tmp_path / "log.txt").read_text(), rank0_s, total_s, proc.returncode


def _says_where(said: str, waited: str) -> None:
    """One report, by rank 0: the timeout, where rank 0 waited (at which step), that rank 1 sent nothing."""
    named = f"[rank 0] error: no answer from a peer within --timeout {TIMEOUT_S} s (a rank stuck, stopped or gone)"
    assert said.count(named) == 1, said[-3000:]
    report = said[said.index(named):].splitlines()
    assert re.fullmatch(rf"  rank 0 waited in step \d+: {waited}", report[1]), report[:6]
    assert report[2] == f"  rank 1 sent no report within {TIMEOUT_S} s: stopped, stuck elsewhere, or gone", report[:6]
    assert "[rank0]: Traceback" not in said, said[-3000:]  # the message, not a worker's traceback


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
@pytest.mark.timeout(300)
def test_a_stopped_worker_fails_the_run_within_the_timeout_naming_where(tmp_path):
    said, rank0_s, total_s, status = _stop_rank_1(tmp_path, "plans/llama-pp2.yaml", wait_for_torchrun=True)
    assert TIMEOUT_S - 1 <= rank0_s < TIMEOUT_S + MARGIN_S, (rank0_s, said[-3000:])
    assert total_s < TIMEOUT_S + TORCHRUN_GRACE_S + MARGIN_S, (total_s, said[-3000:])
    assert status != 0
    _says_where(said, WHERE)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
@pytest.mark.timeout(300)
def test_a_stopped_replica_is_named_by_the_one_still_running(tmp_path):
    (tmp_path / "dp2.yaml").write_text("mesh: {dp: 2}\npipeline: {microbatches: 2}\n")
    said, rank0_s, _, _ = _stop_rank_1(tmp_path, str(tmp_path / "dp2.yaml"), wait_for_torchrun=False)
    assert TIMEOUT_S - 1 <= rank0_s < TIMEOUT_S + MARGIN_S, (rank0_s, said[-3000:])
    _says_where(said, WHERE)
