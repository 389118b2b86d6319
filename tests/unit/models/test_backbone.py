"""The module walker finds a family's parts from its own declarations (`base_model_pp_plan`), or by their
kinds when it has none, and runs them as the model's own forward does; other layouts are refused in one
line that names what is missing."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import rewrite
from rewrite.context_parallel.family import context_parallel_problem
from rewrite.models.hf_decoder import backbone_problem, find_backbone, run_backbone
from rewrite.binding.tp_switches import sequence_blocks
from rewrite.run.show.data import show_data
from rewrite.run.show.report import render_text
from tests.families import TINY, tiny_family_model, tiny_moe_model

# family -> (embed, after_embed, layers, norm): declared by base_model_pp_plan, or found by kind (lfm2, bamba).
PARTS = {
    "llama": ("model.embed_tokens", (), "model.layers", "model.norm"),
    "gpt_neox": ("gpt_neox.embed_in", ("gpt_neox.emb_dropout",), "gpt_neox.layers", "gpt_neox.final_layer_norm"),
    "gptj": ("transformer.wte", ("transformer.drop",), "transformer.h", "transformer.ln_f"),
    "phi": ("model.embed_tokens", ("model.embed_dropout",), "model.layers", "model.final_layernorm"),
    "lfm2": ("model.embed_tokens", (), "model.layers", "model.embedding_norm"),
}
PP2 = {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}


def _two_stages_give_its_logits(model, bb) -> None:
    """Layers 0-1 then 2-3 through the walker give the model's own logits."""
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        hidden = run_backbone(model, bb, ids, [0, 1], first=True, last=False)
        logits = run_backbone(model, bb, hidden, [2, 3], first=False, last=True)
    assert (logits - reference).abs().max() < 1e-5


@pytest.mark.parametrize("family", sorted(PARTS))
def test_parts_are_found_and_run_as_the_model_does(family):
    model = tiny_family_model(family).eval()
    bb = find_backbone(model)
    assert (bb.embed, bb.after_embed, bb.layers, bb.norm) == PARTS[family]
    assert bb.head == "lm_head" and bb.rotary.endswith("rotary_emb") and bb.num_layers == 4
    assert bb.stage_modules([0, 1], first=True, last=False) == [
        bb.embed, *bb.after_embed, bb.rotary, f"{bb.layers}.0", f"{bb.layers}.1"]
    assert bb.stage_modules([2, 3], first=False, last=True)[-2:] == [bb.norm, "lm_head"]
    _two_stages_give_its_logits(model, bb)
    assert backbone_problem(model) is None


# family -> the rotary embedding the walker rebuilds on each stage: none (recurrent hybrids), one under
# another name (LFM2's pos_emb), or the family's own per-layer tables (`families.py: rotary_name`).
ROTARY = {"jamba": None, "nemotron_h": None, "lfm2_moe": "model.pos_emb", "granitemoe_swa": "model.rotary_embs"}


@pytest.mark.parametrize("family", sorted(ROTARY))
def test_hybrids_and_other_rotaries_run_as_the_model_does(family):
    extra = {"layer_rope_theta": [10000.0, 0, 500000.0, 0]} if family == "granitemoe_swa" else {}
    model = tiny_moe_model(family, **extra).eval()
    bb = find_backbone(model)
    assert bb.rotary == ROTARY[family] and bb.num_layers == 4
    first = bb.stage_modules([0, 1], first=True, last=False)
    assert first == [bb.embed, *([bb.rotary] if bb.rotary else []), f"{bb.layers}.0", f"{bb.layers}.1"]
    _two_stages_give_its_logits(model, bb)
    if family != "granitemoe_swa":  # recurrent or convolution layers: no rank can run part of the sequence
        assert "layers carry a state along the whole sequence" in context_parallel_problem(model)
    if family == "lfm2_moe":  # a second rotary embedding, no family entry naming the one each layer takes
        model.model.rotary_extra = type(model.model.pos_emb)(model.config)
        assert find_backbone(model) is None and "at most one rotary embedding" in backbone_problem(model)


def test_the_base_model_alone_has_no_head():
    base = tiny_family_model("gpt_neox").gpt_neox
    bb = find_backbone(base)
    assert (bb.embed, bb.layers, bb.head) == ("embed_in", "layers", None)


def test_a_layout_the_walker_cannot_read_is_refused_in_one_line():
    model = tiny_family_model("hrm_text")
    assert find_backbone(model) is None
    why = backbone_problem(model)
    assert "base_model_pp_plan declares (embed_tokens, layers, norm)" in why
    assert "HrmTextModel holds embed_tokens, rotary_emb, L_module, H_module" in why
    with pytest.raises(rewrite.PlanError) as err:
        rewrite.resolve(PP2, model)
    (problem,) = err.value.problems
    assert problem.startswith("HrmTextForCausalLM (hrm_text) cannot be split into pipeline stages: the module walker")
    assert "torch.fx cannot trace it" in problem and problem.endswith("use mesh.pp: 1")
    assert rewrite.resolve(rewrite.plan_from_hf(model, tp=2), model).tp == 2  # one stage needs no walker


def test_show_says_why_activations_of_other_layouts_are_not_estimated():
    model = tiny_family_model("gpt_neox")
    data = show_data(rewrite.resolve(PP2, model), model)
    why = data["memory"]["activations_not_estimated"]
    assert why.startswith("activations are estimated for LLaMA-shaped layers") and "GPTNeoXLayer holds" in why
    assert all(r["activations"] is None for r in data["memory"]["ranks"])
    assert "activations: not estimated (activations are estimated for LLaMA-shaped" in render_text(data)
    assert json.loads(json.dumps(data)) == data
    llama = tiny_family_model("llama")
    assert show_data(rewrite.resolve(PP2, llama), llama)["memory"]["activations_not_estimated"] is None


@pytest.mark.parametrize("family, embed", [("gpt_neox", "gpt_neox.embed_in"), ("gptj", "transformer.wte"),
                                           ("lfm2", "model.embed_tokens")])
def test_a_tied_head_under_loss_parallel_splits_the_embedding_the_family_declares(family, embed):
    config = AutoConfig.for_model(family, **TINY, tie_word_embeddings=True)
    for source in (config, AutoModelForCausalLM.from_config(config)):
        rules = rewrite.plan_from_hf(source, tp=2, loss_parallel=True).tensor_parallel
        assert rules[embed] == "vocab" and rules["lm_head"] == "column"


def test_sequence_blocks_are_the_children_holding_split_linears():
    model = tiny_family_model("gptj")  # one norm feeding attention and MLP side by side
    layer = model.transformer.h[0]
    styles = {s.fqn: s.style for s in rewrite.resolve(rewrite.plan_from_hf(model, tp=2), model).shards}
    blocks, others, moe = sequence_blocks(layer, "transformer.h.0", styles)
    assert blocks == {"transformer.h.0.attn": {"column", "row"}, "transformer.h.0.mlp": {"column", "row"}}
    assert others == {}  # ln_1 is a norm: it runs on the rank's tokens and sums its gradient over tp
    assert moe == {}
    llama = tiny_family_model("llama")
    only_column = {"model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
                   "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "row",
                   "model.layers.*.mlp.up_proj": "column"}
    plan = {"mesh": {"tp": 2}, "tensor_parallel": only_column, "sequence_parallel": True}
    with pytest.raises(rewrite.PlanError) as err:
        rewrite.resolve(plan, llama)
    text = str(err.value)
    assert "needs model.layers.*.mlp sharded column in and row out" in text and "found column only [* = 0-3]" in text
    whole_mlp = {k: v for k, v in only_column.items() if ".mlp." not in k}
    with pytest.raises(rewrite.PlanError) as err:
        rewrite.resolve({**plan, "tensor_parallel": whole_mlp}, llama)
    assert "runs model.layers.*.mlp (LlamaMLP) on this rank's part of the sequence, and only norms" in str(err.value)
    # A parameter of the decoder layer itself would see only the rank's tokens: refused by name.
    llama.model.layers[1].gate = torch.nn.Parameter(torch.ones(64))
    with pytest.raises(rewrite.PlanError) as err:
        rewrite.resolve(rewrite.plan_from_hf(llama, tp=2, sequence_parallel=True), llama)
    assert "runs model.layers.1.gate (a parameter of the layer itself) on this rank's part" in str(err.value)
