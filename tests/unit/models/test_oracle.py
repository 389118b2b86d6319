"""The oracle guard: the module walker, with the families table, must give the model's own logits on a
tiny clone of its config, or the plan is refused before anything runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import rewrite
from rewrite.models.oracle import walker_problem
from rewrite.models.tiny_clone import tiny_clone_config
from rewrite.run.cli import main
from rewrite.run.presets import build_config, build_model, load_config
from tests.families import TINY

# Families whose own forward does more than embed -> layers -> norm -> head (`models/families.py`).
FAMILIES = {
    "cohere": {},  # logit_scale on the logits
    "gemma2": {},  # final_logit_softcapping
    "vaultgemma": {},
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "hyperclovax": {"embedding_multiplier": 3.0, "logits_scaling": 0.5},
    "nanochat": {},  # the final norm before the first layer too
    "gemma3_text": {},  # rotary embeddings per layer type
    "granitemoe": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "cohere2_moe": {"logit_scale": 0.5},
    "doge": {},  # a causal mask its layers add their dynamic mask onto, built even where SDPA could skip it
    "lara_mini": {},  # its global layers use no rotary embedding
    "inkling_text": {"logits_mup_width_multiplier": 4.0},  # 'hybrid' layer types; hidden / multiplier to the head
    "beam": {"final_logit_softcapping": 30.0},  # no rotation and a scaled query on its full layers; a soft cap
    "granitemoe_swa": {"layer_rope_theta": [10000.0, 0, 500000.0, 0]},  # a rotary base per layer, 0: none
    "jamba": {},  # no rotary embedding at all
}


def _meta(family: str, **overrides):
    config = AutoConfig.for_model(family, **{**TINY, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


class ScaledLlama(LlamaForCausalLM):
    """A family nobody declared: its forward scales the logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class Shifted(torch.nn.Embedding):
    """An embedding whose forward does more than look up (and scale) rows."""

    def forward(self, ids):
        return super().forward(ids) + 1


class NeedsCacheLlama(LlamaForCausalLM):
    """A family whose layers need an argument its own forward passes and the walker does not."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.forward = _needs_cache(layer.forward)


def _needs_cache(forward):
    def wrapped(hidden_states, *args, **kwargs):
        if "cache" not in kwargs:
            raise TypeError("forward() missing 1 required keyword argument: 'cache'")
        return forward(hidden_states, *args, **kwargs)

    return wrapped


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_families_table_gives_the_models_own_logits(family):
    model = _meta(family, **FAMILIES[family])
    assert walker_problem(model) is None
    rewrite.resolve({"mesh": {"pp": 2}}, model)


def test_a_family_the_walker_does_not_reproduce_is_refused():
    with torch.device("meta"):
        model = ScaledLlama(build_config("tiny-llama"))
    with pytest.raises(rewrite.PlanError) as info:
        rewrite.resolve({"mesh": {"tp": 1}}, model)
    (problem,) = info.value.problems
    assert problem.startswith("ScaledLlama (llama): the module walker's stages do not give llama's own logits")
    assert "no plan setting changes that" in problem
    with torch.device("meta"):
        crashing = NeedsCacheLlama(build_config("tiny-llama"))
    assert "the module walker cannot run llama's layers (TypeError: " in walker_problem(crashing)


@pytest.mark.parametrize("path", ["tiny-llama", "tiny-qwen3", "tests/configs/llama-3.1-8b.json",
                                  "tests/configs/mistral-7b.json", "tests/configs/qwen2.5-0.5b.json"])
def test_the_shipped_families_pass(path):
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
    with torch.device("meta"):
        model = ScaledLlama(build_config("tiny-llama", rms_norm_eps=1e-5))  # a config the cache has not seen
    before = torch.random.get_rng_state()
    assert walker_problem(model) is not None
    assert torch.equal(torch.random.get_rng_state(), before)


def test_validate_checks_the_family_and_what_its_forward_rules_out(tmp_path, capsys):
    AutoConfig.for_model("cohere", **TINY).save_pretrained(tmp_path / "cohere")
    assert main(["validate", "plans/llama-tp2.yaml", "--model", str(tmp_path / "cohere" / "config.json")]) == 0
    assert "OK for CohereForCausalLM" in capsys.readouterr().out
    # NanoChat runs its final norm before the first layer too: sequence parallelism would gather there,
    # and at pp > 1 a norm with weights would be a second copy on the first rank.
    nanochat = _meta("nanochat")
    plan = rewrite.plan_from_hf(nanochat, tp=2).model_dump(mode="json", exclude_none=True)
    with pytest.raises(rewrite.PlanError, match="also runs before its first layer: remove sequence_parallel"):
        rewrite.resolve({**plan, "sequence_parallel": True}, nanochat)
    rewrite.resolve({"mesh": {"pp": 2}}, nanochat)  # its norm has no weights: both ends run it
    with torch.device("meta"):
        nanochat.model.norm = torch.nn.RMSNorm(64)
    with pytest.raises(rewrite.PlanError, match="runs model.norm before its first layer and after its last"):
        rewrite.resolve({"mesh": {"pp": 2}}, nanochat)
    # Gemma's embedding scales its rows: 'vocab' keeps the scale; an embedding doing anything else is refused.
    gemma = _meta("gemma2")
    vocab = {"mesh": {"tp": 2}, "tensor_parallel": {"model.embed_tokens": "vocab", "lm_head": "column"},
             "loss_parallel": True}
    assert {s.fqn: s.style for s in rewrite.resolve(vocab, gemma).shards}["model.embed_tokens"] == "vocab"
    with torch.device("meta"):
        gemma.model.embed_tokens = Shifted(128, 64)
    with pytest.raises(rewrite.PlanError, match="whose forward does more than look up rows"):
        rewrite.resolve(vocab, gemma)


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


class FullHeadsLlama(LlamaForCausalLM):
    """A family whose attention reshapes by the config's head count, not by what q_proj returns."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn.forward = _full_heads(layer.self_attn, config)


def _full_heads(attention, config):
    forward = attention.forward

    def wrapped(hidden_states, *args, **kwargs):
        b, s, _ = hidden_states.shape
        attention.q_proj(hidden_states).view(b, s, config.num_attention_heads, config.head_dim)
        return forward(hidden_states, *args, **kwargs)

    return wrapped


def test_a_family_whose_layers_reshape_by_the_full_head_count_is_refused_at_tp():
    with torch.device("meta"):
        model = FullHeadsLlama(build_config("tiny-llama"))
    with pytest.raises(rewrite.PlanError) as info:
        rewrite.resolve("plans/llama-tp2.yaml", model)
    (problem,) = info.value.problems
    assert problem.startswith("FullHeadsLlama (llama): FullHeadsLlama.forward fails on one rank's shards")
    assert "leave its attention and MLP unsharded (mesh.tp: 1)" in problem
    rewrite.resolve({"mesh": {"tp": 1}}, model)  # unsplit, its own forward runs
    # GPT-J and CodeGen rotate rotary_dim of each head: the clone keeps that share of its tiny heads.
    gptj = _meta("gptj", rotary_dim=8)
    rewrite.resolve(rewrite.plan_from_hf(gptj, tp=2), gptj)
    assert tiny_clone_config(AutoConfig.for_model("gptj")).rotary_dim == 4  # 64 of 256, then of 16
    # Latent attention (Youtu) keeps the proportions of its ranks and per-head sizes; a real-sized config
    # is checked on a clone that runs.
    youtu = AutoConfig.for_model("youtu")
    tiny = tiny_clone_config(youtu)
    assert (tiny.kv_lora_rank, tiny.q_lora_rank, tiny.qk_rope_head_dim, tiny.v_head_dim) == (128, 384, 16, 32)
    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(youtu)
    assert walker_problem(real) is None


def test_a_rule_on_a_module_without_parameters_is_a_warning_not_a_refusal(tmp_path, capsys):
    # Gemma-3n's own tp plan names a norm without weights as replicated_with_grad_allreduce.
    llama = build_model(load_config("tiny-llama"), device="meta")
    plan = {"mesh": {"tp": 2}, "tensor_parallel": {**rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel,
                                                   "model.layers.*.mlp.act_fn": "grad_allreduce"}}
    resolved = rewrite.resolve(plan, llama)
    assert resolved.warnings == (
        "tensor_parallel['model.layers.*.mlp.act_fn'] matches 'model.layers.*.mlp.act_fn', which has no parameters: "
        "there is no gradient to sum, so the rule changes nothing there [* = 0-3]",
    )
    assert not any(s.fqn.endswith("act_fn") for s in resolved.shards)
    path = tmp_path / "plan.yaml"
    path.write_text(rewrite.load_plan(plan).to_yaml())
    assert main(["validate", str(path), "--model", "tiny-llama"]) == 0
    assert "which has no parameters: there is no gradient to sum" in capsys.readouterr().err
