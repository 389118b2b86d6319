"""The shipped plans against real model configs (meta models): sizes, which plans bind, and how fast."""

from __future__ import annotations

import contextlib
import functools
import io
import time

import pytest

from rewrite.binding.resolve import resolve
from rewrite.plan.schema import PlanError
from rewrite.run.cli import main
from rewrite.run.presets import build_model, load_config
from tests.paths import PLANS, ROOT

CONFIGS = ROOT / "tests" / "configs"

# Parameters of each model, tied embeddings counted once (as the published checkpoints report them).
PARAMS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "smollm2-135m": 134_515_008,
    "qwen2.5-0.5b": 494_032_768,
    "mistral-7b": 7_241_732_096,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
}

# Plans a config cannot take: tp must divide the attention heads, and either divide the key-value
# heads or be a multiple of them (each kv head then held whole by tp / kv ranks).
#   smollm2-135m: 9 heads, 3 kv heads: tp 1, 3 or 9; neither tp 2 nor tp 4.
#   qwen2.5-0.5b: 14 heads, 2 kv heads: tp 1, 2 or 14; not tp 4.
TP2 = {"llama-tp2", "llama-tp2-sp", "llama-tp2-pp2", "llama-dp2-tp2", "llama-dp2-tp2-pp2", "llama-cp2-tp2"}
REFUSED = {
    "llama-3.1-8b": set(),
    "llama-3.2-1b": set(),
    "smollm2-135m": TP2 | {"llama-tp4"},
    "qwen2.5-0.5b": {"llama-tp4"},
    "mistral-7b": set(),
    "llama-3.1-70b": set(),  # 64 heads, 8 kv heads
    "qwen2.5-7b": set(),  # 28 heads, 4 kv heads
}

# The smallest tp past each config's kv heads, and the ranks then holding each kv head (tp / kv).
REPLICATED = {
    "llama-3.1-8b": (16, 2),
    "llama-3.2-1b": (16, 2),
    "smollm2-135m": (9, 3),
    "qwen2.5-0.5b": (14, 7),
    "mistral-7b": (16, 2),
    "llama-3.1-70b": (16, 2),
    "qwen2.5-7b": (28, 7),  # 18944 intermediate features: the MLP cannot split 28 ways, the attention can
}
ATTENTION = {f"model.layers.*.self_attn.{p}": "column" for p in ("q_proj", "k_proj", "v_proj")}
ATTENTION["model.layers.*.self_attn.o_proj"] = "row"
# A tp splitting heads either way: the refusal names the tps dividing both head counts, then those past the kv heads.
REFUSED_TP = {
    ("smollm2-135m", 2): ("tp 1 or 3", "(tp 9)"),
    ("qwen2.5-0.5b", 4): ("tp 1 or 2", "(tp 14)"),
    ("qwen2.5-7b", 8): ("tp 1, 2 or 4", "(tp 28)"),
}

SHIPPED = sorted(p.stem for p in PLANS.glob("*.yaml"))
MOE_PLANS = {p for p in SHIPPED if "-ep" in p}  # they split experts: a dense model has none
MOE_PLAN = "qwen3-moe-dp2-ep2-tp2-pp2"
QWEN3_30B_A3B = 30_532_122_624  # tests/configs/moe/qwen3-30b-a3b.json: 48 layers of 128 experts, untied head
# Loose: resolving and formatting one plan takes well under 2 s of CPU on a meta model (CPU time, so
# other work on the machine does not count).
SECONDS = 4.0


@functools.cache
def meta_model(name: str):
    return build_model(load_config(CONFIGS / f"{name}.json"), device="meta")


def test_every_config_is_listed():
    assert sorted(p.stem for p in CONFIGS.glob("*.json")) == sorted(PARAMS) == sorted(REFUSED) == sorted(REPLICATED)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_meta_model_has_the_published_parameter_count(name):
    model = meta_model(name)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]
    assert resolve({}, model).total_params == PARAMS[name]


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("plan", SHIPPED)
def test_each_shipped_plan_binds_or_is_refused(name, plan):
    model = meta_model(name)
    if plan in MOE_PLANS:
        with pytest.raises(PlanError, match="has no fused experts module to split; use ep 1"):
            resolve(PLANS / f"{plan}.yaml", model)
        return
    if plan in REFUSED[name]:
        with pytest.raises(PlanError) as info:
            resolve(PLANS / f"{plan}.yaml", model)
        assert isinstance(info.value, ValueError)
        assert "does not divide" in str(info.value) and "heads" in str(info.value)
        return
    resolved = resolve(PLANS / f"{plan}.yaml", model)
    layers = [layer for stage in resolved.stages for layer in stage.layers]
    assert layers == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert len(resolved.stages) == resolved.pp * resolved.plan.pipeline.virtual_stages


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_resolving_and_showing_is_quick(name):
    from rewrite.run.show.report import format_plan

    model = meta_model(name)
    timings = {}
    for plan in SHIPPED:
        if plan in REFUSED[name] or plan in MOE_PLANS:
            continue
        start = time.process_time()
        resolved = resolve(PLANS / f"{plan}.yaml", model)
        text = format_plan(resolved, model=model)
        timings[plan] = time.process_time() - start
        assert text
    slow = {plan: round(s, 2) for plan, s in timings.items() if s >= SECONDS}
    assert not slow, f"{name}: resolve + format_plan took {slow} s (bound {SECONDS} s)"


def test_the_moe_plan_on_qwen3_30b_a3b():
    from rewrite.run.show.report import format_plan

    model = build_model(load_config(CONFIGS / "moe" / "qwen3-30b-a3b.json"), device="meta")
    assert sum(p.numel() for p in model.parameters()) == QWEN3_30B_A3B
    start = time.process_time()
    resolved = resolve(PLANS / f"{MOE_PLAN}.yaml", model)
    assert "dp=2 x pp=2 x tp=2 (ep=2) = 8 ranks" in format_plan(resolved, model=model)
    assert time.process_time() - start < SECONDS
    assert (resolved.pp, resolved.tp, resolved.plan.mesh.ep, resolved.total_params) == (2, 2, 2, QWEN3_30B_A3B)
    assert [s.fqn for s in resolved.experts] == [f"model.layers.{i}.mlp.experts" for i in range(48)]
    assert [layer for stage in resolved.stages for layer in stage.layers] == [f"model.layers.{i}" for i in range(48)]
    # A rank of stage 0 holds the embedding, half of each attention projection (tp 2), 64 of each layer's 128
    # experts (ep 2) and the router and norms whole, before dp shards the dense part.
    h, heads, kv, d, experts, width = 2048, 32, 4, 128, 128, 768
    attention = (2 * h * heads * d + 2 * h * kv * d) // 2 + 2 * d
    layer = attention + h * experts + experts // 2 * 3 * h * width + 2 * h
    first = resolved.stages[0]
    assert first.param_count == 151936 * h + len(first.layers) * layer
    # The dense plans' MLP rules name modules a mixture of experts does not have.
    with pytest.raises(PlanError, match=r"'model.layers.\*.mlp.gate_proj'\] matches no module"):
        resolve(PLANS / "llama-tp2.yaml", model)


@pytest.mark.parametrize("name", sorted(REPLICATED))
def test_tp_past_the_kv_heads_holds_each_whole_on_tp_over_kv_ranks(name):
    model, (tp, replicas) = meta_model(name), REPLICATED[name]
    resolved = resolve({"mesh": {"tp": tp}, "tensor_parallel": ATTENTION}, model)
    attn, config = model.get_submodule("model.layers.0.self_attn"), model.config
    d, h, layers = attn.head_dim, config.hidden_size, config.num_hidden_layers
    assert resolved.kv_replicas == replicas == tp // config.num_key_value_heads
    kv_bias = attn.k_proj.bias is not None
    for s in resolved.shards:
        if s.fqn.endswith(("k_proj", "v_proj")):  # one whole head a rank
            assert (s.replicas, s.weight_shape, s.bias_shape) == (replicas, (d, h), (d,) if kv_bias else None), s.fqn
    # A rank holds 1/tp of q_proj and o_proj and one kv head's k_proj and v_proj; the rest whole.
    whole = sum(p.numel() for p in attn.parameters())
    q_o = sum(p.numel() for p in (*attn.q_proj.parameters(), *attn.o_proj.parameters()))
    per_rank = q_o // tp + 2 * d * (h + kv_bias)
    assert resolved.stages[0].param_count == PARAMS[name] - layers * (whole - per_rank)
    assert resolved.total_params == PARAMS[name]


@pytest.mark.parametrize(("name", "tp"), sorted(REFUSED_TP))
def test_a_tp_splitting_a_head_names_the_tps_that_work(name, tp):
    with pytest.raises(PlanError) as info:
        resolve({"mesh": {"tp": tp}, "tensor_parallel": ATTENTION}, meta_model(name))
    plain, past = REFUSED_TP[name, tp]
    assert f"mesh.tp={tp} does not divide num_attention_heads=" in str(info.value)
    assert f"kv heads ({plain})" in str(info.value) and "replicated on tp / " in str(info.value)
    assert f"ranks {past}; set mesh.tp to one of these" in str(info.value)


def test_validate_names_the_replication(tmp_path):
    # The shipped tp-4 plan at tp 16 on Llama-3.1-70B (8 kv heads): OK, each kv head on 2 ranks.
    plan = tmp_path / "llama-tp16.yaml"
    plan.write_text((PLANS / "llama-tp4.yaml").read_text().replace("mesh: {pp: 1, tp: 4}", "mesh: {pp: 1, tp: 16}"))
    config = str(CONFIGS / "llama-3.1-70b.json")
    resolved = resolve(plan, meta_model("llama-3.1-70b"))
    k_proj = next(s for s in resolved.shards if s.fqn == "model.layers.0.self_attn.k_proj")
    assert resolved.kv_replicas == 2 and k_proj.weight_shape == (128, 8192)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["validate", str(plan), "--model", config]) == 0
    assert out.getvalue() == (
        f"{plan}: OK for LlamaForCausalLM ({config}): pp=1 x tp=16 = 16 ranks, 560 sharded modules "
        "(kv heads replicated 2x: each of the 8 on 2 tp ranks), 1 stage\n"
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["validate", str(PLANS / "llama-tp4.yaml"), "--model", config]) == 0
    assert "replicated" not in out.getvalue() and "560 sharded modules, 1 stage" in out.getvalue()
