"""LoRA in one process: the plan section, which layers get adapters, the layer against PEFT's, the splits."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import rewrite
from rewrite import LoraLinear, PlanError, put_adapters
from rewrite.binding.shard_layout import TensorSplit, style_split
from rewrite.lora import apply_lora, from_peft_name, lora_delta, peft_name
from tests.families import tiny_moe_model
from tests.lora_oracle import peft_twin
from tests.models import ToyNet

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _plan(**lora) -> dict:
    return {"lora": {"rank": 4, **lora}}


def test_the_plan_section_checks_each_field():
    plan = rewrite.load_plan(_plan(alpha=16))
    assert (plan.lora.rank, plan.lora.scaling, plan.lora.dropout, plan.lora.targets, plan.lora.seed) == (4, 4.0, 0.0, None, 0)
    assert rewrite.load_plan(_plan()).lora.scaling == 1.0  # alpha defaults to the rank
    assert rewrite.load_plan(plan.to_yaml() and __import__("yaml").safe_load(plan.to_yaml())) == plan
    for bad, words in [({"rank": 0}, "rank"), ({"rank": 4, "alpha": 0}, "alpha"), ({"rank": 4, "dropout": 1.0}, "dropout"),
                       ({"rank": 4, "targets": []}, "targets"), ({"rank": 4, "target": ["x"]}, "target"),
                       ({"rank": 4, "targets": ["a..b"]}, "module-path pattern"), ({"rank": True}, "rank")]:
        with pytest.raises(PlanError, match=words):
            rewrite.load_plan({"lora": bad})


def test_default_targets_are_every_layers_projections():
    model = tiny()
    resolved = rewrite.resolve(_plan(), model)
    assert resolved.lora_targets == tuple(f"model.layers.{i}.{part}.{p}" for i in range(2) for part, p in
                                          [("self_attn", p) if p.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                                           else ("mlp", p) for p in PROJECTIONS])
    chosen = rewrite.resolve(_plan(targets=["model.layers.*.self_attn.q_proj", "model.layers.1.mlp.down_proj"]), model)
    assert chosen.lora_targets == ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
                                   "model.layers.1.mlp.down_proj")
    assert rewrite.resolve({}, model).lora_targets == ()


def test_bad_targets_are_refused_by_name():
    model = tiny()
    cases = [(["model.layers.*.self_attn.q_prj"], "matches no module; did you mean 'model.layers.*.self_attn.q_proj'"),
             (["model.layers.*.input_layernorm"], "LlamaRMSNorm: adapters go on nn.Linear layers only"),
             (["model.embed_tokens"], "Embedding")]
    for targets, words in cases:
        with pytest.raises(PlanError, match=words):
            rewrite.resolve(_plan(targets=targets), model)
    moe = tiny_moe_model("qwen3_moe")
    with pytest.raises(PlanError, match="inside a routed-experts module: adapters on routed experts are not built"):
        rewrite.resolve(_plan(targets=["model.layers.*.mlp.experts"]), moe)
    defaults = rewrite.resolve(_plan(), moe).lora_targets
    assert defaults and not any(".experts" in t for t in defaults), defaults  # attention (and dense MLPs) only
    with pytest.raises(PlanError, match="not a Hugging Face decoder, so there are no default targets"):
        rewrite.resolve(_plan(), ToyNet())
    assert rewrite.resolve(_plan(targets=["blocks.*.fc1"]), ToyNet()).lora_targets == tuple(
        f"blocks.{i}.fc1" for i in range(4))


def test_adapters_a_model_carries_must_be_the_plans():
    model = tiny()
    put_adapters(model, {"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 32),
                         "model.layers.0.self_attn.q_proj.lora_B": torch.zeros(32, 4)})
    with pytest.raises(PlanError, match="carries LoRA adapters .* but the plan has no lora section"):
        rewrite.resolve({}, model)
    with pytest.raises(PlanError, match="lora.rank=8, but the adapters the model carries have rank 4"):
        rewrite.resolve({"lora": {"rank": 8, "targets": ["model.layers.0.self_attn.q_proj"]}}, model)
    with pytest.raises(PlanError, match="carries adapters, but not on model.layers.0.self_attn.k_proj"):
        rewrite.resolve({"lora": {"rank": 4, "targets": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]}}, model)
    with pytest.raises(PlanError, match="carries adapters on model.layers.0.self_attn.q_proj, which lora.targets"):
        rewrite.resolve({"lora": {"rank": 4, "targets": ["model.layers.0.self_attn.k_proj"]}}, model)
    assert rewrite.resolve({"lora": {"rank": 4, "targets": ["model.layers.0.self_attn.q_proj"]}}, model).lora_targets


def test_put_adapters_refuses_what_does_not_fit():
    model = tiny()
    q = "model.layers.0.self_attn.q_proj"
    for tensors, words in [({"model.norm.weight": torch.ones(32)}, "not a LoRA adapter's tensor"),
                           ({f"{q}.lora_A": torch.zeros(4, 32)}, "has only lora_A"),
                           ({f"{q}.lora_A": torch.zeros(4, 31), f"{q}.lora_B": torch.zeros(32, 4)}, "do not fit"),
                           ({"model.layers.9.q.lora_A": torch.zeros(4, 32), "model.layers.9.q.lora_B": torch.zeros(32, 4)},
                            "has no module model.layers.9.q"),
                           ({"model.norm.lora_A": torch.zeros(4, 32), "model.norm.lora_B": torch.zeros(32, 4)},
                            "LlamaRMSNorm, not an nn.Linear")]:
        with pytest.raises(rewrite.InputError, match=words):
            put_adapters(model, tensors)
    assert peft_name(f"{q}.lora_A") == f"base_model.model.{q}.lora_A.weight"
    assert from_peft_name(peft_name(f"{q}.lora_B")) == f"{q}.lora_B" == from_peft_name(
        f"base_model.model.{q}.lora_B.default.weight")
    assert from_peft_name("base_model.model.model.norm.weight") is None


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_one_process_is_peft_bit_for_bit(dropout):
    """put_adapters + apply_lora's layers against PEFT's own: logits and every adapter gradient exactly equal."""
    model = tiny()
    twin = peft_twin(model, rank=4, alpha=8.0, dropout=dropout)
    resolved = rewrite.resolve({"lora": {"rank": 4, "alpha": 8.0, "dropout": dropout}}, model)
    assert apply_lora(model, resolved) == list(resolved.lora_targets)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        f"{t}.{f}" for t in resolved.lora_targets for f in ("lora_A", "lora_B")]
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    model.train(), twin.train()
    torch.manual_seed(5)
    ours = model(input_ids=ids).logits
    torch.manual_seed(5)
    theirs = twin(input_ids=ids).logits
    assert torch.equal(ours, theirs)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    grads = {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if param.requires_grad:
            layer, _, leaf = name.rpartition(".")
            assert torch.equal(param.grad, grads[f"base_model.model.{layer}.{leaf}.default.weight"]), name
        else:
            assert param.grad is None, name


def test_fresh_adapters_add_nothing_and_are_drawn_alike_for_any_plan():
    model, again = tiny(), tiny()
    reference = copy.deepcopy(model)
    weight = model.model.layers[1].mlp.down_proj.weight
    apply_lora(model, rewrite.resolve(_plan(), model))
    apply_lora(again, rewrite.resolve(_plan(targets=["model.layers.1.mlp.down_proj"]), again))
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, LoraLinear) and layer.weight is weight and not weight.requires_grad
    assert torch.equal(layer.lora_A, again.model.layers[1].mlp.down_proj.lora_A)  # the layer's path, not the plan
    assert not torch.equal(layer.lora_A, model.model.layers[0].mlp.down_proj.lora_A)
    assert not layer.lora_B.any()
    ids = torch.randint(0, 64, (1, 7))
    assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_row_slice_drops_what_the_whole_input_would():
    """A row layer's rank draws the whole input's mask and keeps its slice: the slices' sum is the whole's."""
    gen = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(2, 5, 8, generator=gen), torch.randn(3, 8, generator=gen), torch.randn(6, 3, generator=gen)
    torch.manual_seed(9)
    whole = lora_delta(x, a, b, scaling=0.5, dropout=0.4, training=True)
    parts = []
    for r in range(2):
        torch.manual_seed(9)
        parts.append(lora_delta(x[..., 4 * r:4 * r + 4], a[:, 4 * r:4 * r + 4], b, scaling=0.5, dropout=0.4,
                                training=True, full_in=8, offset=4 * r))
    torch.testing.assert_close(parts[0] + parts[1], whole)
    assert torch.equal(lora_delta(x, a, b, scaling=0.5, dropout=0.4, training=False), (x @ a.T) @ b.T * 0.5)


def test_adapters_split_with_their_layer():
    assert style_split("column", "lora_B", 2) == TensorSplit(0, 2) == style_split("column", "weight", 2)
    assert style_split("column", "lora_A", 2) == TensorSplit() == style_split("row", "lora_B", 2)
    assert style_split("row", "lora_A", 2) == TensorSplit(1, 2) == style_split("row", "weight", 2)
    assert style_split("packed_column", "lora_B", 2, parts=2) == TensorSplit(0, 2, 2)
    assert style_split("column", "lora_B", 4, replicas=2) == TensorSplit(0, 2, 1, 2)
    assert style_split("vocab", "lora_A", 2) == TensorSplit()


def test_lora_linear_keeps_the_linears_own_parameters():
    linear = nn.Linear(6, 4)
    layer = LoraLinear.from_linear(linear, rank=2, scaling=2.0, dropout=0.0)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert layer.lora_A.shape == (2, 6) and layer.lora_B.shape == (4, 2) and "lora rank=2" in repr(layer)


def test_train_flags_make_the_lora_section():
    from types import SimpleNamespace

    from rewrite.run.train_setup import lora_plan

    plain, with_lora = rewrite.load_plan({}), rewrite.load_plan(_plan())
    flags = lambda rank=None, alpha=None: SimpleNamespace(lora_rank=rank, lora_alpha=alpha)  # noqa: E731
    plan, problems = lora_plan(flags(8, 16.0), plain)
    assert (plan.lora.rank, plan.lora.scaling, problems) == (8, 2.0, [])
    assert lora_plan(flags(), plain) == (plain, [])
    assert lora_plan(flags(alpha=4.0), plain)[1] == ["--lora-alpha needs --lora-rank R"]
    assert "--lora-rank: Input should be greater than or equal to 1" in lora_plan(flags(0), plain)[1][0]
    assert "--lora-alpha: Input should be greater than 0" in lora_plan(flags(4, -1.0), plain)[1][0]
    assert "has a lora section and --lora-rank was given too" in lora_plan(flags(4), with_lora)[1][0]


def test_fresh_adapters_follow_the_plans_seed_not_the_process():
    model, again, other = tiny(), tiny(), tiny()
    torch.manual_seed(123)  # a process seeded otherwise draws the same adapters
    apply_lora(model, rewrite.resolve(_plan(), model))
    torch.manual_seed(7)
    apply_lora(again, rewrite.resolve(_plan(), again))
    apply_lora(other, rewrite.resolve(_plan(seed=1), other))
    a = model.model.layers[0].self_attn.q_proj.lora_A
    assert torch.equal(a, again.model.layers[0].self_attn.q_proj.lora_A)
    assert not torch.equal(a, other.model.layers[0].self_attn.q_proj.lora_A)


def test_the_adapters_trace_without_graph_breaks():
    """What plans will compile: a layer with an adapter (dropout on) and a row rank's slice of one."""
    layer = LoraLinear.from_linear(nn.Linear(16, 8), rank=4, scaling=2.0, dropout=0.1)
    nn.init.normal_(layer.lora_A)
    layer.train()
    assert torch._dynamo.explain(layer)(torch.randn(2, 3, 16)).graph_break_count == 0
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    row = torch._dynamo.explain(lambda x: lora_delta(x, a, b, scaling=2.0, dropout=0.1, training=True, full_in=16,
                                                     offset=8))
    assert row(torch.randn(2, 3, 8)).graph_break_count == 0
