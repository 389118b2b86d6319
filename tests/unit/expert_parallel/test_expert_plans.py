"""mesh.ep in a plan and its binding: ep borrows ranks from dp (the groups it makes), `expert_parallel`
rules bind fused experts modules only, every refusal names the sizes or the rule that works, a rank's
parameters and memory count E / ep experts held whole, and plan_from_hf reads a family's ep plan."""

from __future__ import annotations

import pytest
import torch

import rewrite
from rewrite.mesh import expert_groups
from rewrite.plan.ranks import Shape
from rewrite.models.experts import every_token, expert_block, experts_problem
from rewrite.estimate import rank_footprints
from tests.families import tiny_family_model, tiny_moe_model

RULE = {"model.layers.*.mlp.experts": "expert_parallel"}


@pytest.fixture(scope="module")
def qwen3_moe():
    return tiny_moe_model("qwen3_moe")


def _problems(plan: dict, model) -> str:
    with pytest.raises(ValueError) as info:
        rewrite.resolve(plan, model)
    return str(info.value)


def test_ep_in_the_mesh():
    plan = rewrite.load_plan({"mesh": {"dp": 4, "ep": 2}, "tensor_parallel": RULE})
    assert plan.mesh.ep == 2 and plan.mesh.world_size == 4  # ep adds no ranks
    assert "ep: 2" in plan.to_yaml()
    assert "ep:" not in rewrite.load_plan({"mesh": {"dp": 2}}).to_yaml()  # plans without ep read as before
    with pytest.raises(ValueError, match=r"mesh.ep=3 does not divide mesh.dp x mesh.tp = 4 x 1 = 4: .* use ep 2, 4 or 1"):
        rewrite.load_plan({"mesh": {"dp": 4, "ep": 3}})
    with pytest.raises(ValueError, match=r"mesh.ep=2 does not divide mesh.dp x mesh.tp = 1 x 1 = 1: .* use ep 1"):
        rewrite.load_plan({"mesh": {"ep": 2}})
    with pytest.raises(ValueError, match=r"mesh.ep=4 does not divide mesh.dp x mesh.tp = 1 x 2 = 2: .* use ep 2 or 1"):
        rewrite.load_plan({"mesh": {"tp": 2, "ep": 4}})
    assert rewrite.load_plan({"mesh": {"tp": 2, "ep": 2}}).mesh.world_size == 2  # ep borrows tp ranks
    assert rewrite.load_plan({"mesh": {"tp": 2, "dp": 3, "ep": 6}}).mesh.world_size == 6
    for bad in (0, "2", 1.5):
        with pytest.raises(ValueError, match="ep"):
            rewrite.load_plan({"mesh": {"dp": 2, "ep": bad}})


def test_expert_groups_are_neighbouring_ranks_of_a_stage_tp_first():
    # dp 4 x pp 2 x tp 1, ep 2: global rank = dp_rank * 2 + pp_rank.
    groups, replicas = expert_groups(Shape(dp=4, pp=2, ep=2))
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]  # dp ranks (0, 1) and (2, 3) at each pp rank
    assert replicas == [[0, 4], [2, 6], [1, 5], [3, 7]]  # the same experts: dp ranks 0 and 2, 1 and 3
    groups, replicas = expert_groups(Shape(dp=2, cp=2, tp=2, ep=2))  # a replica's tp pair at each cp rank
    assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]] and replicas == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sorted(r for g in groups for r in g) == list(range(8))
    groups, replicas = expert_groups(Shape(dp=2, pp=2, tp=2, ep=4))  # both replicas' tp pairs a stage
    assert groups == [[0, 1, 4, 5], [2, 3, 6, 7]] and replicas == [[0], [1], [4], [5], [2], [3], [6], [7]]
    groups, replicas = expert_groups(Shape(tp=4, ep=2))  # halves of the tp group, each a copy
    assert groups == [[0, 1], [2, 3]] and replicas == [[0, 2], [1, 3]]
    groups, _ = expert_groups(Shape(dp=3, tp=2, ep=3))  # a group may take part of a replica's tp ranks
    assert groups == [[0, 1, 2], [3, 4, 5]]


def test_what_can_be_split_by_expert():
    for family, holder in [("qwen3_moe", "mlp"), ("mixtral", "mlp"), ("olmoe", "mlp"), ("qwen2_moe", "mlp"),
                           ("deepseek_v3", "mlp"), ("gpt_oss", "mlp")]:
        model = tiny_moe_model(family)
        assert experts_problem(model.get_submodule(f"model.layers.0.{holder}.experts")) is None, family
    llama4 = tiny_moe_model("llama4_text")  # every token through every expert: declared by class, split alike
    experts = llama4.get_submodule("model.layers.0.feed_forward.experts")
    assert experts_problem(experts) is None and every_token(experts)
    jetmoe = tiny_moe_model("jetmoe")  # its attention's experts take the layer input alone: not declared
    assert "called as forward(layer_input), not as forward(hidden_states, top_k_index, top_k_weights)" in (
        experts_problem(jetmoe.get_submodule("model.layers.0.self_attention.experts")))
    mlp = tiny_family_model("llama").get_submodule("model.layers.0.mlp")
    assert "no num_experts" in experts_problem(mlp)


def test_refusals_name_the_fix(qwen3_moe):
    assert "add 'model.layers.*.mlp.experts': expert_parallel" in _problems({"mesh": {"dp": 2, "ep": 2}}, qwen3_moe)
    llama = tiny_family_model("llama")
    assert "LlamaForCausalLM has no fused experts module to split; use ep 1" in _problems(
        {"mesh": {"dp": 2, "ep": 2}}, llama)
    text = _problems({"mesh": {"dp": 2}, "tensor_parallel": {"model.layers.*.mlp": "expert_parallel"}}, llama)
    assert "matches 'model.layers.*.mlp', a LlamaMLP with no num_experts: not a fused experts module" in text
    text = _problems({"mesh": {"dp": 8, "ep": 8}, "tensor_parallel": RULE}, qwen3_moe)
    assert "mesh.ep=8 does not divide the 4 experts of model.layers.*.mlp.experts; use ep 1, 2, 4" in text
    beside_tp = rewrite.resolve(rewrite.plan_from_hf(qwen3_moe, tp=2, ep=2), qwen3_moe)  # attention by tp, experts by ep
    assert beside_tp.experts[0].ep == 2 and "model.layers.0.self_attn.q_proj" in {s.fqn for s in beside_tp.shards}
    assert rewrite.resolve({"mesh": {"dp": 2}, "tensor_parallel": RULE}, qwen3_moe).experts  # ep 1: checked, kept


def test_a_rank_holds_its_experts_whole(qwen3_moe):
    experts = sum(p.numel() for n, p in qwen3_moe.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in qwen3_moe.parameters())
    at_ep2 = rewrite.resolve({"mesh": {"dp": 2, "ep": 2}, "tensor_parallel": RULE}, qwen3_moe)
    assert at_ep2.experts[0].local == 2 and at_ep2.stages[0].param_count == total - experts // 2
    dense = total - experts
    for dp, ep in [(2, 2), (4, 2), (4, 4)]:
        resolved = rewrite.resolve({"mesh": {"dp": dp, "ep": ep}, "tensor_parallel": RULE}, qwen3_moe)
        # FSDP2 shards the dense parameters over dp (padded dim 0), never the experts a rank holds.
        held = rank_footprints(resolved, qwen3_moe)[0].params
        assert experts // ep + dense // dp <= held <= experts // ep + dense // dp + 4 * 64 * 4, (dp, ep, held)


def test_plan_from_hf_reads_the_ep_plan(qwen3_moe):
    plan = rewrite.plan_from_hf(qwen3_moe.config, ep=2)
    assert plan.mesh.ep == 2 and plan.mesh.dp == 2
    assert plan.tensor_parallel["model.layers.*.mlp.experts"] == "expert_parallel"
    assert not [k for k in plan.tensor_parallel if ".experts." in k]  # the experts module's rule, none inside
    assert "model.layers.*.mlp.gate_proj" not in plan.tensor_parallel  # every layer sparse: its meta model says
    dense = rewrite.plan_from_hf(type(qwen3_moe.config)(**{**qwen3_moe.config.to_dict(), "mlp_only_layers": [0]}), ep=2)
    assert dense.tensor_parallel["model.layers.*.mlp.gate_proj"] == "column"  # a config with a dense layer keeps it
    fitted = rewrite.plan_from_hf(qwen3_moe, ep=2, dp=4)
    assert fitted.mesh.dp == 4 and "model.layers.*.mlp.gate_proj" not in fitted.tensor_parallel  # none here
    assert rewrite.resolve(fitted, qwen3_moe).experts[0].ep == 2


def test_show_says_who_holds_the_experts(qwen3_moe):
    from rewrite.run.show.report import format_plan

    resolved = rewrite.resolve({"mesh": {"dp": 4, "ep": 2}, "tensor_parallel": RULE}, qwen3_moe)
    text = " ".join(format_plan(resolved, model=qwen3_moe).split())
    assert "mesh: dp=4 x pp=1 x tp=1 (ep=2) = 4 ranks" in text
    assert ("expert parallel: ep=2: replicas [g * 2, (g + 1) * 2) split the experts of model.layers.0-3.mlp.experts "
            "(4 experts, 2 per rank), 2 groups") in text
    plain = " ".join(format_plan(rewrite.resolve({"mesh": {"dp": 4}, "tensor_parallel": RULE}, qwen3_moe),
                                 model=qwen3_moe).split())
    assert "expert parallel" not in plain and "(ep=" not in plain


def test_the_compute_estimate_counts_the_experts_a_token_runs_through():
    from rewrite.models.flops import layer_flop_parts, moe_width

    # hidden 64; 4 experts, 2 chosen, of width 32 (Mixtral's and OLMoE's are intermediate_size wide: 128).
    widths = {"qwen3_moe": (64, 4), "mixtral": (256, 4), "qwen2_moe": (96, 4), "deepseek_v3": (96, 4), "olmoe": (256, 4)}
    for family, want in widths.items():
        assert moe_width(tiny_moe_model(family).config) == want, family
    llama = tiny_family_model("llama").config
    assert moe_width(llama) is None
    assert layer_flop_parts(llama, seq_len=16)["mlp"] == 6 * 16 * 64 * 128
    assert layer_flop_parts(tiny_moe_model("qwen3_moe").config, seq_len=16)["mlp"] == 6 * 16 * 64 * 64 + 2 * 16 * 64 * 4


def test_identity_experts_are_split_in_blocks():
    # LongCat-Flash: 4 routed experts and 2 identity ones after them; gate_up_proj holds rows for all 6.
    longcat = tiny_moe_model("longcat_flash")
    experts = longcat.get_submodule("model.layers.0.mlp.experts")
    assert experts_problem(experts) is None and expert_block(experts) == 2
    rule = {"model.layers.*.mlp.experts": "expert_parallel"}
    spec = rewrite.resolve({"mesh": {"dp": 2, "ep": 2}, "tensor_parallel": rule}, longcat).experts[0]
    assert (spec.num_experts, spec.identity, spec.widened) == (4, 2, frozenset({"gate_up_proj"}))
    rows = torch.arange(6)
    assert [spec.split_of("gate_up_proj").take(rows, r).tolist() for r in (0, 1)] == [[0, 2, 4], [1, 3, 5]]
    assert [spec.split_of("down_proj").take(rows[:4], r).tolist() for r in (0, 1)] == [[0, 2], [1, 3]]
    assert spec.slots == (0, 2, 1, 3)  # expert 1 is rank 1's first, expert 2 rank 0's second
    text = _problems({"mesh": {"dp": 4, "ep": 4}, "tensor_parallel": rule}, longcat)
    assert ("mesh.ep=4 does not divide both the 4 routed and the 2 identity experts (each rank holds as many of "
            "each) of model.layers.*.mlp.experts; use ep 1, 2") in text
    wide = rewrite.resolve({"mesh": {"dp": 2, "ep": 2}, "tensor_parallel": rule},
                           tiny_moe_model("longcat_flash", zero_expert_num=4)).experts[0]
    assert wide.block == 4 and wide.slots == (0, 1, 2, 3)  # as many of each: contiguous halves
