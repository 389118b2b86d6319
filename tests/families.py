"""The Hugging Face families a sweep covers: every dense decoder-only causal LM of the installed
transformers whose `base_model_tp_plan` uses only styles rewrite maps, each built tiny from its own config."""

from __future__ import annotations

import warnings

import torch

# The tensor-parallel styles of transformers that rewrite reads (`plan/styles.py`).
MAPPED = {"colwise", "rowwise", "replicated_with_grad_allreduce", "embedding_rowwise"}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "head_dim": 16, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None}


def causal_lm_families() -> list[str]:
    """Model types with a causal-LM class, a tp plan of mapped styles only, and no encoder-decoder."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        plan = getattr(config_class, "base_model_tp_plan", None)
        if plan and set(plan.values()) <= MAPPED and not getattr(config_class, "is_encoder_decoder", False):
            found.append(model_type)
    return found


def tiny_family_model(family: str, *, seed: int = 0, **overrides):
    """A tiny causal LM of `family` with random weights moved off their constant initial values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(family, **{**TINY, **overrides})
        # A training configuration: no KV cache, and no dropout, so that one process and a plan draw
        # no random masks and can be compared value for value.
        config.use_cache = False
        if isinstance(getattr(config, "rotary_dim", None), int):  # GPT-J, CodeGen: within the tiny heads
            config.rotary_dim = TINY["head_dim"] // 2
        for key, value in config.to_dict().items():
            if "dropout" in key and isinstance(value, float) and value > 0:
                setattr(config, key, 0.0)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms of ones, equal alphas: make each parameter count
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model
