"""What a Hugging Face family's own forward does beyond embed -> layers -> norm -> head, in one place.

The module walker (`hf_decoder.run_backbone`) reads this table; the oracle guard (`oracle.walker_problem`)
proves per config that both together give the model's own logits, so a wrong or missing entry is refused
instead of training another model. Rotary embeddings chosen per layer type (Gemma-3's
`rotary_emb(x, position_ids, layer_type)`) are read off the module's signature and need no entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.nn import functional as F

from .tiny_clone import tiny_run

__all__ = ["FamilyForward", "embedding_scale", "family_forward", "set_local_kv_groups"]


def _softcap(config, logits: torch.Tensor) -> torch.Tensor:
    # Gemma-2's final_logit_softcapping: cap * tanh(logits / cap); elementwise, so vocabulary shards take it too.
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


@dataclass(frozen=True)
class FamilyForward:
    """The steps of a family's forward around the layers, each a function of the config."""

    embed_scale: Callable[[object], float] | None = None  # hidden = embed(ids) * embed_scale(config)
    norm_before_layers: bool = False  # the final norm also runs on the embeddings (NanoChat)
    logits: Callable[[object, torch.Tensor], torch.Tensor] | None = None  # on the head's output, elementwise
    # config.layer_types entry -> the mask kind its attention takes (Inkling's "hybrid" layers: full attention)
    mask_kinds: tuple[tuple[str, str], ...] = ()
    # the layer types given the rotary tables; None: every layer (Lara's global layers use no position encoding)
    rope_kinds: frozenset[str] | None = None
    # the causal mask built as a tensor even where attention could skip it (Doge adds its dynamic mask onto it)
    full_mask: bool = False
    # `positions(module, config, hidden, position_ids) -> (index -> the layer's position keywords)`, for a family
    # whose forward gives its layers more than one rotary table; `module` is the base model's child `rotary_name`
    positions: Callable[..., Callable[[int], dict]] | None = None
    rotary_name: str | None = None
    # `stage_inputs() -> keywords` every layer of a stage is given, made anew at each stage's start (Gemma-4's
    # store of keys and values a later layer may read: one stage's layers share it, stages do not)
    stage_inputs: Callable[[], dict] | None = None

    def mask_kind(self, layer_type: str) -> str:
        return dict(self.mask_kinds).get(layer_type, layer_type)


_PLAIN = FamilyForward()
_COHERE = FamilyForward(logits=lambda c, x: x * c.logit_scale)
_GRANITE = FamilyForward(embed_scale=lambda c: c.embedding_multiplier, logits=lambda c, x: x / c.logits_scaling)
_FAMILIES: dict[str, FamilyForward] = {
    **dict.fromkeys(["cohere", "cohere2", "cohere2_moe", "cohere_compass"], _COHERE),
    **dict.fromkeys(["granite", "granite_swa", "granitemoe", "granitemoeshared", "granitemoehybrid",
                     "granitemoe_swa"], _GRANITE),
    "gemma2": FamilyForward(logits=_softcap),
    "vaultgemma": FamilyForward(logits=_softcap),
    "nanochat": FamilyForward(norm_before_layers=True, logits=_softcap),
    "falcon_h1": FamilyForward(
        embed_scale=lambda c: c.embedding_multiplier, logits=lambda c, x: x * c.lm_head_multiplier),
    "hyperclovax": FamilyForward(embed_scale=lambda c: c.embedding_multiplier, logits=lambda c, x: x * c.logits_scaling),
    "inkling_text": FamilyForward(  # its head reads the hidden states / logits_mup_width_multiplier (a bias-free head)
        logits=lambda c, x: x / c.logits_mup_width_multiplier,
        mask_kinds=(("hybrid", "full_attention"), ("hybrid_sliding", "sliding_attention"))),
    "lara_mini": FamilyForward(rope_kinds=frozenset({"sliding_attention"})),
    "doge": FamilyForward(full_mask=True),
}


def _by_theta(rotary_embs: nn.ModuleList, config, hidden: torch.Tensor, position_ids: torch.Tensor):
    # GraniteMoE-SWA: one table per base theta, each layer the one of its layer_rope_theta (0: no rotation)
    tables = {r.config.rope_parameters["rope_theta"]: r(hidden, position_ids) for r in rotary_embs}
    return lambda index: {"position_embeddings": tables[t] if (t := config.layer_rope_theta[index]) else None}


def _nope_scaled(rotary_emb: nn.Module, config, hidden: torch.Tensor, position_ids: torch.Tensor):
    # Beam: a layer type without rope parameters runs without rotation, its queries scaled by position instead
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    def at(kind: str) -> dict:
        if config.rope_parameters[kind] is None:
            return {"position_embeddings": None, "attention_scaling": compute_attention_scaling(position_ids)}
        return {"position_embeddings": rotary_emb(hidden, position_ids, kind), "attention_scaling": None}

    tables = {kind: at(kind) for kind in dict.fromkeys(config.layer_types)}
    return lambda index: tables[config.layer_types[index]]


def _kv_store() -> dict:
    from transformers.cache_utils import KVSharingDict

    return {"shared_kv_states": KVSharingDict()}


_FAMILIES.update({
    "gemma4_text": FamilyForward(logits=_softcap, stage_inputs=_kv_store),
    "granitemoe_swa": FamilyForward(embed_scale=_GRANITE.embed_scale, logits=_GRANITE.logits, positions=_by_theta,
                                    rotary_name="rotary_embs"),
    "beam": FamilyForward(logits=_softcap, positions=_nope_scaled, rotary_name="rotary_emb"),
})


def family_forward(config) -> FamilyForward:
    """The table's entry for `config.model_type`; plain (nothing around the layers) when it has none."""
    return _FAMILIES.get(getattr(config, "model_type", None), _PLAIN)


def embedding_scale(module: nn.Module) -> float | None:
    """The factor a scaled embedding's own forward multiplies its lookup by, or None.

    Gemma's `...ScaledWordEmbedding(num_embeddings, embedding_dim, padding_idx, embed_scale)` returns
    `lookup * embed_scale` and keeps it as `scalar_embed_scale`. Checked on a small instance of the
    module's own class, so a class that only looks alike is not taken for one.
    """
    scale = getattr(module, "scalar_embed_scale", None)
    if not isinstance(module, nn.Embedding) or isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return None
    return float(scale) if _scales_lookup(type(module)) else None


@cache
def _scales_lookup(cls: type) -> bool:
    with tiny_run():
        try:
            probe = cls(16, 4, None, embed_scale=3.0)
            ids = torch.randint(0, 16, (2, 5))
            return torch.equal(probe(ids), F.embedding(ids, probe.weight) * 3.0)
        except Exception:  # another constructor or forward: not the pattern
            return False


def set_local_kv_groups(attention: nn.Module, heads: int, kv_heads: int) -> None:
    """Tell an attention module how many query heads read each kv head on its rank, in place.

    HF attention repeats each kv head `num_key_value_groups` times (`repeat_kv`). With kv heads
    replicated a rank holds `heads` query heads (`H / tp`) against `kv_heads` (one) whole kv heads.
    Head counts, not feature counts: a q_proj may carry a gate beside its queries (Qwen3-Next).
    """
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{type(attention).__name__}: {heads} query heads do not fill {kv_heads} kv heads evenly")
    attention.num_key_value_groups = heads // kv_heads
