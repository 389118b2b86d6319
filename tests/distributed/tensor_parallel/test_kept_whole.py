"""Parameters kept whole inside a split block (Apertus's xIELU alpha_p / alpha_n in the MLP, its
per-head q_norm / k_norm) get whole gradients at tp 2: loss and every gradient equal one process."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import rewrite
from tests.asserts import assert_close
from tests.multiproc import run
from tests.reference import assert_grads_match

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "head_dim": 16, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None}


def _apertus(rank: int, world: int) -> int:
    config = AutoConfig.for_model("apertus", **TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # alpha_p, alpha_n start equal on every layer: make each one count
        for name, param in model.named_parameters():
            if "act_fn" in name:
                param.add_(torch.randn_like(param))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
    labels = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
    rewrite.apply_plan(model, rewrite.plan_from_hf(model, tp=world))
    out, ref = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert_close("apertus tp=2 logits", out.logits, ref.logits)
    out.loss.backward()
    ref.loss.backward()
    assert_close("apertus alpha_p grad", model.model.layers[0].mlp.act_fn.alpha_p.grad,
                 reference.model.layers[0].mlp.act_fn.alpha_p.grad)
    return assert_grads_match(model, reference, prefix="apertus tp=2 ")


def test_apertus_activation_parameters_get_whole_gradients_at_tp2():
    compared = run(_apertus, 2, timeout_s=120)
    assert all(n > 0 for n in compared), compared
