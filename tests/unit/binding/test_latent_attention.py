"""Multi-head latent attention split over tp: what binds, and the refusals (a split that would train
partial gradients, the style on something it does not fit, heads split apart)."""

from __future__ import annotations

import pytest

from rewrite.binding.resolve import resolve
from rewrite.estimate.plan_parts import block_splits, shard_styles
from rewrite.plan.files import PlanError
from rewrite.plan.from_hf import plan_from_hf
from rewrite.plan.loading import load_plan
from tests.families import tiny_family_model, tiny_moe_model

ATTENTION = "model.layers.*.self_attn"
SPLIT = {f"{ATTENTION}.q_b_proj": "column", f"{ATTENTION}.kv_b_proj": "column", f"{ATTENTION}.o_proj": "row"}


def _problems(model, rules: dict, tp: int = 2) -> list[str]:
    with pytest.raises(PlanError) as caught:
        resolve({"mesh": {"tp": tp}, "tensor_parallel": rules}, model)
    return caught.value.problems


def test_the_hugging_face_plan_binds_the_kv_a_projection_whole():
    model = tiny_moe_model("deepseek_v2")
    plan = plan_from_hf(model, tp=2)
    assert plan.tensor_parallel[f"{ATTENTION}.kv_a_proj_with_mqa"] == "mla_kv_a"
    assert load_plan({"tensor_parallel": {"a": "mla_kv_a_proj"}}).tensor_parallel["a"] == "mla_kv_a"
    shards = {s.fqn: s for s in resolve(plan, model).shards}
    kv_a = shards["model.layers.0.self_attn.kv_a_proj_with_mqa"]
    assert kv_a.style == "mla_kv_a" and kv_a.weight_shape == (144, 64), kv_a
    lite = tiny_moe_model("deepseek_v2", q_lora_rank=None)  # q_proj split: its latents are not per-head modules
    styles = {s.fqn: s.style for s in resolve(plan_from_hf(lite, tp=2), lite).shards}
    assert styles["model.layers.0.self_attn.q_proj"] == "column"
    assert "model.layers.0.self_attn.kv_a_layernorm" not in styles, styles


def test_a_split_without_the_rotary_key_sum_is_refused():
    model = tiny_moe_model("deepseek_v3")
    problems = _problems(model, SPLIT)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{ATTENTION}.kv_a_proj_with_mqa feeds its last 16 features (the rotary key"), problems
    assert f"add tensor_parallel['{ATTENTION}.kv_a_proj_with_mqa']: mla_kv_a (Hugging Face: mla_kv_a_proj)" in problems[0]
    resolved = resolve({"mesh": {"tp": 2}, "tensor_parallel": {**SPLIT, f"{ATTENTION}.kv_a_proj_with_mqa": "mla_kv_a"}},
                       model)
    assert block_splits(shard_styles(resolved), "model.layers.0")["attention_split"]  # the estimates split it


def test_the_style_where_it_does_not_fit_is_refused():
    model = tiny_moe_model("deepseek_v3")
    alone = _problems(model, {f"{ATTENTION}.kv_a_proj_with_mqa": "mla_kv_a"})
    assert any("whose attention model.layers.0.self_attn is not split over tp" in p for p in alone), alone
    llama = tiny_family_model("llama")
    rules = {"model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
             "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "mla_kv_a"}
    wrong = _problems(llama, rules)
    assert any("nor the config gives a qk_rope_head_dim below its 64 output features" in p for p in wrong), wrong


def test_heads_split_apart_are_refused():
    model = tiny_moe_model("deepseek_v3")  # 4 heads
    problems = _problems(model, {**SPLIT, f"{ATTENTION}.kv_a_proj_with_mqa": "mla_kv_a"}, tp=8)
    assert f"{ATTENTION} has 4 heads, which mesh.tp=8 does not split whole; use a tp dividing the heads, or leave " \
           "the attention whole" in problems, problems
