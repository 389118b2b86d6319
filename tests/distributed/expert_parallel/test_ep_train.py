"""`rewrite train` on a mixture of experts: a Qwen3-MoE-shaped model at dp 2 x ep 2 (step 1 against
one process, gradients clipped over the whole model), its training state resumed at dp 2 without ep
(the experts then sharded by FSDP2 like every other parameter), and a Hugging Face export that plain
transformers loads."""

from __future__ import annotations

import torch

from tests.distributed.run.test_demo import PARITY, torchrun


def _ok(run) -> str:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_train_save_and_resume_a_mixture_of_experts(tmp_path):
    from transformers import AutoModelForCausalLM

    ep = tmp_path / "ep.yaml"
    ep.write_text("mesh: {dp: 2, ep: 2}\ntensor_parallel: {model.layers.*.mlp.experts: expert_parallel}\n"
                  "pipeline: {microbatches: 2}\n")
    common = ["--model", "tiny-qwen3-moe", "--batch-size", "4", "--seq-len", "32", "--no-progress",
              "--max-grad-norm", "1.0", "--ckpt", str(tmp_path / "ckpt")]
    out = _ok(torchrun(2, "train", str(ep), *common, "--steps", "2", "--parity", "--out", str(tmp_path / "a"),
                       timeout_s=300))
    parity = PARITY.search(out)
    assert parity and float(parity["dloss"]) < 1e-5 and float(parity["dgrad"]) < 1e-5, out[-3000:]

    dense = tmp_path / "dp.yaml"
    dense.write_text("mesh: {dp: 2}\npipeline: {microbatches: 2}\n")
    out = _ok(torchrun(2, "train", str(dense), *common, "--steps", "3", "--resume", "--export", str(tmp_path / "hf"),
                       "--out", str(tmp_path / "b"), timeout_s=300))
    assert "resumed from" in out and "step 3/3" in out and "step 1/" not in out, out[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe" and model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
