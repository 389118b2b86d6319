"""What the module walker knows of Hugging Face LLaMA-family models.

The backbone is `embed_tokens -> layers[i] -> norm -> lm_head`, with `rotary_emb`
and the causal mask computed from the hidden states. That is enough to run any
contiguous slice of the layers on its own, so only hidden states cross a stage
boundary. Llama, Mistral, Qwen2 and Qwen3 share this shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from .families import family_forward

__all__ = ["Backbone", "find_backbone", "run_backbone"]


@dataclass(frozen=True)
class Backbone:
    """Dotted paths of an HF decoder-only model's parts."""

    base: str  # the base model ("model"), "" when the model is the base model itself
    num_layers: int
    has_head: bool
    norm_first: bool = False  # the final norm also runs before the first layer (`families`: NanoChat)

    def path(self, part: str) -> str:
        """Dotted path of a base-model part: 'embed_tokens', 'layers', 'norm' or 'rotary_emb'."""
        return f"{self.base}.{part}" if self.base else part

    @property
    def head(self) -> str | None:
        return "lm_head" if self.has_head else None

    def layer(self, index: int) -> str:
        return f"{self.path('layers')}.{index}"

    def stage_modules(self, layer_indices: list[int], *, first: bool, last: bool) -> list[str]:
        """Top-level module paths a stage holding `layer_indices` runs, in order."""
        modules = [self.path("embed_tokens")] if first else []
        if first and self.norm_first and not last:
            modules.append(self.path("norm"))
        modules.append(self.path("rotary_emb"))
        modules += [self.layer(i) for i in layer_indices]
        if last:
            modules += [self.path("norm")] + ([self.head] if self.head else [])
        return modules


def find_backbone(model: nn.Module) -> Backbone | None:
    """The backbone of an HF LLaMA-family model (`...ForCausalLM` or the base model), else None."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base, path = model, ""
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        base, path = getattr(model, prefix), prefix
    parts = base._modules
    if not all(name in parts for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    if not isinstance(parts["layers"], (nn.ModuleList, nn.ModuleDict)):
        return None
    return Backbone(
        base=path, num_layers=config.num_hidden_layers, has_head=bool(path) and "lm_head" in model._modules,
        norm_first=family_forward(config).norm_before_layers,
    )


def _attention_kind(config, index: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    # Mistral-style configs: one window for every layer when set.
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


@cache
def _mask_builders():
    from transformers import masking_utils

    return {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    }


@cache
def _mask_params(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _causal_mask(config, kind: str, hidden: torch.Tensor, position_ids: torch.Tensor):
    builders = _mask_builders()
    if kind not in builders:
        raise ValueError(f"attention type {kind!r} (config.layer_types) is not supported by the pipeline walker")
    fn = builders[kind]
    names = _mask_params(fn)
    # The keyword names moved between transformers releases; pass what this one takes.
    kwargs = {"config": config, "attention_mask": None, "position_ids": position_ids}
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
    for cache_name in ("cache", "past_key_values"):
        if cache_name in names:
            kwargs[cache_name] = None
    if "cache_position" in names:
        kwargs["cache_position"] = position_ids[0]
    return fn(**kwargs)


def run_backbone(
    model: nn.Module,
    backbone: Backbone,
    x: torch.Tensor,
    layer_indices: list[int],
    *,
    first: bool,
    last: bool,
    seq_len: int | None = None,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run one stage of the backbone: embeddings (first), the given layers, norm and head (last).

    `x` is `input_ids` `(b, s)` on the first stage, hidden states `(b, s, h)` otherwise
    (`(b, s / tp, h)` under sequence parallelism: then `seq_len` gives s). `head`
    replaces `model.lm_head` (e.g. to keep vocabulary shards). Returns hidden states,
    or logits `(b, s, vocab)` from the last stage.
    """
    base = model.get_submodule(backbone.base) if backbone.base else model
    config, family = model.config, family_forward(model.config)
    hidden = base.embed_tokens(x) if first else x  # (b, s, h)
    if first and family.embed_scale is not None:
        hidden = hidden * family.embed_scale(config)
    if first and family.norm_before_layers:
        hidden = base.norm(hidden)
    seq = hidden.shape[1] if seq_len is None else seq_len
    position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)  # (1, s)
    # Rebuilt on every stage from the hidden states: only they cross the boundary.
    rotary = _rotary(base.rotary_emb, config, hidden, position_ids, layer_indices)
    # The masks read batch, length and dtype from it: the whole sequence's, even when a shard arrived.
    like = hidden if hidden.shape[1] == seq else hidden.new_empty((hidden.shape[0], seq, 0))
    masks: dict[str, torch.Tensor | None] = {}
    for index in layer_indices:
        kind = _attention_kind(config, index)
        if kind not in masks:
            masks[kind] = _causal_mask(config, kind, like, position_ids)
        out = base.layers[str(index) if isinstance(base.layers, nn.ModuleDict) else index](
            hidden,
            attention_mask=masks[kind],
            position_ids=position_ids,
            position_embeddings=rotary(index),
        )
        hidden = out[0] if isinstance(out, tuple) else out  # (b, s, h)
    if last:
        hidden = base.norm(hidden)
        if backbone.head:
            hidden = (head or model.lm_head)(hidden)  # (b, s, vocab), or this rank's vocabulary shard
            if family.logits is not None:
                hidden = family.logits(config, hidden)
    return hidden


@cache
def _takes_layer_type(rotary_class: type) -> bool:
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


def _rotary(rotary_emb: nn.Module, config, hidden: torch.Tensor, position_ids: torch.Tensor, layer_indices: list[int]):
    """`index -> (cos, sin)` for the stage's layers: one table, or one per layer type (Gemma-3's
    `rotary_emb(x, position_ids, layer_type)`), each computed once."""
    if not _takes_layer_type(type(rotary_emb)):
        shared = rotary_emb(hidden, position_ids)
        return lambda index: shared
    types = config.layer_types
    tables = {t: rotary_emb(hidden, position_ids, t) for t in dict.fromkeys(types[i] for i in layer_indices)}
    return lambda index: tables[types[index]]
