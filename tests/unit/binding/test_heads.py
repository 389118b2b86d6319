"""Heads and tp: when kv heads are replicated, what each rank holds, and the refusals around it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, Qwen2Config

from rewrite.plan.files import PlanError
from rewrite.plan.from_hf import plan_from_hf
from rewrite.binding.heads import head_counts, head_problems, kv_replicas, replicated_tps
from rewrite.binding.resolve import resolve
from rewrite.run.presets import build_model


def test_replicas_only_past_the_kv_heads_and_within_the_query_heads():
    assert [kv_replicas(8, 2, tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [kv_replicas(8, 1, tp) for tp in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert kv_replicas(8, 8, 8) == 1 and kv_replicas(9, 3, 9) == 3
    assert kv_replicas(14, 2, 4) == 1, "4 passes the 2 kv heads but does not divide the 14 query heads"
    assert kv_replicas(12, 4, 6) == 1, "6 is no multiple of 4"
    assert replicated_tps(64, 8) == [16, 32, 64] and replicated_tps(28, 4) == [28] and replicated_tps(8, 8) == []
    assert head_counts(SimpleNamespace(num_attention_heads=8)) == (8, 8)
    assert head_counts(SimpleNamespace(num_attention_heads=8, num_key_value_heads=None)) == (8, 8)
    assert head_counts(SimpleNamespace(hidden_size=8)) is None


def test_the_refusal_names_every_tp_that_works():
    def message(heads, kv, tp):
        found = head_problems(SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv), tp, "plan.yaml:3: ")
        return found[0] if found else None

    for heads, kv, tp in ((8, 2, 4), (8, 1, 8), (64, 8, 16), (9, 3, 9), (8, 8, 4)):
        assert message(heads, kv, tp) is None, (heads, kv, tp)
    text = message(24, 8, 10)
    assert text.startswith("plan.yaml:3: mesh.tp=10 does not divide num_attention_heads=24 nor num_key_value_heads=8")
    assert "either divide the 8 kv heads (tp 1, 2, 4 or 8) or be a multiple of them" in text
    assert "each kv head then replicated on tp / 8 ranks (tp 24)" in text
    assert message(24, 8, 16).startswith("plan.yaml:3: mesh.tp=16 does not divide num_attention_heads=24 (q_proj")
    text = message(48, 8, 12)  # divides the query heads, but neither divides the 8 nor is a multiple of them
    assert "mesh.tp=12 neither divides num_key_value_heads=8 nor is a multiple of it" in text
    assert "(tp 16, 24 or 48)" in text
    assert "divide the 1 kv head (tp 1) or be a multiple of it" in message(8, 1, 3)
    text = message(6, 6, 4)  # multi-head attention: nothing to replicate, the old message
    assert "tp must divide 6 attention heads: tp 1, 2, 3 or 6" in text and "replicated" not in text


def _model(heads=8, kv=2, **extra):
    return build_model(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=8, **extra), device="meta")


def test_resolve_gives_k_and_v_one_whole_head_per_rank():
    model = _model()
    resolved = resolve(plan_from_hf(model, tp=4), model)
    assert resolved.kv_replicas == 2
    by_leaf = {s.fqn.rsplit(".", 1)[-1]: s for s in resolved.shards if ".layers.0." in s.fqn}
    assert by_leaf["q_proj"].weight_shape == (16, 64) and by_leaf["q_proj"].replicas == 1
    for leaf in ("k_proj", "v_proj"):
        spec = by_leaf[leaf]
        assert (spec.replicas, spec.slices, spec.weight_shape) == (2, 2, (8, 64)), leaf  # one kv head of 8
    assert by_leaf["o_proj"].weight_shape == (64, 16)
    assert resolve(plan_from_hf(model, tp=2), model).kv_replicas == 1
    mqa = _model(kv=1)
    specs = resolve(plan_from_hf(mqa, tp=8), mqa).shards
    assert {s.weight_shape for s in specs if s.fqn.endswith("k_proj")} == {(8, 64)}  # the one kv head, on every rank
    # Qwen2's k/v biases are replicated with their rows.
    qwen = build_model(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2), device="meta")
    spec = next(s for s in resolve(plan_from_hf(qwen, tp=4), qwen).shards if s.fqn.endswith("v_proj"))
    assert spec.bias_shape == (8,) and spec.replicas == 2


def test_an_attention_without_its_kv_group_count_is_refused_past_the_kv_heads():
    model = _model()
    for layer in model.model.layers:
        del layer.self_attn.num_key_value_groups
    resolve(plan_from_hf(model, tp=2), model)  # tp 2 divides the kv heads: the ratio is unchanged, nothing to tell
    with pytest.raises(PlanError) as info:
        resolve(plan_from_hf(model, tp=4), model)
    text = str(info.value)
    assert "mesh.tp=4 holds each of the 2 kv heads on tp / 2 ranks" in text
    assert "LlamaAttention keeps no num_key_value_groups to tell it so: use tp 1 or 2" in text
