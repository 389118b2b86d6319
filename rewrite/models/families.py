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

import torch

__all__ = ["FamilyForward", "family_forward"]


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
    "hyperclovax": FamilyForward(embed_scale=lambda c: c.embedding_multiplier, logits=lambda c, x: x * c.logits_scaling),
}


def family_forward(config) -> FamilyForward:
    """The table's entry for `config.model_type`; plain (nothing around the layers) when it has none."""
    return _FAMILIES.get(getattr(config, "model_type", None), _PLAIN)
