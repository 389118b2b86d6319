"""A stuck worker (SIGSTOP) fails the run within `--timeout`: the rank still running stops with one
report naming the timeout, the step and the action it waited in, and the rank that sent no report (at
pp 2 and at dp 2), and torchrun then ends the stuck one (after its own shutdown grace, in which the dp 2
case runs)."""

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
# run inside them at dp), one of the step's all-reduces, or the stop-signal check between steps.
WHERE = (r"(recv [FB]\d+ for stage 0 from rank 1|the step's last sends, to rank 1|[FBIW]\d+ of stage 0"
         r"|the data-parallel gradient reduce over dp|the .+ all-reduce over every rank|the step's input checks .+"
         r"|the stop-signal check \(an all-reduce over every rank\))")


class _Run:
    """A `torchrun` of 2 ranks training under `plan` until stopped, its output in `folder`/log.txt."""

    def __init__(self, folder: Path, plan: str):
        self.folder, self.out, self.workers = folder, folder / "out", {}
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--monitor-interval=0.2", "-m", "rewrite", "train", plan, "--steps", "100000", "--seq-len", "16",
               "--batch-size", "1", "--timeout", str(TIMEOUT_S), "--no-parity", "--no-progress", "--out", str(self.out)]
        with open(folder / "log.txt", "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def said(self) -> str:
        return (self.folder / "log.txt").read_text()

    def stop_rank_1(self) -> float:
        """SIGSTOP rank 1 once steps run; the seconds until rank 0 ended."""
        deadline, metrics = time.monotonic() + 180, self.out / "metrics.jsonl"
        while time.monotonic() < deadline and self.proc.poll() is None:  # until it trains: past the rendezvous
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        self.workers = _workers(self.proc.pid)
        assert set(self.workers) == {0, 1}, self.said()[-3000:]
        os.kill(self.workers[1], signal.SIGSTOP)
        self.stopped = time.monotonic()
        while _alive(self.workers[0]) and time.monotonic() - self.stopped < TIMEOUT_S + MARGIN_S:
            time.sleep(0.1)
        return time.monotonic() - self.stopped

    def end(self) -> None:
        end(self.proc, self.workers.values())  # the stopped rank too: in a session of its own, killpg misses it


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
    """At pp 2; then, while torchrun waits out its shutdown grace for the stopped rank, at dp 2 (a stopped replica
    is named by the one still running)."""
    (tmp_path / "dp2.yaml").write_text("mesh: {dp: 2}\npipeline: {microbatches: 2}\n")
    runs = [_Run(tmp_path / "pp2", "plans/llama-pp2.yaml")]
    try:
        rank0_s = runs[0].stop_rank_1()
        assert TIMEOUT_S - 1 <= rank0_s < TIMEOUT_S + MARGIN_S, (rank0_s, runs[0].said()[-3000:])
        runs.append(_Run(tmp_path / "dp2", str(tmp_path / "dp2.yaml")))
        replica_s = runs[1].stop_rank_1()
        runs[1].end()
        assert TIMEOUT_S - 1 <= replica_s < TIMEOUT_S + MARGIN_S, (replica_s, runs[1].said()[-3000:])
        _says_where(runs[1].said(), WHERE)
        runs[0].proc.wait(timeout=max(1.0, runs[0].stopped + TIMEOUT_S + TORCHRUN_GRACE_S + MARGIN_S - time.monotonic()))
        total_s = time.monotonic() - runs[0].stopped
    finally:
        for run in runs:
            run.end()
    assert total_s < TIMEOUT_S + TORCHRUN_GRACE_S + MARGIN_S, (total_s, runs[0].said()[-3000:])
    assert runs[0].proc.returncode != 0
    _says_where(runs[0].said(), WHERE)
