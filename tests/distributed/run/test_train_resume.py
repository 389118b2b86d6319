"""`rewrite train` on a Hugging Face checkpoint directory, under torchrun: a run whose worker is
SIGKILLed mid-way restarts by itself (--max-restarts), resumes from its last complete checkpoint
and ends with the per-step losses and the weights of an uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rewrite.checkpoint.training_state import latest_checkpoint
from rewrite.run.tiny_model import make_tiny_checkpoint
from tests.launched import workers as _workers
from tests.paths import ROOT

STEPS = 24
ARGS = ["--batch-size", "2", "--seq-len", "32", "--no-progress", "--save-every", "2", "--max-grad-norm", "1.0"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "tiny")


def _torchrun(run_dir: Path, model: Path, *extra: str, restarts: int = 0) -> subprocess.Popen:
    """torchrun in a session of its own (so that every worker can be killed at once), its output to a file."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           f"--max-restarts={restarts}", "--monitor-interval=0.2", "-m", "rewrite", "train", "plans/llama-tp2-pp2.yaml",
           "--model", str(model), "--steps", str(STEPS), "--ckpt", str(run_dir / "ckpt"), "--resume",
           "--out", str(run_dir / "out"), "--export", str(run_dir / "hf"), *ARGS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_dir.mkdir(parents=True)
    with open(run_dir / "log.txt", "w") as log:  # a pipe nobody reads while polling would fill and stall the ranks
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 240) -> str:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent and every worker it left
        except ProcessLookupError:
            pass
        proc.wait()
    out = (run_dir / "log.txt").read_text()
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{out[-4000:]}"
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "out" / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines)}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted((run_dir / "hf").glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
@pytest.mark.timeout(600)
def test_a_killed_worker_restarts_resumes_and_ends_like_an_uninterrupted_run(tmp_path, model_dir):
    straight_dir, crashed_dir = tmp_path / "straight", tmp_path / "crashed"
    straight = _finish(_torchrun(straight_dir, model_dir), straight_dir)
    assert "resumed from" not in straight  # nothing to resume: the same command starts fresh
    assert latest_checkpoint(straight_dir / "ckpt")[0] == STEPS

    proc = _torchrun(crashed_dir, model_dir, restarts=2)
    deadline, killed = time.monotonic() + 180, None
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        found = latest_checkpoint(crashed_dir / "ckpt") if (crashed_dir / "ckpt" / "latest").exists() else None
        if found is not None and found[0] >= 4:
            workers = _workers(proc.pid)
            if 2 in workers:
                os.kill(workers[2], signal.SIGKILL)
                killed = found[0]
        time.sleep(0.02)
    out = _finish(proc, crashed_dir)
    assert killed is not None and killed < STEPS, f"no worker was killed mid-run:\n{out[-3000:]}"
    assert "resumed from" in out, out[-3000:]  # torchrun restarted the workers, which found the checkpoint

    # Per-step losses (the resumed steps rewritten in metrics.jsonl) and the final weights: bit for bit.
    assert _losses(crashed_dir) == _losses(straight_dir)
    want, got = _weights(straight_dir), _weights(crashed_dir)
    assert want.keys() == got.keys() and want
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
