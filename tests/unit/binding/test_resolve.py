"""Binding plans to models: expansion, per-rank shapes, stages, and every mistake's message."""

from __future__ import annotations

import pytest
from torch import nn

import rewrite
from rewrite import resolve
from rewrite.run.presets import build_config, build_model
from tests.paths import PLANS

TP_RULES = rewrite.load_plan(PLANS / "llama-tp2.yaml").tensor_parallel


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", device="meta")


def problems(plan, model, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        resolve(plan, model, **kwargs)
    return str(info.value)


SHIPPED = [
    "llama-tp2", "llama-tp4", "llama-pp2", "llama-tp2-pp2", "llama-pp2-zbv",
    "llama-fsdp4", "llama-dp2-tp2", "llama-dp2-tp2-pp2",
]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_shipped_plans_resolve(name, preset):
    model = build_model(preset, device="meta")
    plan = rewrite.load_plan(PLANS / f"{name}.yaml")
    resolved = resolve(plan, model, world_size=plan.mesh.world_size)
    # Stages come from pp alone: each data-parallel replica runs the same pp x virtual_stages stages.
    assert resolved.kind == "hf" and len(resolved.stages) == plan.mesh.pp * plan.pipeline.virtual_stages
    layers = [l for s in resolved.stages for l in s.layers]
    assert layers == [f"model.layers.{i}" for i in range(4)]
    assert resolved.stages[0].modules[0] == "model.embed_tokens"
    assert resolved.stages[-1].modules[-2:] == ("model.norm", "lm_head")
    linears = [s for s in resolved.shards if s.style != "grad_allreduce"]
    assert len(linears) == (28 if plan.tensor_parallel else 0)


def test_per_rank_shapes_and_memory(llama):
    resolved = resolve(PLANS / "llama-tp2-pp2.yaml", llama)
    by_fqn = {s.fqn: s for s in resolved.shards}
    q = by_fqn["model.layers.0.self_attn.q_proj"]
    assert (q.style, q.in_features, q.out_features, q.weight_shape) == ("column", 64, 64, (32, 64))
    down = by_fqn["model.layers.3.mlp.down_proj"]
    assert (down.style, down.weight_shape, down.bias_shape) == ("row", (64, 64), None)
    assert resolved.cut_points == ("model.layers.2",)
    assert resolved.stages[1].modules == ("model.rotary_emb", "model.layers.2", "model.layers.3", "model.norm", "lm_head")
    # Per rank: its layers' linears halved, norms whole, embeddings or head whole.
    linears = 64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128
    layer = linears // 2 + 2 * 64
    embed = 256 * 64
    assert [s.param_count for s in resolved.stages] == [2 * layer + embed, 2 * layer + 64 + embed]
    assert resolved.stages[0].param_bytes == 4 * resolved.stages[0].param_count
    assert resolved.total_params == 4 * (linears + 2 * 64) + 2 * embed + 64
    biased = build_model(build_config("tiny-llama", attention_bias=True), device="meta")
    k = {s.fqn: s for s in resolve(PLANS / "llama-tp4.yaml", biased).shards}["model.layers.0.self_attn.k_proj"]
    o = {s.fqn: s for s in resolve(PLANS / "llama-tp4.yaml", biased).shards}["model.layers.0.self_attn.o_proj"]
    assert (k.weight_shape, k.bias_shape, o.weight_shape, o.bias_shape) == ((8, 64), (8,), (64, 16), (64,))


def test_balanced_split_puts_the_remainder_first():
    assert rewrite.resolve.__module__  # the function, not the module
    from rewrite.binding.cuts import balanced_split

    assert balanced_split(4, 3) == [2, 1, 1]
    assert balanced_split(8, 3) == [3, 3, 2]
    assert balanced_split(4, 4) == [1, 1, 1, 1]


def test_pattern_mistakes(llama):
    message = problems({"mesh": {"tp": 2}, "tensor_parallel": {
        "model.layers.*.mlp.up_projj": "column",
        "model.layers.*.mlp": "column",
        "model.layers.0.self_attn.q_proj": "row",
    } | {k: v for k, v in TP_RULES.items() if "mlp" not in k}}, llama)
    assert "tensor_parallel['model.layers.*.mlp.up_projj'] matches no module; did you mean 'model.layers.*.mlp.up_proj'?" in message
    assert "tensor_parallel['model.layers.*.mlp'] matches 'model.layers.*.mlp', a LlamaMLP, not an nn.Linear" in message
    assert "its linears: gate_proj, up_proj, down_proj" in message
    assert ("'model.layers.0.self_attn.q_proj' is matched by tensor_parallel['model.layers.0.self_attn.q_proj'] "
            "as 'row' and by tensor_parallel['model.layers.*.self_attn.q_proj'] as 'column'") in message


def test_divisibility_and_heads():
    config = build_config("tiny-llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                          intermediate_size=90)
    model = build_model(config, device="meta")
    message = problems({"mesh": {"tp": 4}, "tensor_parallel": TP_RULES}, model)
    # The MLP's 90 splits 1, 2, 3, 5, 6 ... ways, the heads only 1, 2 or 6: every line names what fits both.
    assert ("model.layers.*.mlp.gate_proj (column): out_features=90 (intermediate_size) is not divisible by mesh.tp=4; "
            "use tp 1, 2 or 6 (the sizes at which every module the plan shards splits evenly, heads whole), or leave "
            "gate_proj whole [* = 0-3]") in message
    assert "model.layers.*.mlp.down_proj (row): in_features=90 (intermediate_size) is not divisible by mesh.tp=4" in message
    assert message.startswith("plan: 4 problems"), "one line per rule, not one per layer"
    assert ("mesh.tp=4 does not divide num_attention_heads=6 (q_proj, k_proj, v_proj, o_proj would split a head); tp "
            "must divide the 6 attention heads and either divide the 2 kv heads (tp 1 or 2) or be a multiple of them, "
            "each kv head then replicated on tp / 2 ranks (tp 6)") in message
    assert message.count("num_attention_heads=6") == 1, "a config problem is reported once, not per layer"


def test_incomplete_blocks_and_tied_head(llama):
    rules = {k: v for k, v in TP_RULES.items() if "o_proj" not in k}
    message = problems({"mesh": {"tp": 2}, "tensor_parallel": rules}, llama)
    assert ("model.layers.*.self_attn: q_proj=column, k_proj=column, v_proj=column, o_proj=unsharded; "
            "shard q_proj, k_proj, v_proj as column and o_proj as row together") in message
    assert message.rstrip().endswith("[* = 0-3]")
    tied = build_model(build_config("tiny-llama", tie_word_embeddings=True), device="meta")
    message = problems({"mesh": {"tp": 2}, "tensor_parallel": {"lm_head": "column_gather"}}, tied)
    assert ("lm_head.weight is tied to model.embed_tokens.weight (lm_head=column_gather, "
            "model.embed_tokens=unsharded); sharding one end alone would untie them") in message


def test_pipeline_mistakes(llama):
    message = problems({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["model.layers.9"]}}, llama)
    assert ("pipeline.cut_points[0] 'model.layers.9' is not a layer of the model's layer sequence "
            "(model.layers.0 .. model.layers.3)") in message
    message = problems({"mesh": {"pp": 3}, "pipeline": {"cut_points": ["model.layers.3", "model.layers.1"]}}, llama)
    assert "are out of order; list them as the layers run: ['model.layers.1', 'model.layers.3']" in message
    message = problems({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["model.layers.0"]}}, llama)
    assert "leaves stage 0 without a layer" in message
    assert "mesh.pp=5 stages but the model has 4 layers" in problems({"mesh": {"pp": 5}}, llama)


def test_world_size_and_all_problems_at_once(llama):
    message = problems({"mesh": {"pp": 2, "tp": 2}, "tensor_parallel": {"model.layers.*.mlp.nope": "row"},
                        "pipeline": {"cut_points": ["model.norm"]}}, llama, world_size=2)
    assert message.startswith("plan: 3 problems")
    assert "mesh: pp=2 x tp=2 = 4 ranks, but the world size is 2" in message
    assert "matches no module" in message and "'model.norm' is not a layer" in message


def test_file_name_in_messages(tmp_path, llama):
    path = tmp_path / "typo.yaml"
    path.write_text('mesh: {tp: 2}\ntensor_parallel:\n  "model.layers.*.mlp.up_projj": column\n')
    assert problems(path, llama).startswith(f"{path}: 1 problem")


def test_binding_never_changes_the_model():
    model = build_model("tiny-llama")
    before = {n: (type(m), id(m)) for n, m in model.named_modules()}
    resolve(PLANS / "llama-tp2-pp2.yaml", model)
    with pytest.raises(ValueError):
        resolve({"mesh": {"tp": 3}, "tensor_parallel": TP_RULES}, model)
    assert {n: (type(m), id(m)) for n, m in model.named_modules()} == before


def test_tp1_rules_are_checked_but_change_nothing(llama):
    resolved = resolve({"tensor_parallel": TP_RULES}, llama)
    assert len(resolved.shards) == 28 and resolved.shards[0].weight_shape == (64, 64)
    assert "matches no module" in problems({"tensor_parallel": {"model.nope": "row"}}, llama)


def test_qwen3_per_head_norms_are_implied():
    model = build_model("tiny-qwen3", device="meta")
    implied = [s for s in resolve(PLANS / "llama-tp2.yaml", model).shards if s.pattern == "(implied)"]
    assert {s.fqn.rsplit(".", 1)[1] for s in implied} == {"q_norm", "k_norm"} and len(implied) == 8
    assert all(s.style == "grad_allreduce" and s.weight_shape == (8,) for s in implied)


def test_plan_from_hf():
    plan = rewrite.plan_from_hf(build_config("tiny-qwen3"), tp=2, pp=2, microbatches=4)
    assert plan.tensor_parallel["model.layers.*.self_attn.q_norm"] == "grad_allreduce"
    assert plan.tensor_parallel["lm_head"] == "column_gather"
    assert (plan.mesh.tp, plan.mesh.pp, plan.pipeline.microbatches) == (2, 2, 4)
    model = build_model("tiny-llama", device="meta")
    assert len(resolve(rewrite.plan_from_hf(model, tp=2), model).shards) == 29
    tied = build_config("tiny-llama", tie_word_embeddings=True)
    assert "lm_head" not in rewrite.plan_from_hf(tied, tp=2).tensor_parallel
    assert "layers.*.mlp.up_proj" in rewrite.plan_from_hf(model.model, tp=2).tensor_parallel
    zbv = rewrite.plan_from_hf(model, pp=2, schedule="zbv", virtual_stages=2, cut_points="auto")
    assert len(resolve(zbv, model).stages) == 4 and zbv.pipeline.cut_points == "auto"
    with pytest.raises(rewrite.PlanError, match="'zbv' needs virtual_stages: 2, exactly"):
        rewrite.plan_from_hf(model, pp=2, schedule="zbv")


def test_already_rewritten_model_is_refused():
    model = nn.Sequential(rewrite.ColumnParallelLinear(4, 4, False, None))
    assert "already rewritten" in problems({}, model)
