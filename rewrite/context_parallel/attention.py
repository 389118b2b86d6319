"""Attention on a context-parallel rank, plugged into the model through transformers' `AttentionInterface`.

Why all-gather of K/V (Llama 3, section 3.3.2) rather than a ring or all-to-all (Ulysses): with
grouped-query attention K and V are `kv_heads / heads` of Q's bytes, so gathering them over the
cp ranks is the smallest exchange; it needs no heads to split (Ulysses spends them, and tp already
does), so it composes with tensor parallelism and kv-head replication; and every mask is a
predicate on global token indices, evaluated for this rank's queries against all keys: causal,
sliding window, packed documents. The cost is holding the whole sequence's K and V during a layer
(`collectives.py` has the bytes). The model's own layers run unchanged: the attention function
registered under `NAME` gathers K and V, builds the mask, and hands both to transformers' own SDPA
attention, which picks the CPU kernels or the CUDA ones by device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ..models.hf_llama import document_index
from .collectives import gather_sequence
from .shard import held

__all__ = ["NAME", "SequenceShard", "sequence_shard", "context_parallel_attention", "register"]

NAME = "rewrite_context_parallel"  # config._attn_implementation of a model whose attention runs on sequence shards


@dataclass(frozen=True)
class SequenceShard:
    """What one rank's attention needs to know of the sequence it holds part of (a layer's kwarg)."""

    group: ProcessGroup | None  # the cp ranks (None: cp 1, nothing to gather)
    cp: int
    rank: int
    seq: int  # the whole sequence's length
    queries: torch.Tensor  # [seq / cp]: the global index of each token this rank holds
    documents: torch.Tensor | None  # [b, seq]: each token's document (packed), or None: one a row

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """`[b or 1, 1, seq / cp, seq]` bool: which keys each of this rank's queries attends to."""
        q = self.queries[:, None]  # (s / cp, 1)
        kv = torch.arange(self.seq, device=q.device)[None, :]  # (1, s)
        allowed = kv <= q  # causal, on global indices
        if sliding_window is not None:
            allowed &= kv > q - sliding_window  # transformers' sliding_window_overlay
        allowed = allowed[None, None]  # (1, 1, s / cp, s)
        if self.documents is not None:
            d = self.documents  # (b, s)
            allowed = allowed & (d[:, None, self.queries, None] == d[:, None, None, :])  # (b, 1, s / cp, s)
        return allowed


def sequence_shard(group: ProcessGroup | None, cp: int, rank: int, seq: int, *, device,
                   position_ids: torch.Tensor | None = None) -> SequenceShard:
    """This rank's `SequenceShard` of a microbatch of `seq` tokens; `position_ids` `[b, seq]` (the
    whole sequence's) for packed documents."""
    documents = None if position_ids is None else document_index(position_ids.to(device))
    return SequenceShard(group, cp, rank, seq, held(seq, cp, rank, device), documents)


def context_parallel_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                               sliding_window: int | None = None, **kwargs):
    """transformers' attention signature: `query` `[b, heads, s / cp, d]`, `key`/`value` `[b, kv, s / cp, d]`
    of this rank's tokens; returns `([b, s / cp, heads, d], None)`. `attention_mask` is ignored (the
    model builds none for this implementation): the mask comes from the layer's `sequence_shard` kwarg."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shard: SequenceShard | None = kwargs.pop("sequence_shard", None)
    if shard is None:
        raise RuntimeError(f"attention {NAME!r} ran without its sequence_shard: run the model through its stage "
                           "(rewrite.apply_plan with mesh.cp), which passes it to every layer")
    unsupported = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported:
        raise NotImplementedError(f"context-parallel attention does not take {', '.join(unsupported)} "
                                  f"({type(module).__name__})")
    if shard.cp > 1:
        key = gather_sequence(key, shard.group, shard.cp, shard.seq)  # (b, kv, s, d)
        value = gather_sequence(value, shard.group, shard.cp, shard.seq)
    mask = shard.mask(sliding_window)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=False,
                                  **kwargs)


def register() -> None:
    """Make `NAME` an attention implementation transformers models can be set to (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, context_parallel_attention)
