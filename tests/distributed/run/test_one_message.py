"""A failure every rank sees is said once: under `rewrite train --nproc-per-node 4` (torch's elastic
launcher in rewrite's process) a bad plan, a bad data line, a non-finite step and a rank that stops
each end the run with one message block of at most 10 lines and the failing rank's status, without
torchrun's report; under plain torchrun rewrite's message comes once, before torchrun's report."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rewrite.run.tiny_model import make_tiny_checkpoint
from tests.launched import alive, end, workers as _workers
from tests.paths import ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BAD_PLAN = ('mesh: {tp: 2, pp: 2}\ntensor_parallel:\n  "model.layers.*.mlp.up_projj": column\n'
            "pipeline: {microbatches: 3, schedule: zbv}\n")
QUICK = ["--steps", "3", "--seq-len", "16", "--batch-size", "1", "--no-parity", "--no-progress"]


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rewrite", "train", *args, "--nproc-per-node", "4", "--out", str(tmp_path / "out")]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)


def _one_block(run: subprocess.CompletedProcess, starts: str, *, before: int = 0) -> list[str]:
    """The run's output: its first `before` lines (training's own), then one block opening with `starts`."""
    lines = (run.stdout + run.stderr).splitlines()
    assert run.returncode == 1, "\n".join(lines[-20:])
    block = lines[before:]
    assert block and block[0].startswith(starts), "\n".join(lines[:20])
    assert len(block) <= 10 and sum(line.startswith("error:") for line in lines) == 1, "\n".join(lines)
    assert "Traceback" not in run.stdout + run.stderr and "ChildFailedError" not in run.stderr, "\n".join(lines)
    return block


@pytest.mark.timeout(500)
def test_failures_every_rank_sees_are_said_once_by_the_launcher(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD_PLAN)
    block = _one_block(_launch(tmp_path, str(tmp_path / "bad.yaml"), *QUICK), "error: ")
    assert "2 problems" in block[0] and "did you mean 'model.layers.*.mlp.up_proj'?" in block[1], block

    model = make_tiny_checkpoint(tmp_path / "tiny")
    chat = (ROOT / "data" / "chat-sums.jsonl").read_text().splitlines()[:7]
    (tmp_path / "bad.jsonl").write_text("\n".join([*chat, '{"messages": [{"role": "user" "content": "x"}]}']) + "\n")
    block = _one_block(_launch(tmp_path, "plans/llama-tp2-pp2.yaml", "--model", str(model), "--data",
                               str(tmp_path / "bad.jsonl"), *QUICK), "error: ")
    assert block == [f"error: {tmp_path / 'bad.jsonl'}:8: not JSON (Expecting ',' delimiter); write one JSON object "
                     "per line"], block

    run = _launch(tmp_path, "plans/llama-tp2-pp2.yaml", *QUICK, "--lr", "1e30")  # the second step's update is nan
    block = _one_block(run, "error: rewrite train stopped at step 2: ", before=2)  # the header and step 1 before it
    assert "--max-grad-norm 1.0" in block[0], block


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the launcher's workers through /proc")
@pytest.mark.timeout(300)
def test_a_stopped_rank_is_reported_once_by_the_launcher(tmp_path):
    cmd = [sys.executable, "-m", "rewrite", "train", "plans/llama-tp2-pp2.yaml", "--nproc-per-node", "4",
           "--steps", "100000", "--seq-len", "16", "--batch-size", "1", "--timeout", "8", "--no-parity", "--no-progress",
           "--out", str(tmp_path / "out")]
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    metrics, workers = tmp_path / "out" / "metrics.jsonl", {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert set(workers) == {0, 1, 2, 3}, (tmp_path / "log.txt").read_text()[-3000:]
        os.kill(workers[3], signal.SIGSTOP)
        while any(alive(workers[r]) for r in (0, 1, 2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(workers[3], signal.SIGKILL)  # what the launcher does 30 s after the others ended
        proc.wait(timeout=60)
    finally:
        end(proc, workers.values())
    lines = (tmp_path / "log.txt").read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if "error: no answer from a peer" in line), None)
    assert start is not None, "\n".join(lines[-40:])
    block = lines[start:]
    assert proc.returncode == 1 and len(block) <= 10, "\n".join(lines)
    # Rank 3, and any rank whose wait ended only after the first report was printed (its peer gone by then).
    assert any(re.match(r"  ranks? (\d+, )*3 sent no report within 8 s", line) for line in block), "\n".join(block)
    assert sum("error:" in line for line in lines) == 1 and "Traceback" not in "\n".join(lines), "\n".join(lines)


def test_plain_torchrun_shows_the_message_once_before_its_report(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD_PLAN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "rewrite", "train",
           str(tmp_path / "bad.yaml"), *QUICK, "--out", str(tmp_path / "out")]
    run = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    said = run.stdout + run.stderr
    assert run.returncode != 0 and said.count("error: ") == 1 and said.count("2 problems") == 1, said[-3000:]
