"""Refusals name what would work: the sizes that fit, the line of the rule, the known schedules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from rewrite.plan.files import PlanError
from rewrite.binding.resolve import resolve
from rewrite.plan.loading import load_plan, load_plan_for
from rewrite.plan.wording import common_divisors, index_ranges
from rewrite.plan.wording import collapse_repeats
from rewrite.run.presets import build_model, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ATTENTION = {
    "model.layers.*.self_attn.q_proj": "column",
    "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
}
MLP = {
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
}


@pytest.fixture(scope="module")
def smollm():
    return build_model(load_config(CONFIGS / "smollm2-135m.json"), device="meta")  # 9 heads, 3 kv heads, 30 layers


@pytest.fixture(scope="module")
def qwen():
    return build_model(load_config(CONFIGS / "qwen2.5-0.5b.json"), device="meta")  # 14 heads, 2 kv heads, 24 layers


def refusal(plan, model, **kwargs) -> str:
    with pytest.raises(PlanError) as info:
        resolve(plan, model, **kwargs)
    return str(info.value)


def test_tp_names_the_sizes_that_divide_both_head_counts(smollm, qwen):
    message = refusal({"mesh": {"tp": 2}, "tensor_parallel": ATTENTION}, smollm)
    assert message.startswith("plan: 1 problem"), "one message for query and kv heads"
    assert "mesh.tp=2 does not divide num_attention_heads=9 nor num_key_value_heads=3" in message
    assert ("tp must divide the 9 attention heads and either divide the 3 kv heads (tp 1 or 3) or be a multiple of "
            "them, each kv head then replicated on tp / 3 ranks (tp 9); set mesh.tp to one of these") in message
    message = refusal({"mesh": {"tp": 4}, "tensor_parallel": ATTENTION}, qwen)
    assert "mesh.tp=4 does not divide num_attention_heads=14 (q_proj" in message, "tp 4 passes the 2 kv heads evenly"
    assert "either divide the 2 kv heads (tp 1 or 2) or be a multiple of them" in message
    assert "(tp 14)" in message
    message = refusal({"mesh": {"tp": 9}, "tensor_parallel": {**ATTENTION, "model.layers.*.self_attn.o_proj": "column"}},
                      smollm)
    assert "replicated" not in message, "a layout problem is not a head-count problem"
    for tp in (3, 9):  # the sizes it named work: 9 holds each of the 3 kv heads on 3 ranks
        resolved = resolve({"mesh": {"tp": tp}, "tensor_parallel": ATTENTION}, smollm)
        assert resolved.kv_replicas == tp // 3


def test_tp_names_the_sizes_that_divide_a_split_dimension(smollm):
    message = refusal({"mesh": {"tp": 5}, "tensor_parallel": {**MLP, "model.embed_tokens": "vocab"}}, smollm)
    fits = "use tp 1, 2, 3, 4, 6, 8, 12 or 16 (the sizes at which every module the plan shards splits evenly, heads whole)"
    assert ("model.layers.*.mlp.gate_proj (column): out_features=1536 (intermediate_size) is not divisible by "
            f"mesh.tp=5; {fits}, or leave gate_proj whole [* = 0-29]") in message
    assert f"down_proj (row): in_features=1536 (intermediate_size) is not divisible by mesh.tp=5; {fits}" in message
    assert f"model.embed_tokens (vocab): num_embeddings=49152 is not divisible by mesh.tp=5; {fits}, or leave the embedding whole" in message


def test_every_size_refusal_names_the_sizes_the_heads_line_names():
    # Llama-3.2-1B at tp 3: 32 heads, 8 kv heads; its 2048 / 512 / 8192 features would split up to 128 ways alone.
    model = build_model(load_config(CONFIGS / "llama-3.2-1b.json"), device="meta")
    message = refusal({"mesh": {"tp": 3}, "tensor_parallel": {**ATTENTION, **MLP}}, model)
    heads = next(line for line in message.splitlines() if "would split a head" in line)
    assert "(tp 1, 2, 4 or 8)" in heads and "(tp 16 or 32)" in heads
    sizes = [line for line in message.splitlines() if "is not divisible by mesh.tp=3" in line]
    assert len(sizes) == 7 and all("use tp 1, 2, 4, 8, 16 or 32 (" in line for line in sizes), sizes
    for tp in (16, 32):  # the sizes named bind
        assert resolve({"mesh": {"tp": tp}, "tensor_parallel": {**ATTENTION, **MLP}}, model).kv_replicas == tp // 8


def test_pp_names_the_pp_values_that_fit(smollm, qwen):
    message = refusal({"mesh": {"pp": 40}}, smollm)
    assert ("mesh.pp=40 stages but the model has 30 layers; each stage needs at least one layer: "
            "use pp 1-30 (an even split: pp 1, 2, 3, 5, 6, 10, 15 or 30)") in message
    message = refusal({"mesh": {"pp": 16}, "pipeline": {"schedule": "interleaved-1f1b", "virtual_stages": 2}}, qwen)
    assert ("mesh.pp=16 x pipeline.virtual_stages=2 = 32 stages but the model has 24 layers; each stage needs at least "
            "one layer: use pp 1-12 with virtual_stages 2 (an even split: pp 1, 2, 3, 4, 6 or 12), or lower "
            "pipeline.virtual_stages so that pp x virtual_stages <= 24") in message


def test_world_size_names_the_dp_that_fills_it(smollm):
    message = refusal({"mesh": {"tp": 3}, "tensor_parallel": ATTENTION}, smollm, world_size=6)
    assert "mesh: pp=1 x tp=3 = 3 ranks, but the world size is 6; launch 3 processes or set mesh.dp: 2" in message
    message = refusal({"mesh": {"tp": 3}, "tensor_parallel": ATTENTION}, smollm, world_size=4)
    assert "launch 3 processes or change the mesh: pp x tp must divide 4 (1, 2 or 4)" in message


def test_a_rule_found_wrong_while_binding_names_its_file_and_line(tmp_path, smollm):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "mesh:\n"
        "  tp: 2\n"
        "tensor_parallel:\n"
        "  model.layers.*.mlp.up_projj: column\n"
        "  model.embed_tokens: row\n"
        + "".join(f"  {k}: {v}\n" for k, v in ATTENTION.items())
    )
    message = refusal(path, smollm)
    assert message.startswith(f"{path}: ")
    assert ("line 4: tensor_parallel['model.layers.*.mlp.up_projj'] matches no module; "
            "did you mean 'model.layers.*.mlp.up_proj'?") in message
    assert "line 5: tensor_parallel['model.embed_tokens'] matches 'model.embed_tokens', an nn.Embedding" in message
    assert "line 2: mesh.tp=2 does not divide num_attention_heads=9" in message
    # A plan given as a dict has no file: the same messages, without lines.
    message = refusal({"tensor_parallel": {"model.layers.*.mlp.up_projj": "column"}}, smollm)
    assert "\n  tensor_parallel['model.layers.*.mlp.up_projj'] matches no module" in message and "line" not in message


def test_a_refused_plan_matches_its_rules_against_bare_parameters_too():
    # A rule may split a bare parameter (attention sinks), as binding accepts: a plan refused for another
    # reason names no such rule as matching nothing, and still names the rule that does match nothing.
    model = nn.Module()
    model.attn = nn.Linear(4, 4)
    model.attn.sinks = nn.Parameter(torch.zeros(4))
    with pytest.raises(PlanError) as refused:
        load_plan_for({"mesh": {"tp": 0}, "tensor_parallel": {"attn.sinks": "column", "attn.sink": "column"}}, model)
    message = str(refused.value)
    assert "mesh.tp" in message and "tensor_parallel['attn.sink'] matches no module" in message, message
    assert "tensor_parallel['attn.sinks'] matches no module" not in message, message


def test_a_json_plan_names_lines_too(tmp_path, smollm):
    path = tmp_path / "plan.json"
    path.write_text('{\n  "mesh": {"pp": 31},\n  "activation_checkpointing": {\n    "model.layer.*": "full"\n  }\n}\n')
    message = refusal(path, smollm)
    assert "line 2: mesh.pp=31 stages but the model has 30 layers" in message
    assert "line 4: activation_checkpointing['model.layer.*'] matches no module" in message


def test_layer_indices_sort_as_numbers_and_runs_read_as_ranges():
    problems = [f"model.layers.{i}.mlp: unsharded" for i in (0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9, 12, 20, 22)]
    assert collapse_repeats(problems) == ["model.layers.*.mlp: unsharded [* = 0-12, 20, 22]"]
    assert collapse_repeats(["model.layers.1.a: x", "model.layers.3.a: x"]) == ["model.layers.*.a: x [* = 1, 3]"]
    assert collapse_repeats(["same", "same"]) == ["same"]
    assert index_ranges([31, 0, 2, 1]) == "0-2, 31"
    assert common_divisors(9, 3) == [1, 3] and common_divisors(128256) == [1, 2, 3, 4, 6, 8, 12, 16]  # at most 8


@pytest.mark.parametrize(
    ("virtual_stages", "fits"),
    [
        (1, "with virtual_stages: 1 these fit: afab, 1f1b, zero-bubble or custom (interleaved-1f1b needs "
            "virtual_stages >= 2, zbv needs virtual_stages: 2)"),
        (2, "with virtual_stages: 2 these fit: interleaved-1f1b, zero-bubble, zbv or custom (afab needs "
            "virtual_stages: 1, 1f1b needs virtual_stages: 1)"),
    ],
)
def test_an_unknown_schedule_lists_the_known_ones_and_those_that_fit(virtual_stages, fits):
    with pytest.raises(PlanError) as info:
        load_plan({"mesh": {"pp": 2}, "pipeline": {"schedule": "zb-h2", "virtual_stages": virtual_stages}})
    message = str(info.value)
    assert ("pipeline.schedule: unknown schedule 'zb-h2': the schedules are afab, 1f1b, interleaved-1f1b, zero-bubble, "
            "zbv, and 'custom' with your own pipeline.table") in message
    assert fits in message
    assert message.rstrip().endswith("set pipeline.schedule to one of them (did you mean 'zero-bubble'?)")


def test_an_unknown_schedule_in_a_file_names_its_line(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("mesh: {pp: 2}\npipeline:\n  schedule: 1f1f\n")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert "line 3: pipeline.schedule: unknown schedule '1f1f'" in str(info.value)
    assert "(did you mean '1f1b'?)" in str(info.value)
