"""`make demo`'s run, shortened: `rewrite train --nproc-per-node 4` (its own launcher, 4 processes); the
`torchrun` helper for the tests that run plain torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.paths import ROOT

PARITY = re.compile(
    r"^parity vs single process \(step 1\): max \|dloss\| = (?P<dloss>\S+), "
    r"max \|dgrad\| = (?P<dgrad>\S+) over (?P<n>\d+) parameters$",
    re.MULTILINE,
)


def torchrun(nprocs: int, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*cmd, "-m", "rewrite", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env
    )


def test_demo_parity_line_pictures_and_metrics(tmp_path):
    out_dir = tmp_path / "demo"
    run = subprocess.run(  # as `make demo` runs it: the launcher inside rewrite starts the 4 processes
        [sys.executable, "-m", "rewrite", "train", "plans/llama-tp2-pp2.yaml", "--nproc-per-node", "4", "--model",
         "tiny-llama", "--steps", "3", "--out", str(out_dir)], cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # One parity line, printed once (by rank 0).
    found = PARITY.findall(run.stdout + run.stderr)
    assert len(found) == 1, run.stdout + run.stderr
    match = PARITY.search(run.stdout + run.stderr)
    assert float(match["dloss"]) <= 1e-5 and float(match["dgrad"]) <= 1e-5, match[0]
    assert int(match["n"]) == 39  # tiny-llama: every parameter was compared somewhere
    assert "with random weights under plans/llama-tp2-pp2.yaml, AdamW lr 0.003 (the default for random weights" in run.stdout
    assert "--parity: each rank also holds the whole model once more" in run.stdout  # memory no estimate counts
    for name in ("timeline.png", "loss.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert len(metrics["losses"]) == 3
    assert metrics["losses"][-1] < metrics["losses"][0], metrics["losses"]  # AdamW moves it down already
    assert metrics["parity"]["num_params"] == metrics["parity"]["total_params"] == 39
    events = metrics["timeline"]
    # 4 ranks x 4 microbatches x (forward, backward), AFAB on each rank.
    assert len(events) == 32
    for rank in range(4):
        mine = [e for e in events if e["rank"] == rank]
        forwards = [e for e in mine if e["kind"] == "forward"]
        backwards = [e for e in mine if e["kind"] == "backward"]
        assert [e["mb_idx"] for e in forwards] == [0, 1, 2, 3]
        assert max(e["end"] for e in forwards) <= min(e["start"] for e in backwards)
    assert "loss " in run.stdout and " -> " in run.stdout


def test_wrong_process_count_says_how_many(tmp_path):
    run = torchrun(2, "train", "plans/llama-tp2-pp2.yaml", "--steps", "1", "--out", str(tmp_path), timeout_s=120)
    assert run.returncode != 0
    assert "needs 4 processes, but 2 were started; run `torchrun --nproc-per-node 4" in run.stderr
    assert run.stderr.count("cannot start:") == 1  # rank 0 speaks for every rank


def test_a_model_typo_under_torchrun_is_said_once_before_torchrun_reports(tmp_path):
    run = torchrun(2, "train", "plans/llama-tp2.yaml", "--model", "tiny-lama", "--steps", "1", "--out", str(tmp_path),
                   timeout_s=120)
    assert run.returncode != 0
    assert run.stderr.count("did you mean 'tiny-llama'?") == 1, run.stderr  # once, not once per rank
    ours = run.stderr.index("error: rewrite train: cannot start:")
    assert ours < run.stderr.index("ChildFailedError"), "our line comes before torchrun's own report"
    assert run.stderr.count("Traceback") == 1 and "rewrite/run/" not in run.stderr, "torchrun's traceback, none of ours"


def test_train_under_a_zero_bubble_v_plan(tmp_path):
    run = torchrun(2, "train", "plans/llama-pp2-zbv.yaml", "--steps", "2", "--no-progress", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    match = PARITY.search(run.stdout + run.stderr)
    assert match and float(match["dloss"]) <= 1e-5 and float(match["dgrad"]) <= 1e-5, run.stdout[-2000:]
    events = json.loads((tmp_path / "metrics.json").read_text())["timeline"]
    assert {e["kind"] for e in events} == {"forward", "backward-input", "backward-weight"}
    assert {e["stage_idx"] for e in events if e["rank"] == 0} == {0, 3}  # the V: first and last stage on rank 0


def test_train_with_data_parallel_replicas(tmp_path):
    plan = tmp_path / "dp2-pp2.yaml"
    plan.write_text("mesh: {dp: 2, pp: 2}\npipeline: {microbatches: 2, schedule: 1f1b}\n")
    run = torchrun(4, "train", str(plan), "--steps", "2", "--batch-size", "4", "--no-progress", "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "dp=2 x pp=2 x tp=1 on 4 ranks" in run.stdout and "(2 replicas, full sharding)" in run.stdout, run.stdout
    assert "(LlamaForCausalLM, 180,800 parameters)" in run.stdout
    # Step 1 against one process on the whole global batch: both replicas' microbatches.
    match = PARITY.search(run.stdout + run.stderr)
    assert match and float(match["dloss"]) <= 1e-5 and float(match["dgrad"]) <= 1e-5 and int(match["n"]) == 39
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["mesh"] == {"dp": 2, "pp": 2, "tp": 1, "world_size": 4}
    assert metrics["tokens_per_step"] == 2 * 2 * 4 * 128  # microbatches x replicas x batch size x sequence
