"""What a Hugging Face family's own forward does beyond embed -> layers -> norm -> head, in one place.

The module walker (`hf_llama.run_backbone`) reads this table; the oracle guard
(`oracle.walker_problem`) then proves, per config, that walker and table together give
the model's own logits, so an entry that is wrong, or a family that needs one and has
none, is refused instead of training another model. Rotary embeddings chosen per layer
type (Gemma-3's `rotary_emb(x, position_ids, layer_type)`) are read off the module's own
signature and need no entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.nn import functional as F

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

    @property
    def plain(self) -> bool:
        return self.embed_scale is None and not self.norm_before_layers and self.logits is None


_PLAIN = FamilyForward()
_FAMILIES: dict[str, FamilyForward] = {
    "cohere": FamilyForward(logits=lambda c, x: x * c.logit_scale),
    "cohere2": FamilyForward(logits=lambda c, x: x * c.logit_scale),
    "gemma2": FamilyForward(logits=_softcap),
    "vaultgemma": FamilyForward(logits=_softcap),
    "nanochat": FamilyForward(norm_before_layers=True, logits=_softcap),
    "granite": FamilyForward(embed_scale=lambda c: c.embedding_multiplier, logits=lambda c, x: x / c.logits_scaling),
    "falcon_h1": FamilyForward(
        embed_scale=lambda c: c.embedding_multiplier, logits=lambda c, x: x * c.lm_head_multiplier),
    "hyperclovax": FamilyForward(embed_scale=lambda c: c.embedding_multiplier, logits=lambda c, x: x * c.logits_scaling),
}


def family_forward(config) -> FamilyForward:
    """The table's entry for `config.model_type`; plain (nothing around the layers) when it has none."""
    return _FAMILIES.get(getattr(config, "model_type", None), _PLAIN)


def embedding_scale(module: nn.Module) -> float | None:
    """The factor a scaled embedding's own forward multiplies its lookup by, or None.

    Gemma's `...ScaledWordEmbedding(num_embeddings, embedding_dim, padding_idx, embed_scale)`
    returns `lookup * embed_scale` (a float32 scalar cast to the weight's dtype) and keeps the
    factor as `scalar_embed_scale`. Checked on a small instance of the module's own class,
    so a class that only looks alike is not taken for one (None).
    """
    scale = getattr(module, "scalar_embed_scale", None)
    if not isinstance(module, nn.Embedding) or isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return None
    return float(scale) if _scales_lookup(type(module)) else None


@cache
def _scales_lookup(cls: type) -> bool:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        try:
            probe = cls(16, 4, None, embed_scale=3.0)
            ids = torch.randint(0, 16, (2, 5))
            return torch.equal(probe(ids), F.embedding(ids, probe.weight) * 3.0)
        except Exception:  # another constructor or forward: not the pattern
            return False


def set_local_kv_groups(attention: nn.Module, heads: int, kv_heads: int) -> None:
    """Tell an attention module how many query heads read each kv head on its rank, in place.

    HF attention repeats each key/value head `num_key_value_groups` times to meet its query
    heads (`repeat_kv`). Splitting both tp ways keeps the ratio; with kv heads replicated a
    rank holds `heads` query heads (`H / tp`) against `kv_heads` (one) whole kv heads, so
    the ratio becomes `heads / kv_heads` there. Head counts, not feature counts: a q_proj
    may carry a gate beside its queries (Qwen3-Next).
    """
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{type(attention).__name__}: {heads} query heads do not fill {kv_heads} kv heads evenly")
    attention.num_key_value_groups = heads // kv_heads
