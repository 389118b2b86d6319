"""`rewrite train` on fine-tuning data: conversations packed into rows (tp 2 x pp 2, step 1 against
one process running the model's own forward with the same positions), one a row (dp 2 x tp 2), and
the tokens the loss counts over an epoch equal to the assistant's tokens by transformers' own mask."""

from __future__ import annotations

import json
import math
import re

from rewrite.run.packing import TuningBatches
from rewrite.run.tiny_model import make_tiny_checkpoint
from tests.distributed.run.test_demo import PARITY, torchrun
from tests.paths import ROOT

CONVERSATIONS = 20


def _assistant_tokens(model_dir, lines: list[str]) -> int:
    """The assistant's tokens of every conversation, as the chat template marks them (the oracle)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    total = 0
    for line in lines:
        marked = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
        total += sum(marked["assistant_masks"])
    return total


def _counted(out) -> list[int]:
    return [json.loads(line)["counted_tokens"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fine_tuning_on_conversations_counts_the_assistants_tokens(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny")
    lines = (ROOT / "data" / "chat-sums.jsonl").read_text().splitlines()[:CONVERSATIONS]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    expected = _assistant_tokens(model_dir, lines)

    # Packed at 256 tokens a row: 4 rows a step (4 microbatches x 1); as many steps as make whole epochs.
    rows = len(TuningBatches(str(data), model_dir, seq_len=256, seed=0).rows)
    steps = math.lcm(rows, 4) // 4
    out = tmp_path / "packed"
    run = torchrun(4, "train", "plans/llama-tp2-pp2.yaml", "--model", str(model_dir), "--data", str(data),
                   "--seq-len", "256", "--batch-size", "1", "--steps", str(steps), "--parity", "--no-progress",
                   "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"({CONVERSATIONS} examples in {rows} rows, packed)" in run.stdout, run.stdout
    assert re.search(r"a step of 4 rows holds about [\d.]+ documents, [\d,]+ tokens and [\d,]+ trained", run.stdout)
    parity = PARITY.search(run.stdout)
    assert parity and float(parity["dloss"]) < 1e-5 and float(parity["dgrad"]) < 1e-5, run.stdout
    epochs = steps * 4 // rows
    assert sum(_counted(out)) == epochs * expected, (sum(_counted(out)), epochs, expected)

    # One conversation a row, padded: 16 rows = 2 steps of 8 (dp 2 x 4 microbatches x 1) = one epoch.
    out, data = tmp_path / "unpacked", tmp_path / "chat16.jsonl"
    data.write_text("\n".join(lines[:16]) + "\n")
    run = torchrun(4, "train", "plans/llama-dp2-tp2.yaml", "--model", str(model_dir), "--data", str(data),
                   "--seq-len", "128", "--batch-size", "1", "--steps", "2", "--no-pack", "--parity", "--no-progress",
                   "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    parity = PARITY.search(run.stdout)
    assert parity and float(parity["dloss"]) < 1e-5 and float(parity["dgrad"]) < 1e-5, run.stdout
    assert "(16 examples in 16 rows, one a row (--no-pack))" in run.stdout, run.stdout
    assert sum(_counted(out)) == _assistant_tokens(model_dir, lines[:16])


def test_bad_fine_tuning_data_is_refused_before_training(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny")
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                    + "\n" + json.dumps({"question": "?"}) + "\n")
    run = torchrun(2, "train", "plans/llama-pp2.yaml", "--model", str(model_dir), "--data", str(data), "--no-progress",
                   "--out", str(tmp_path / "out"), timeout_s=120)
    assert run.returncode != 0
    text = run.stdout + run.stderr
    assert f"{data}:2: no field to train on (found keys ['question'])" in text, text[-3000:]
    assert "step 1" not in text
    bytes_only = torchrun(2, "train", "plans/llama-pp2.yaml", "--model", "tiny-llama", "--data", str(data),
                          "--no-progress", "--out", str(tmp_path / "out"), timeout_s=120)
    assert bytes_only.returncode != 0
    assert "need the model's tokenizer, and --model tiny-llama has none" in bytes_only.stdout + bytes_only.stderr
