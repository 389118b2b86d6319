"""Bare per-head parameters split with the heads over tp 2 (attention sinks, `self_attn.sinks: column`;
Beam's per-head gate bias), against one process: the loss, every gradient and the gradient norm. The
families' own plans through plan_from_hf (their `local_params` marks need no rule here); under sequence
parallelism with 15 tokens (the last part padded: an attention without rotary embeddings drops the padding
by the sequence's length); with ep 2 over the tp pair. A Hugging Face save of the split model loads in
plain transformers, and back under the plan (from it and from a training state), as exactly its weights."""

from __future__ import annotations

import torch

import rewrite
from tests.distributed.expert_parallel.resume import matches, saved_weights
from tests.families import tiny_moe_model
from tests.multiproc import run
from tests.reference import assert_step_and_norm


def _cases(rank: int, world: int, root: str) -> list[str]:
    out = []
    model = tiny_moe_model("mimo_v2_flash")
    plan = rewrite.plan_from_hf(model, tp=2, microbatches=2)
    assert plan.tensor_parallel["model.layers.*.self_attn.sinks"] == "column"
    assert "model.layers.*.self_attn" not in plan.tensor_parallel  # local_params: no rule needed
    stage, _, loss = assert_step_and_norm(model, plan, 12, "mimo_v2_flash tp2")
    sinks = [layer.self_attn.sinks for layer in stage.model.model.layers if layer.self_attn.sinks is not None]
    assert sinks and all(tuple(s.shape) == (2,) for s in sinks)  # 2 of the 4 heads' each
    out.append(f"mimo_v2_flash tp2: {float(loss):.5f}")
    rewrite.save_pretrained(stage, plan, f"{root}/hf")
    weights = saved_weights(root)
    matches("the Hugging Face save", stage.model, weights)
    matches("from_pretrained under tp 2", rewrite.from_pretrained(f"{root}/hf", plan).model, weights)
    rewrite.save_training_state(f"{root}/state", stage, torch.optim.AdamW(stage.parameters()), extra={"step": 1})
    fresh = rewrite.apply_plan(tiny_moe_model("mimo_v2_flash", seed=3), plan)
    assert rewrite.load_training_state(f"{root}/state", fresh, torch.optim.AdamW(fresh.parameters())) == {"step": 1}
    matches("the training state under tp 2", fresh.model, weights)
    for family, options in (("granitemoe_swa", {"sequence_parallel": True}), ("beam", {"ep": 2})):
        model = tiny_moe_model(family)
        _, _, loss = assert_step_and_norm(model, rewrite.plan_from_hf(model, tp=2, microbatches=2, **options), 15,
                                          f"{family} tp2 {options}")
        out.append(f"{family} tp2 {options}: {float(loss):.5f}")
    return out


def test_per_head_parameters_split_with_the_heads(tmp_path):
    print(run(_cases, 2, str(tmp_path), timeout_s=300)[0])
