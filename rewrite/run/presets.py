"""Tiny random LLaMA-family models built from configs: no downloads needed.

Used by the CLI (`--model tiny-llama`), the demo, notebooks and tests.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import torch
from torch import nn

__all__ = ["PRESETS", "build_config", "build_model", "load_config", "model_problem"]

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,  # GQA, and tp 2 and 4 both divide it
    vocab_size=256,  # byte-level tokens
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

# The benchmark models: small but real proportions (hidden 256, 8 layers, 8 query / 4 kv heads, vocabulary 4,096).
_BENCH = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

# Qwen3-MoE's experts in every layer, 2 chosen per token.
_MOE = dict(num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])

# name -> (transformers config class, overrides)
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("LlamaConfig", _TINY),
    "tiny-mistral": ("MistralConfig", {**_TINY, "sliding_window": None}),
    "tiny-qwen2": ("Qwen2Config", _TINY),
    "tiny-qwen3": ("Qwen3Config", {**_TINY, "head_dim": 8}),
    # A mixture of experts: 4 experts of width 32 in every layer, 2 chosen per token.
    "tiny-qwen3-moe": ("Qwen3MoeConfig", {**_TINY, **_MOE, "head_dim": 8, "num_experts": 4, "moe_intermediate_size": 32}),
    # The benchmark model: small but real proportions.
    "bench-llama": ("LlamaConfig", {**_BENCH, "intermediate_size": 688}),
    # The benchmark mixture of experts: Qwen3-MoE's shape, 8 experts of width 256, 2 chosen per token.
    "bench-qwen3-moe": ("Qwen3MoeConfig", {**_BENCH, **_MOE, "head_dim": 32, "num_experts": 8,
                                           "moe_intermediate_size": 256}),
}


def build_config(name: str, **overrides):
    """The transformers config of a preset, with `overrides` applied."""
    import transformers

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    cls_name, fields = PRESETS[name]
    return getattr(transformers, cls_name)(**{**fields, **overrides})


def load_config(model: str | Path):
    """A config from a preset name, an HF `config.json`, or a local model directory."""
    from transformers import AutoConfig

    if isinstance(model, str) and model in PRESETS:
        return build_config(model)
    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        return AutoConfig.from_pretrained(str(path.parent) if path.name == "config.json" else str(path))
    if path.is_dir() and (path / "config.json").is_file():
        return AutoConfig.from_pretrained(str(path))
    raise ValueError(model_problem(model))


def model_problem(model: str | Path) -> str:
    """Why `--model` names nothing `load_config` reads, and what would: a close preset, a GGUF file's conversion."""
    path = Path(model)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else [path] if path.suffix == ".gguf" else []
    if ggufs:
        folder, name = ggufs[0].parent, ggufs[0].name
        out = f"models/{path.stem if path.suffix else path.name}"
        return (f"{ggufs[0]} is a GGUF file (llama.cpp's format), which rewrite does not read; convert it to a "
                "Hugging Face checkpoint once (transformers dequantizes it; needs `pip install gguf`): python -c "
                f"\"from transformers import AutoModelForCausalLM as M; M.from_pretrained('{folder}', gguf_file='{name}')"
                f".save_pretrained('{out}')\", the same with AutoTokenizer for its tokenizer, then --model {out}")
    close = difflib.get_close_matches(str(model), list(PRESETS), n=1, cutoff=0.7)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if path.is_dir():
        return f"model folder {str(model)!r} holds no config.json: point --model at a Hugging Face checkpoint's folder{hint}"
    return (f"model {str(model)!r} is neither a preset ({', '.join(PRESETS)}), a config.json file, "
            f"nor a directory holding one{hint}")


def build_model(config, *, seed: int = 0, device: str | torch.device | None = None, dtype=None) -> nn.Module:
    """A causal LM with random weights from `config` (a config object or a preset name).

    `device="meta"` builds it without allocating weights, for planning.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(config, str):
        config = build_config(config)
    torch.manual_seed(seed)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if device is not None and str(device) == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, **kwargs)
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.to(device) if device is not None else model
