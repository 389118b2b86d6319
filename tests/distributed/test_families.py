"""Hugging Face families whose own forward does more than embed -> layers -> norm -> head train as
themselves: at tp 2 (their own base_model_tp_plan) and at pp 2 (1f1b), the step loss and every
gradient equal one process running the model's own forward on the same microbatches."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import rewrite
from rewrite.run.parity import reference_step
from tests.asserts import assert_close
from tests.multiproc import run
from tests.reference import assert_grads_match

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "head_dim": 16, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None}
# Each family with what its forward adds (and the flags that make it count in a tiny model).
FAMILIES = {
    "cohere": {},  # logit_scale
    "cohere2": {},
    "gemma2": {"final_logit_softcapping": 2.0},  # soft cap on the logits (a small cap: tanh far from linear)
    "vaultgemma": {"final_logit_softcapping": 2.0},
    "gemma3_text": {},  # rotary embeddings per layer type, per-head q/k norms
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "hyperclovax": {"embedding_multiplier": 3.0, "logits_scaling": 0.5},
    "nanochat": {"final_logit_softcapping": 2.0},  # the final norm before the first layer too
    "apertus": {},  # xIELU alpha_p / alpha_n inside the split MLP
}
PP2 = {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}


def _model(family: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **TINY, **FAMILIES[family]))
    with torch.no_grad():  # off the constant initial values (norms of ones, equal alphas), so each counts
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _step(rank: int, world: int, family: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(2)]
    targets = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(2)]
    compared = {}
    for name in ("tp2", "pp2"):
        model = _model(family)
        reference = copy.deepcopy(model)
        plan = rewrite.plan_from_hf(model, tp=world) if name == "tp2" else PP2
        stage = rewrite.apply_plan(model, plan)
        loss = rewrite.run_schedule(stage, ids, targets)
        tag = f"{family} {name} rank {rank}"
        assert_close(f"{tag} step loss", loss, reference_step(reference, ids, targets))
        compared[name] = assert_grads_match(model, reference, prefix=f"{tag} ")
    return compared


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_as_itself_at_tp2_and_pp2(family):
    results = run(_step, 2, family, timeout_s=180)
    assert all(n > 0 for r in results for n in r.values()), results
