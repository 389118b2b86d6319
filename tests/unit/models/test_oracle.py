"""The oracle guard: a family whose own forward the module walker does not reproduce is refused,
on a tiny clone of its config, before anything runs; the families it reproduces bind as before."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import rewrite
from rewrite.models.oracle import tiny_clone_config, walker_problem
from rewrite.run.cli import main
from rewrite.run.presets import build_model, load_config

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "head_dim": 16, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None}
# What each family's own forward does that embed -> layers -> norm -> head leaves out.
WRONG = {
    "cohere": ({}, "logits"),  # logit_scale on the logits
    "gemma2": ({}, "logits"),  # final_logit_softcapping
    "vaultgemma": ({}, "logits"),
    "granite": ({"embedding_multiplier": 12.0, "logits_scaling": 8.0}, "logits"),
    "nanochat": ({}, "logits"),  # a norm before the first layer
    "gemma3_text": ({}, "cannot run"),  # rotary embeddings per layer type
}


def _meta(family: str, **overrides):
    config = AutoConfig.for_model(family, **{**TINY, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(WRONG))
def test_a_family_the_walker_does_not_reproduce_is_refused(family):
    overrides, kind = WRONG[family]
    model = _meta(family, **overrides)
    with pytest.raises(rewrite.PlanError) as info:
        rewrite.resolve({"mesh": {"tp": 1}}, model)
    (problem,) = info.value.problems
    assert problem.startswith(f"{type(model).__name__} ({family}): ") and "no plan setting changes that" in problem
    assert (f"do not give {family}'s own logits" if kind == "logits" else "the module walker cannot run") in problem


@pytest.mark.parametrize("path", ["tiny-llama", "tiny-qwen3", "tests/configs/llama-3.1-8b.json",
                                  "tests/configs/mistral-7b.json", "tests/configs/qwen2.5-0.5b.json"])
def test_the_families_the_walker_reproduces_pass(path):
    model = build_model(load_config(path), device="meta")
    assert walker_problem(model) is None


def test_the_clone_keeps_the_flags_and_every_attention_type_with_tiny_sizes():
    config = AutoConfig.for_model("gemma2", final_logit_softcapping=30.0)
    tiny = tiny_clone_config(config)
    assert type(tiny) is type(config) and tiny.final_logit_softcapping == 30.0
    assert tiny.hidden_size == 64 and tiny.num_hidden_layers == 4 and tiny.vocab_size == 128
    assert set(tiny.layer_types) == set(config.layer_types) and len(tiny.layer_types) == 4
    assert tiny.num_key_value_heads == 2 and tiny.sliding_window == 4
    mqa = tiny_clone_config(AutoConfig.for_model("llama", num_attention_heads=8, num_key_value_heads=1))
    assert (mqa.num_attention_heads, mqa.num_key_value_heads) == (4, 1)


def test_the_guard_leaves_the_random_state_alone():
    model = _meta("granite", embedding_multiplier=3.0)  # a config the cache has not seen
    before = torch.random.get_rng_state()
    assert walker_problem(model) is not None
    assert torch.equal(torch.random.get_rng_state(), before)


def test_validate_refuses_the_family_and_exits_1(tmp_path, capsys):
    AutoConfig.for_model("cohere", **TINY).save_pretrained(tmp_path)
    assert main(["validate", "plans/llama-tp2.yaml", "--model", str(tmp_path / "config.json")]) == 1
    err = capsys.readouterr().err
    assert "CohereForCausalLM (cohere): the module walker's stages do not give cohere's own logits" in err


def test_modules_kept_whole_inside_a_split_mlp_sum_their_gradients_or_are_refused():
    model = _meta("apertus")  # xIELU: alpha_p, alpha_n in mlp.act_fn, inside the split MLP
    resolved = rewrite.resolve(rewrite.plan_from_hf(model, tp=2), model)
    implied = {s.fqn for s in resolved.shards if s.pattern == "(implied)"}
    assert {f"model.layers.{i}.mlp.act_fn" for i in range(4)} <= implied
    assert {f"model.layers.{i}.self_attn.q_norm" for i in range(4)} <= implied
    # A norm over the intermediate features would see 1/tp of them; a parameter of the block itself
    # cannot be routed alone: both refused, naming it.
    llama = build_model(load_config("tiny-llama"), device="meta")
    with torch.device("meta"):
        llama.model.layers[1].mlp.inner_norm = torch.nn.LayerNorm(llama.config.intermediate_size)
        llama.model.layers[2].mlp.scale = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(rewrite.PlanError) as info:
        rewrite.resolve("plans/llama-tp2.yaml", llama)
    text = str(info.value)
    assert "model.layers.1.mlp.inner_norm is kept whole inside model.layers.1.mlp, whose 128 features are split" in text
    assert "weight [128], bias [128] spans them" in text
    assert "model.layers.2.mlp.scale is a parameter of model.layers.2.mlp itself" in text
