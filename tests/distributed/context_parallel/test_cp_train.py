"""`rewrite train` on conversations under context parallelism: the shipped cp 2 x tp 2 plan on packed rows
(step 1 against one process, the trained tokens over whole epochs equal to the assistant's), and
dp 2 x pp 2 x cp 2 on the same data."""

from __future__ import annotations

import math

from rewrite.run.packing import TuningBatches
from rewrite.run.tiny_model import make_tiny_checkpoint
from tests.distributed.run.test_demo import PARITY, torchrun
from tests.distributed.run.test_train_tuning import _assistant_tokens, _counted
from tests.paths import ROOT

CONVERSATIONS = 12


def _parity_ok(run) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    parity = PARITY.search(run.stdout)
    assert parity and float(parity["dloss"]) < 1e-5 and float(parity["dgrad"]) < 1e-5, run.stdout[-3000:]


def test_fine_tuning_conversations_under_context_parallelism(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny")
    lines = (ROOT / "data" / "chat-sums.jsonl").read_text().splitlines()[:CONVERSATIONS]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")

    # cp 2 x tp 2, packed at 256 tokens a row (each cp rank 128 of them, documents crossing the shards):
    # 2 rows a step; as many steps as make whole epochs.
    rows = len(TuningBatches(str(data), model_dir, seq_len=256, seed=0).rows)
    steps = math.lcm(rows, 2) // 2
    out = tmp_path / "cp-tp"
    run = torchrun(4, "train", "plans/llama-cp2-tp2.yaml", "--model", str(model_dir), "--data", str(data),
                   "--seq-len", "256", "--batch-size", "1", "--steps", str(steps), "--parity", "--no-progress",
                   "--out", str(out), timeout_s=400)
    _parity_ok(run)
    assert sum(_counted(out)) == steps * 2 // rows * _assistant_tokens(model_dir, lines)

    # dp 2 x pp 2 x cp 2 (8 ranks): replicas, stages and sequence shards at once.
    plan = tmp_path / "dp-pp-cp.yaml"
    plan.write_text("mesh: {dp: 2, pp: 2, cp: 2}\npipeline: {schedule: 1f1b, microbatches: 2}\n")
    run = torchrun(8, "train", str(plan), "--model", str(model_dir), "--data", str(data), "--seq-len", "128",
                   "--batch-size", "1", "--steps", "2", "--parity", "--no-progress", "--out", str(tmp_path / "dp-pp-cp"),
                   timeout_s=400)
    _parity_ok(run)

    # A --seq-len that 2 x cp does not split is refused before training, naming the lengths that do.
    odd = torchrun(4, "train", "plans/llama-cp2-tp2.yaml", "--model", str(model_dir), "--data", str(data),
                   "--seq-len", "254", "--steps", "1", "--no-progress", "--out", str(tmp_path / "odd"), timeout_s=200)
    assert odd.returncode != 0 and "use a length that 4 divides, e.g. 252 or 256" in odd.stdout + odd.stderr
    assert "step 1" not in odd.stdout
