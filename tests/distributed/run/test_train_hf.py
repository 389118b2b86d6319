"""`rewrite train --model DIR`: a Hugging Face checkpoint's weights and tokenizer in, metrics per step,
a resume under another plan in bfloat16, and `rewrite export` out."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from rewrite.run.tiny_model import make_tiny_checkpoint
from rewrite.run.train_setup import TextBatches
from tests.distributed.run.test_demo import torchrun
from tests.paths import ROOT

ARGS = ["--batch-size", "2", "--seq-len", "32", "--no-progress", "--max-grad-norm", "0.5"]


def _reference_step_one(model_dir, microbatches: int):
    """Step 1 in one process: its loss and the gradient norm of the whole model."""
    from transformers import AutoModelForCausalLM

    from rewrite.pipeline.runner import causal_lm_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = TextBatches(None, model_dir, seq_len=32, seed=0)
    inputs, targets = data.take(1, 0, microbatches * 2, 2)
    loss = sum(causal_lm_loss(model(input_ids=x).logits, y) for x, y in zip(inputs, targets)) / microbatches
    loss.backward()
    return loss.item(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()


@pytest.mark.timeout(400)
def test_train_a_checkpoint_resume_under_another_plan_and_export(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = make_tiny_checkpoint(tmp_path / "tiny")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    first = torchrun(4, "train", "plans/llama-tp2-pp2.yaml", "--model", str(model_dir), "--steps", "3",
                     "--ckpt", str(ckpt), "--resume", "--out", str(out), "--lr", "3e-3", *ARGS)  # random weights
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"--resume: {ckpt} holds no checkpoint yet (no `latest` file): starting from step 1" in first.stdout
    assert f"saved the training state of step 3 to {ckpt / 'step-00000003'}" in first.stdout, first.stdout
    assert "with its saved random weights" in first.stdout and "tokens of" in first.stdout, first.stdout
    assert "AdamW lr 0.003 (--lr)" in first.stdout, first.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert {"loss", "lr", "grad_norm", "tokens_per_second", "step_seconds", "peak_memory_bytes"} <= row.keys()
        assert row["tokens_per_second"] > 0 and row["peak_memory_bytes"] > 0
    # Step 1 is the checkpoint's own model on its own tokens: loss and the global norm of one process.
    loss, norm = _reference_step_one(model_dir, microbatches=4)
    assert abs(rows[0]["loss"] - loss) < 1e-5 and abs(rows[0]["grad_norm"] - norm) < 1e-5 * max(1.0, norm)
    assert abs(rows[0]["loss"] - math.log(512)) < 0.5  # the saved random weights, not a byte model
    assert list((out / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"

    # The same run goes on under dp 2 x tp 2 in bfloat16 (float32 master weights), resharded.
    second = torchrun(4, "train", "plans/llama-dp2-tp2.yaml", "--model", str(model_dir), "--steps", "5",
                      "--ckpt", str(ckpt), "--resume", "--out", str(out), "--dtype", "bfloat16", *ARGS)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step-00000003" in second.stdout, second.stdout
    assert "(cpu, bfloat16 compute (FSDP2 mixed precision), float32 weights)" in second.stdout, second.stdout
    # The weights are the training state's, not the folder's; the learning rate the saved run's.
    assert f"with the weights of {ckpt / 'step-00000003'} under" in second.stdout, second.stdout
    assert "with its saved weights" not in second.stdout and "AdamW lr 0.003 (the saved run's)" in second.stdout
    assert "warning" not in second.stdout  # the same data settings: the same windows, in the same order
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) and r["loss"] < rows[0]["loss"] for r in rows[3:])

    exported = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "rewrite", "export", str(ckpt), str(exported)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # one process, no torchrun
    assert done.returncode == 0 and "loads with AutoModelForCausalLM" in done.stdout, done.stdout + done.stderr
    assert f"from step 5 ({ckpt / 'step-00000005'})" in done.stdout, done.stdout  # which step it exported
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    text = "Alice was beginning to get very tired"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        trained = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:])
        initial = AutoModelForCausalLM.from_pretrained(model_dir)(input_ids=ids).logits[0, :-1]
    assert trained < torch.nn.functional.cross_entropy(initial, ids[0, 1:])  # it learned something

    # Resuming with other windows is allowed, and said.
    args = [a if a != "32" else "16" for a in ARGS]
    third = torchrun(4, "train", "plans/llama-tp2-pp2.yaml", "--model", str(model_dir), "--steps", "6",
                     "--ckpt", str(ckpt), "--resume", "--out", str(out), *args)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "warning: the data differ from the run that saved (seq_len 32 -> 16)" in third.stdout, third.stdout


def test_weights_without_a_tokenizer_and_bad_settings_are_refused(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny")
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer_config.json").unlink()
    run = torchrun(2, "train", "plans/llama-tp2.yaml", "--model", str(model_dir), "--steps", "1")
    assert run.returncode != 0 and "holds weights but no tokenizer" in run.stderr, run.stderr[-2000:]
    run = torchrun(2, "train", "plans/llama-tp2.yaml", "--steps", "1", "--resume", "--save-every", "-1",
                   "--max-grad-norm", "0", "--device", "cuda" if not torch.cuda.is_available() else "cpu")
    assert run.returncode != 0
    if not torch.cuda.is_available():
        assert "--device cuda: no GPU is visible" in run.stderr, run.stderr[-2000:]
    run = torchrun(2, "train", "plans/llama-tp2.yaml", "--steps", "1", "--resume", "--save-every", "-1",
                   "--max-grad-norm", "0", "--parity", "--dtype", "bfloat16")
    assert run.returncode != 0
    for text in ("--resume and --save-every need --ckpt", "--save-every is -1", "--max-grad-norm is 0",
                 "--parity compares step 1 with one process in float32 to 1e-5, and this run computes in bfloat16"):
        assert text in run.stderr, run.stderr[-2000:]
