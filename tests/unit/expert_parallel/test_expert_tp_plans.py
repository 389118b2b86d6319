"""`expert_tensor_parallel`: each expert split over tp along the dims the family's own tp plan names, what
plan_from_hf gives at tp > 1 and ep 1 where the experts add up so split; a rank's parameters and memory count
its slices (sharded over dp like any tp slice); every refusal names the fix: with ep, identity experts, no
family split (gpt-oss), a forward that does not add up (Inkling's), uneven sizes, sequence parallelism."""

from __future__ import annotations

import pytest

import rewrite
from rewrite.estimate import rank_footprints
from rewrite.models.expert_split import split_problem, tp_layout
from rewrite.run.show.data import show_data
from rewrite.run.show.report import render_text
from tests.families import tiny_family_model, tiny_moe_model

TP_RULE = {"model.layers.*.mlp.experts": "expert_tensor_parallel"}


def _problems(plan: dict, model) -> str:
    with pytest.raises(ValueError) as info:
        rewrite.resolve(plan, model)
    return str(info.value)


def test_layouts_come_from_the_family_plan():
    qwen3 = tiny_moe_model("qwen3_moe")
    experts = qwen3.model.layers[0].mlp.experts
    assert tp_layout(qwen3, "model.layers.0.mlp.experts", experts) == {"gate_up_proj": (1, 2), "down_proj": (2, 1)}
    aria = tiny_moe_model("aria_text")  # features last: [E, H, 2I] and [E, I, H]
    layout = tp_layout(aria, "model.layers.0.mlp.experts", aria.model.layers[0].mlp.experts)
    assert layout == {"gate_up_proj": (2, 2), "down_proj": (1, 1)}
    assert split_problem(aria, "model.layers.0.mlp.experts", layout) is None
    wrong = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}  # the standard layout read on Aria's
    assert "fails on one rank's slice of each expert" in split_problem(aria, "model.layers.0.mlp.experts", wrong)
    unpacked = {"gate_up_proj": (1, 1), "down_proj": (2, 1)}  # gate and up not cut part by part: values mixed
    assert "does not add up to its output whole" in split_problem(qwen3, "model.layers.0.mlp.experts", unpacked)


def test_plan_from_hf_splits_each_expert_where_it_can():
    qwen3 = tiny_moe_model("qwen3_moe")
    assert rewrite.plan_from_hf(qwen3, tp=2).tensor_parallel["model.layers.*.mlp.experts"] == "expert_tensor_parallel"
    assert rewrite.plan_from_hf(qwen3.config, tp=2).tensor_parallel["model.layers.*.mlp.experts"] == "expert_tensor_parallel"
    assert rewrite.plan_from_hf(qwen3, tp=2, ep=2).tensor_parallel["model.layers.*.mlp.experts"] == "expert_parallel"
    assert rewrite.plan_from_hf(qwen3, tp=1).tensor_parallel["model.layers.*.mlp.experts"] == "expert_parallel"
    # Llama 4: no ep plan (its tp plan names the experts moe_tp_experts), its base model not where its prefix says.
    llama4 = tiny_moe_model("llama4_text")
    rules = rewrite.plan_from_hf(llama4, tp=2).tensor_parallel
    assert rules["model.layers.*.feed_forward.experts"] == "expert_tensor_parallel"
    assert rules["model.layers.*.self_attn.q_proj"] == "column"
    assert rewrite.plan_from_hf(llama4, tp=2, ep=2).tensor_parallel["model.layers.*.feed_forward.experts"] == "expert_parallel"
    gpt_oss = tiny_moe_model("gpt_oss")  # no split of its experts in its tp plan (biases, interleaved gate/up)
    assert rewrite.plan_from_hf(gpt_oss, tp=2).tensor_parallel["model.layers.*.mlp.experts"] == "expert_parallel"


def test_a_rank_holds_its_slices_sharded_over_dp():
    qwen3 = tiny_moe_model("qwen3_moe")
    resolved = rewrite.resolve({"mesh": {"tp": 2}, "tensor_parallel": TP_RULE}, qwen3)
    spec = resolved.experts[0]
    assert (spec.tp, spec.ep, spec.local) == (2, 1, 4)
    assert resolved.split_of("model.layers.0.mlp.experts.gate_up_proj").local_shape((4, 64, 64)) == (4, 32, 64)
    assert resolved.split_of("model.layers.0.mlp.experts.down_proj").local_shape((4, 64, 32)) == (4, 64, 16)
    experts = sum(p.numel() for n, p in qwen3.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in qwen3.parameters())
    assert resolved.stages[0].param_count == total - experts // 2
    at_dp2 = rewrite.resolve({"mesh": {"tp": 2, "dp": 2}, "tensor_parallel": TP_RULE}, qwen3)
    held = rank_footprints(at_dp2, qwen3)[0].params  # FSDP2 shards the slices over dp too
    assert held <= (total - experts // 2) // 2 + 4 * 64 * 4, held
    assert rewrite.resolve({"mesh": {"dp": 2}, "tensor_parallel": TP_RULE}, qwen3).experts[0].tp == 1  # checked, kept
    data = show_data(at_dp2, qwen3)
    assert data["experts_over_tp"][0]["features"] == {"down_proj": {"dim": 2, "parts": 1},
                                                      "gate_up_proj": {"dim": 1, "parts": 2}}
    assert ("experts split over tp: every tp rank holds 1/2 of each of the 4 experts of model.layers.0-3.mlp.experts "
            "(down_proj along dim 2; gate_up_proj along dim 1 (2 packed parts))") in " ".join(render_text(data).split())


def test_refusals_name_the_fix():
    qwen3 = tiny_moe_model("qwen3_moe")
    text = _problems({"mesh": {"tp": 2, "dp": 2, "ep": 2}, "tensor_parallel": TP_RULE}, qwen3)
    assert "both in one plan is not built yet; name the experts 'expert_parallel' or use ep 1" in text
    text = _problems({"mesh": {"tp": 3}, "tensor_parallel": TP_RULE}, qwen3)
    assert "mesh.tp=3 does not split the experts' features of model.layers.*.mlp.experts evenly" in text
    assert "use tp 1, 2, 4, 8" in text
    text = _problems({"mesh": {"tp": 2}, "tensor_parallel": TP_RULE}, tiny_moe_model("gpt_oss"))
    assert "GptOssConfig's tensor-parallel plan does not split by expert features" in text
    assert "split it by expert ('expert_parallel' with mesh.ep) or leave it whole" in text
    text = _problems({"mesh": {"tp": 2}, "tensor_parallel": TP_RULE}, tiny_moe_model("longcat_flash"))
    assert "a LongcatFlashExperts with identity experts, whose rows every rank would add again" in text
    text = _problems({"mesh": {"tp": 2}, "tensor_parallel": TP_RULE}, tiny_moe_model("inkling_text"))
    assert "InklingExperts.forward on two ranks' slices of each expert does not add up" in text


def test_sequence_parallelism_runs_a_moe_block_on_the_ranks_part():
    from rewrite.binding.tp_switches import sequence_blocks

    # The MoE block is no block: it runs token by token on the rank's part; its split shared experts are one.
    ernie = tiny_family_model("ernie4_5_moe")
    for tp, ep in [(2, 1), (2, 2), (4, 4)]:
        resolved = rewrite.resolve(rewrite.plan_from_hf(ernie, tp=tp, ep=ep, sequence_parallel=True), ernie)
        styles = {s.fqn: s.style for s in resolved.shards}
        blocks, others, moe = sequence_blocks(ernie.model.layers[1], "model.layers.1", styles)
        assert moe == {"model.layers.1.mlp": "model.layers.1.mlp.experts"} and others == {}, (moe, others)
        assert blocks == {"model.layers.1.self_attn": {"column", "row"},
                          "model.layers.1.mlp.shared_experts": {"column", "row"}}, blocks
    qwen3 = tiny_moe_model("qwen3_moe")
    whole = {"mesh": {"tp": 2}, "sequence_parallel": True, "tensor_parallel": {
        **{k: v for k, v in rewrite.plan_from_hf(qwen3, tp=2).tensor_parallel.items() if "experts" not in k},
        "model.layers.*.mlp.experts": "expert_parallel"}}
    assert rewrite.resolve(whole, qwen3).plan.sequence_parallel
    # A family whose attention sequence parallelism cannot gather is still refused, by its attention.
    deepseek = tiny_moe_model("deepseek_v3")
    text = _problems(rewrite.plan_from_hf(deepseek, tp=2, ep=2, sequence_parallel=True).model_dump(), deepseek)
    assert "runs model.layers.*.self_attn (DeepseekV3Attention) on this rank's part of the sequence" in text
    assert "mlp" not in text
