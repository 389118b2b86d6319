"""LoRA in the estimates: what a layer keeps against autograd's saved tensors, gradients and AdamW state for the
adapters only, no weight gradients for frozen layers in the step time, `show`'s line and the planner's search."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

import rewrite
from rewrite.estimate.activations import plan_sizes
from rewrite.estimate.layer_activations import layer_bytes
from rewrite.lora import apply_lora
from rewrite.run.show.data import show_data
from rewrite.run.show.report import render_text
from tests.paths import ROOT
from tests.saved_bytes import saved_bytes

SEQ = 64


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=8))


def _kept(plan: dict) -> tuple[int, int]:
    """(measured, estimated) bytes one decoder layer keeps for its backward, 2 sequences of SEQ tokens."""
    model = tiny()
    resolved = rewrite.resolve({"pipeline": {"seq_len": SEQ}, **plan}, model)
    apply_lora(model, resolved)
    model.train()
    x = torch.randn(2, SEQ, 64, requires_grad=True)
    position = model.model.rotary_emb(x, torch.arange(SEQ)[None].expand(2, -1))
    layer = model.model.layers[0]
    measured = saved_bytes(lambda: layer(x, position_embeddings=position, attention_mask=None),
                           [*model.parameters(), *position])
    return measured, layer_bytes(plan_sizes(resolved, model, batch_size=2))[0]


def test_a_lora_layer_keeps_what_the_estimate_says():
    full_measured, full_estimated = _kept({})
    lora_measured, lora_estimated = _kept({"lora": {"rank": 8}})
    dropped_measured, dropped_estimated = _kept({"lora": {"rank": 8, "dropout": 0.1}})
    assert lora_measured < full_measured  # frozen norms keep no normalised values for a weight gradient
    # The same slack as the full layer's estimate (one [tokens, hidden] tensor), and no more.
    assert lora_estimated - lora_measured == full_estimated - full_measured, (lora_estimated, lora_measured)
    assert dropped_estimated == dropped_measured  # each adapter's dropped copy and mask, the freed inputs
    assert abs(lora_estimated / lora_measured - 1) < 0.1


def test_only_the_adapters_have_gradients_and_adamw_state():
    model = tiny()
    base = rewrite.plan_from_hf(model, tp=2).model_dump(mode="json", exclude_none=True)
    for dp, sharding in [(1, "full"), (2, "full"), (2, "replicate")]:
        plan = {**base, "mesh": {"dp": dp, "tp": 2}, "data_parallel": {"sharding": sharding}}
        full = rewrite.rank_memory(rewrite.resolve(plan, model), model)[0]
        lora = rewrite.resolve({**plan, "lora": {"rank": 8}}, model)
        memory = rewrite.rank_memory(lora, model)[0]
        held = [p for s in lora.stages for p in s.held if p.trained]
        assert {p.name.rpartition(".")[2] for p in held} == {"lora_A", "lora_B"} and len(held) == 2 * 7 * 2
        trained = sum(p.nbytes for p in held) // (dp if sharding == "full" else 1)
        assert memory.grads == trained and memory.adamw == 2 * trained, (dp, sharding, memory)
        assert memory.weights >= full.weights and memory.total < full.total, (dp, sharding)


def test_the_step_time_computes_no_weight_gradient_for_frozen_layers():
    config = AutoConfig.from_pretrained(ROOT / "tests/configs/llama-3.1-8b.json")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plan = {"mesh": {"tp": 8}, "pipeline": {"seq_len": 4096}, **{
        k: v for k, v in rewrite.plan_from_hf(model, tp=8).model_dump(mode="json").items() if k == "tensor_parallel"}}
    full = rewrite.predict_step(rewrite.resolve(plan, model), model, "h100-sxm")
    lora = rewrite.predict_step(rewrite.resolve({**plan, "lora": {"rank": 16}}, model), model, "h100-sxm")
    # F + I + W = 3 products in full training, F + I + the adapters' few under LoRA: about 2/3 the step.
    assert 0.6 < lora.step_s / full.step_s < 0.75, (lora.step_s, full.step_s)
    assert lora.optimizer_s < full.optimizer_s / 50


def test_show_says_what_is_trained(tmp_path):
    model = tiny()
    plan = {**rewrite.plan_from_hf(model, tp=2).model_dump(mode="json", exclude_none=True), "lora": {"rank": 8}}
    data = show_data(rewrite.resolve(plan, model), model)
    adapted = [m for n, m in model.named_modules() if n.endswith("_proj")]
    assert data["lora"] == {"rank": 8, "scaling": 1.0, "dropout": 0.0, "layers": 14, "targets": data["lora"]["targets"],
                            "params": sum(8 * (m.in_features + m.out_features) for m in adapted)}
    assert len(adapted) == 14 and data["lora"]["targets"][0] == "model.layers.0-1.self_attn.q_proj"
    assert json.loads(json.dumps(data))["lora"] == data["lora"]
    assert "LoRA: adapters of rank 8 (scale 1) on 14 linear layers" in render_text(data)
    assert show_data(rewrite.resolve({}, model), model)["lora"] is None


def test_the_planner_finds_a_lora_plan_where_full_training_fits_nowhere():
    config = AutoConfig.from_pretrained(ROOT / "tests/configs/llama-3.1-70b.json")
    with pytest.raises(rewrite.NoPlanFits):
        rewrite.suggest_plans(config, world=8, device_memory=80, seq_len=4096, global_batch=16)
    best = rewrite.suggest_plans(config, world=8, device_memory=80, seq_len=4096, global_batch=16,
                                 lora={"rank": 16})[0]
    assert best.plan.lora.rank == 16 and best.peak_bytes < 73.1 * 2**30, best.summary()
    again = copy.deepcopy(best.plan.model_dump(mode="json", exclude_none=True))
    assert rewrite.load_plan(again).lora == best.plan.lora
