"""The causal masks a decoder layer takes, built as transformers' own builders build them: per attention kind
(full, sliding window, none for recurrent layers), packed documents attending only within themselves.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch

__all__ = ["RECURRENT_KINDS", "attention_kind", "causal_mask", "document_index"]


def attention_kind(config, index: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    # Mistral-style configs: one window for every layer when set.
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


# Layer types whose layers read no causal mask: recurrent and convolutional layers are causal
# by construction and take only a padding mask, and training batches carry no padding; the
# MLP-only blocks of Nemotron-H ("moe", "mlp") mix nothing across positions.
RECURRENT_KINDS = frozenset({"conv", "linear_attention", "mamba", "recurrent"})
_RECURRENT = RECURRENT_KINDS | {"moe", "mlp"}


@cache
def _mask_builders():
    from transformers import masking_utils

    builders = dict(getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {}))
    builders.setdefault("full_attention", masking_utils.create_causal_mask)
    builders.setdefault("sliding_attention", masking_utils.create_sliding_window_causal_mask)
    return builders


@cache
def _mask_params(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def document_index(position_ids: torch.Tensor) -> torch.Tensor:
    """`[b, s]`: which document of its row each token belongs to: a new one starts wherever a
    position is not its predecessor's plus one (the rule of transformers' packed-sequence
    detection), computed where the positions are, with no read to the host."""
    before = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (before != 1).cumsum(-1)


def causal_mask(config, kind: str, hidden: torch.Tensor, position_ids: torch.Tensor | None, full: bool = False):
    """The mask layers of `kind` take; `position_ids` `[b, s]` given: documents (positions restarting)
    attend only within themselves, as the model's own forward masks them without a cache. `full`: a mask
    tensor even where attention could take its causal flag instead (`FamilyForward.full_mask`)."""
    builders = _mask_builders()
    if kind in _RECURRENT:
        return None
    if kind not in builders:
        raise ValueError(f"attention type {kind!r} (config.layer_types) is not supported by the pipeline walker")
    fn = builders[kind]
    if isinstance(fn, dict):  # a hybrid layer (Falcon-H1): its attention's mask; its recurrent part takes none
        fn = next(f for k, f in fn.items() if k not in _RECURRENT)
    names = _mask_params(fn)
    # The keyword names moved between transformers releases; pass what this one takes.
    # The builder is not given the positions to look for packed documents itself: that look
    # reads a tensor on the host (a device synchronisation per microbatch on a GPU). Documents
    # are the same predicate computed here on the device, given as the mask's extra condition.
    kwargs = {"config": config, "attention_mask": None, "position_ids": None}
    if position_ids is not None:
        if "and_mask_function" in names:
            from transformers.masking_utils import packed_sequence_mask_function

            kwargs["and_mask_function"] = packed_sequence_mask_function(document_index(position_ids))
        else:  # a builder without the extra condition: it finds the documents in the positions itself
            kwargs["position_ids"] = position_ids
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
    for cache_name in ("cache", "past_key_values"):
        if cache_name in names:
            kwargs[cache_name] = None
    if full:
        kwargs["allow_is_causal_skip"] = False
    if "cache_position" in names:  # where each token sits in the row, whatever its document
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return fn(**kwargs)
