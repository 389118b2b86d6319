"""What the module walker knows of Hugging Face decoder-only models.

The backbone is `embedding -> (dropout) -> layers[i] -> norm -> lm_head`, with the rotary embedding
(recurrent hybrids such as Jamba have none) and the causal masks computed from the hidden states: enough
to run any contiguous slice of the layers on its own, so only hidden states cross a stage boundary.
What a family's forward does beyond this shape is in `families.py`; `oracle.py` proves the two together.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from .causal_masks import RECURRENT_KINDS, attention_kind, causal_mask, document_index
from .families import family_forward

__all__ = ["RECURRENT_KINDS", "Backbone", "backbone_problem", "document_index", "find_backbone", "meta_model",
           "run_backbone"]


@dataclass(frozen=True)
class Backbone:
    """Dotted paths of an HF decoder-only model's parts, as the model names them: LLaMA's
    `model.embed_tokens`, `model.layers`, `model.norm`; GPT-NeoX's `gpt_neox.embed_in`, ...; GPT-J's
    `transformer.wte`, `transformer.h`, `transformer.ln_f`.
    """

    base: str  # the base model ("model"), "" when the model is the base model itself
    num_layers: int
    embed: str  # the token embedding
    layers: str  # the ModuleList of decoder layers
    norm: str  # the final norm
    rotary: str | None  # the rotary embedding, rebuilt on every stage; None when the model has none
    head: str | None = None  # the LM head, None on a base model
    after_embed: tuple[str, ...] = ()  # run on the embeddings before the first layer (dropout)
    norm_first: bool = False  # the final norm also runs before the first layer (`families`: NanoChat)

    @property
    def has_head(self) -> bool:
        return self.head is not None

    def layer(self, index: int) -> str:
        return f"{self.layers}.{index}"

    def stage_modules(self, layer_indices: list[int], *, first: bool, last: bool) -> list[str]:
        """Top-level module paths a stage holding `layer_indices` runs, in order."""
        modules = [self.embed, *self.after_embed] if first else []
        if first and self.norm_first and not last:
            modules.append(self.norm)
        if self.rotary is not None:
            modules.append(self.rotary)
        modules += [self.layer(i) for i in layer_indices]
        if last:
            modules += [self.norm] + ([self.head] if self.head else [])
        return modules


def find_backbone(model: nn.Module) -> Backbone | None:
    """The backbone of an HF decoder-only model (`...ForCausalLM` or the base model), else None.

    The parts come from the config's `base_model_pp_plan` (embedding, what runs on the embeddings, the
    layers, the final norm, in order), else by kind: the one embedding, layer list and norm.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return None
    base, path = _base_of(model)
    named = family_forward(config).rotary_name
    rotary = named if named and isinstance(base._modules.get(named), nn.Module) else _rotary_name(base)
    parts = _declared_parts(base, getattr(type(config), "base_model_pp_plan", None), rotary) or _parts_by_kind(
        base, rotary)
    if parts is None:
        return None
    embed, after, layers, norm, rotary = parts
    if not rotary and set(n for n, m in base._modules.items() if m is not None) - {embed, *after, layers, norm}:
        return None  # no rotary embedding and a part of its own (Inkling-2's final_input): not this backbone
    head = "lm_head" if path and isinstance(model._modules.get("lm_head"), nn.Module) else None

    def full(name: str) -> str:
        return f"{path}.{name}" if path else name

    return Backbone(
        # the layers the list holds: LongCat-Flash counts two sublayers each in num_hidden_layers
        base=path, num_layers=min(len(base.get_submodule(layers)), config.num_hidden_layers), embed=full(embed),
        layers=full(layers), norm=full(norm),
        rotary=full(rotary) if rotary else None, head=head, after_embed=tuple(full(a) for a in after),
        norm_first=family_forward(config).norm_before_layers,
    )


def meta_model(config, **kwargs) -> nn.Module:
    """The causal LM of `config` (`from_config`'s `kwargs`) with no storage: enough to bind a plan to."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def backbone_problem(model: nn.Module) -> str | None:
    """Why `find_backbone` finds no backbone in a Hugging Face model, in one line; None when it finds one
    or `model` is not a Hugging Face model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers") or find_backbone(model) is not None:
        return None
    base, _ = _base_of(model)
    declared = list(getattr(type(config), "base_model_pp_plan", None) or {})
    had = ", ".join(base._modules) or "nothing"
    wanted = (f"the parts its config's base_model_pp_plan declares ({', '.join(declared)}) and at most one rotary "
              "embedding" if declared else
              "one embedding, one list of layers, one final norm and at most one rotary embedding (without one, "
              "nothing else)")
    return f"the module walker runs {wanted}; {type(base).__name__} holds {had}"


def _base_of(model: nn.Module) -> tuple[nn.Module, str]:
    """The base model and its attribute name: `base_model_prefix`'s, else `model` (Llama 4's causal LM names
    its prefix `language_model` and holds `model`); the model itself and "" when it is the base."""
    for name in (getattr(model, "base_model_prefix", ""), "model"):
        if name and isinstance(model._modules.get(name), nn.Module):
            return model._modules[name], name
    return model, ""


def _rotary_name(base: nn.Module) -> str | None:
    """The rotary embedding's name (LFM2 calls it `pos_emb`), "" when the model has none, None when it has
    several (one per layer kind or base: the walker does not know which layer takes which)."""
    names = [n for n, m in base._modules.items() if m is not None and ("rotary" in n or "Rotary" in type(m).__name__)]
    return (names[0] if names else "") if len(names) < 2 else None


def _declared_parts(base: nn.Module, pp_plan, rotary: str | None) -> tuple | None:
    """(embed, after_embed, layers, norm, rotary) from a `base_model_pp_plan`, or None when it does not fit."""
    names = list(pp_plan or {})
    children = base._modules
    if rotary is None or not names or not all(isinstance(children.get(n), nn.Module) for n in names):
        return None
    lists = [i for i, n in enumerate(names) if isinstance(children[n], (nn.ModuleList, nn.ModuleDict))]
    if len(lists) != 1 or "input_ids" not in pp_plan[names[0]][0] or lists[0] != len(names) - 2:
        return None
    return names[0], tuple(names[1 : lists[0]]), names[lists[0]], names[-1], rotary


def _parts_by_kind(base: nn.Module, rotary: str | None) -> tuple | None:
    """(embed, (), layers, norm, rotary) read off the kinds of the base model's children, or None."""
    children = base._modules
    embeds = [n for n, m in children.items() if isinstance(m, nn.Embedding)]
    lists = [n for n, m in children.items() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and n != rotary]
    norms = [n for n in children if "norm" in n or n.startswith("ln_")]
    if rotary is None or len(embeds) != 1 or len(lists) != 1 or len(norms) != 1:
        return None
    return embeds[0], (), lists[0], norms[0], rotary


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
    position_ids: torch.Tensor | None = None,
    layer_kwargs: dict | None = None,
) -> torch.Tensor:
    """Run one stage of the backbone: embeddings (first), the given layers, norm and head (last).

    `x` is `input_ids` `(b, s)` on the first stage, hidden states `(b, s, h)` otherwise
    (`(b, s / tp, h)` under sequence parallelism: then `seq_len` gives s). `head`
    replaces `model.lm_head` (e.g. to keep vocabulary shards). `position_ids` `(b, s)`:
    each token's position in its document (packed documents restart at 0 and attend only
    within themselves); default 0 .. s - 1 in every row. `layer_kwargs`: passed to every
    decoder layer, which hands them on to its attention function (a context-parallel rank's
    `sequence_shard`). Returns hidden states, or logits `(b, s, vocab)` from the last stage.
    """
    part = model.get_submodule
    config, family = model.config, family_forward(model.config)
    hidden = x
    if first:
        hidden = part(backbone.embed)(x)  # (b, s, h)
        if family.embed_scale is not None:
            hidden = hidden * family.embed_scale(config)
        for name in backbone.after_embed:  # the family's dropout on the embeddings
            hidden = part(name)(hidden)
        if family.norm_before_layers:
            hidden = part(backbone.norm)(hidden)
    seq = hidden.shape[1] if seq_len is None else seq_len
    documents = position_ids is not None
    if documents:
        position_ids = position_ids.to(hidden.device)  # (b, s)
    else:
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)  # (1, s)
    # Rebuilt on every stage from the hidden states: only they cross the boundary.
    if family.positions is not None:  # the family's own position inputs per layer
        positions = family.positions(part(backbone.rotary), config, hidden, position_ids)
    else:
        rotary = _rotary(backbone.rotary and part(backbone.rotary), config, hidden, position_ids, layer_indices,
                         family.rope_kinds)
        positions = lambda index: {"position_embeddings": rotary(index)}  # noqa: E731
    # The masks read batch, length and dtype from it: the whole sequence's, even when a shard arrived.
    like = hidden if hidden.shape[1] == seq else hidden.new_empty((hidden.shape[0], seq, 0))
    masks: dict[str, torch.Tensor | None] = {}
    layers = part(backbone.layers)
    shared = family.stage_inputs() if family.stage_inputs is not None else {}
    for index in layer_indices:
        kind = family.mask_kind(attention_kind(config, index))
        if kind not in masks:
            masks[kind] = causal_mask(config, kind, like, position_ids if documents else None, family.full_mask)
        out = layers[str(index) if isinstance(layers, nn.ModuleDict) else index](
            hidden,
            attention_mask=masks[kind],
            position_ids=position_ids,
            **positions(index),
            **shared,
            **(layer_kwargs or {}),
        )
        hidden = out[0] if isinstance(out, tuple) else out  # (b, s, h)
    if last:
        hidden = part(backbone.norm)(hidden)
        if backbone.head:
            hidden = (head or part(backbone.head))(hidden)  # (b, s, vocab), or this rank's vocabulary shard
            if family.logits is not None:
                hidden = family.logits(config, hidden)
    return hidden


@cache
def _takes_layer_type(rotary_class: type) -> bool:
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


def _rotary(rotary_emb: nn.Module | None, config, hidden: torch.Tensor, position_ids: torch.Tensor,
            layer_indices: list[int], kinds: frozenset[str] | None = None):
    """`index -> (cos, sin)` for the stage's layers: one table, or one per layer type (Gemma-3's
    `rotary_emb(x, position_ids, layer_type)`), each computed once; None for a layer type the rotary
    module has no table for (LFM's convolution layers) or outside `kinds` (`FamilyForward.rope_kinds`),
    and for every layer of a model without one."""
    if rotary_emb is None:
        return lambda index: None
    if not _takes_layer_type(type(rotary_emb)):
        shared = rotary_emb(hidden, position_ids)
        if kinds is not None:
            return lambda index: shared if config.layer_types[index] in kinds else None
        return lambda index: shared
    types, rotated = config.layer_types, getattr(rotary_emb, "layer_types", None)
    wanted = [t for t in dict.fromkeys(types[i] for i in layer_indices)
              if (rotated is None or t in rotated) and (kinds is None or t in kinds)]
    tables = {t: rotary_emb(hidden, position_ids, t) for t in wanted}
    return lambda index: tables.get(types[index])
