"""The Hugging Face families a sweep covers: every dense decoder-only causal LM of the installed
transformers whose `base_model_tp_plan` uses only styles rewrite maps, each built tiny from its own config."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from rewrite.models.tiny_clone import per_head_sizes, small_chunks
from rewrite.plan.styles import STYLE_ALIASES

# The tensor-parallel styles of transformers that rewrite reads (`plan/styles.py`).
MAPPED = set(STYLE_ALIASES)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "head_dim": 16, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2}


def _decoder_configs():
    """(model type, config class) of every causal LM of the installed transformers with no encoder-decoder
    and no sub-models (a multimodal config's vision or audio tower beside the text model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        if not getattr(config_class, "is_encoder_decoder", False) and not getattr(config_class, "sub_configs", None):
            yield model_type, config_class


def causal_lm_families() -> list[str]:
    """Decoder model types (`_decoder_configs`) with a tp plan of mapped styles only, none of them splitting
    experts (`moe_tp_experts`: those mixtures of experts are swept by `moe_families`' sweep, tiny experts)."""
    return [model_type for model_type, config_class in _decoder_configs()
            if (plan := getattr(config_class, "base_model_tp_plan", None)) and set(plan.values()) <= MAPPED
            and "moe_tp_experts" not in plan.values()]


def tiny_family_model(family: str, *, seed: int = 0, **overrides):
    """A tiny causal LM of `family` with random weights moved off their constant initial values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Sizes per head (GPT-J's rotary_dim, latent attention's ranks) shrink with the heads, as the guard's clone.
        default = AutoConfig.for_model(family)
        latent = {"num_key_value_heads": TINY["num_attention_heads"]} if "kv_lora_rank" in default.to_dict() else {}
        # (latent attention has a key and a value per query head)
        config = AutoConfig.for_model(family, **{**TINY, **per_head_sizes(default), **small_chunks(default), **latent,
                                                   **overrides})
        # A training configuration: no KV cache, and no dropout, so that one process and a plan draw
        # no random masks and can be compared value for value.
        config.use_cache = False
        for key, value in config.to_dict().items():
            if "dropout" in key and isinstance(value, float) and value > 0:
                setattr(config, key, 0.0)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms of ones, equal alphas: make each parameter count
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


# A mixture of experts made tiny: 4 experts of width 32, 2 chosen per token, every layer sparse
# (each key set only where the family's config has it).
TINY_MOE = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "decoder_sparse_step": 1, "mlp_only_layers": []}


# What a family's own config needs beyond TINY_MOE to build tiny with its experts on.
MOE_EXTRA = {
    "dots1": {"n_shared_experts": 1},
    "zaya": {"num_experts_per_tok": 1},  # ZAYA routes each token to one expert
    # (no per-layer inputs: the walker does not hand them to the layers, and refuses a Gemma-4 config with them;
    # its full-attention heads as narrow as the others: a 512-wide head scaled by 1 on random tiny weights is too
    # ill-conditioned for float32 to compare at 1e-5 once tp changes the order of a sum)
    "gemma4_text": {"enable_moe_block": True, "top_k_experts": 2, "hidden_size_per_layer_input": 0,
                    "global_head_dim": 16},
    "longcat_flash": {"moe_topk": 2, "zero_expert_num": 2, "expert_ffn_hidden_size": 32},
    "lfm2_moe": {"num_dense_layers": 0, "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "bailing_hybrid": {"num_expert_group": 1, "num_experts_per_token": 2, "mlp_layer_types": ["sparse"] * 4,
                       "layer_types": ["linear_attention", "full_attention"] * 2},
    "dots3_note_text": {"mlp_layer_types": ["sparse"] * 4,
                        "layer_types": ["indexed_attention", "sliding_attention", "sliding_attention", "indexed_attention"]},
    # Granite's scales set away from 1, so that a walker forgetting one is caught
    **dict.fromkeys(["granitemoe", "granitemoeshared"], {"embedding_multiplier": 2.0, "logits_scaling": 4.0}),
    "granitemoehybrid": {"embedding_multiplier": 2.0, "logits_scaling": 4.0},
    # and GraniteMoE-SWA's rotary bases per layer, two of them and no rotation (0)
    "granitemoe_swa": {"embedding_multiplier": 2.0, "logits_scaling": 4.0,
                       "layer_rope_theta": [10000.0, 0, 500000.0, 0]},
    # (its linear attention's heads as few and as narrow as the others: 32 of 128 wide cost seconds a step)
    "kimi_linear": {"num_experts_per_token": 2, "linear_num_heads": 4, "linear_head_dim": 16},
    "ernie4_5_moe": {"moe_k": 2, "moe_layer_start_index": 0, "moe_layer_end_index": 3},
}


def moe_families() -> list[str]:
    """Decoder model types (`_decoder_configs`) with a mixture of experts: an ep plan, or a count of
    experts in the config."""
    found = []
    for model_type, config_class in _decoder_configs():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                keys = config_class().to_dict()
        except Exception:
            keys = {}
        counts = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
        if getattr(config_class, "base_model_ep_plan", None) or any(keys.get(k) for k in counts):
            found.append(model_type)
    return found


def documented_works(doc, cases) -> dict[str, set[str]]:
    """Family -> the cases a family table (`doc`, columns in `cases` order, as bench/families.py writes it)
    says work: the floor a change may not lower."""
    out = {}
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == len(cases) + 1 and cells[0].startswith("`"):
            out[cells[0].strip("`")] = {case for case, cell in zip(cases, cells[1:]) if cell.startswith("works")}
    return out


def check_family(family: str, results: list[dict], doc, cases, table_env: str) -> None:
    """A sweep's outcome for `family`, one dict a rank: the same on every rank, no case the table `doc`
    says works lost; added to the JSON file `table_env` names, when set."""
    assert results[0] == results[1], results  # a refusal is the same on every rank
    lost = {case: results[0][case] for case in documented_works(doc, cases).get(family, ())
            if not results[0][case].startswith("works")}
    assert not lost, f"{family}: {doc.name} says these cases work, now: {lost}"
    table = os.environ.get(table_env)
    if table:
        path = Path(table)
        done = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**done, family: results[0]}, indent=2, sort_keys=True))


def tiny_moe_model(family: str, *, seed: int = 0, **overrides):
    """A tiny mixture-of-experts causal LM of `family` (`TINY_MOE` on `TINY`), as `tiny_family_model`."""
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keys = AutoConfig.for_model(family).to_dict()
    moe = {**{k: v for k, v in TINY_MOE.items() if k in keys}, **MOE_EXTRA.get(family, {})}  # the family's own: all
    return tiny_family_model(family, seed=seed, **{**moe, **overrides})
