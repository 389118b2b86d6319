"""Attention on a context-parallel rank, plugged into the model through transformers' `AttentionInterface`.

Why all-gather of K/V (Llama 3, section 3.3.2) rather than a ring or all-to-all (Ulysses): with
grouped-query attention K and V are `kv_heads / heads` of Q's bytes, the smallest exchange; it splits no
heads (Ulysses spends them, and tp already does), so it composes with tp and kv-head replication; and
every mask (causal, sliding window, packed documents) is a predicate on global token indices, evaluated
for this rank's queries against all keys. The cost is holding the whole sequence's K and V during a
layer (`collectives.py` has the bytes). The model's own layers run unchanged, calling the function
registered under `NAME`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from torch.distributed import ProcessGroup

from ..models.hf_decoder import document_index
from .causal_blocks import causal_chunk_attention, runs_unmasked
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
    # (sliding window, dtype) -> each block's additive mask: built once a microbatch, one tensor per
    # block for every layer, so the attention kernels' saved copies of it are one storage, not one a layer
    _masks: dict = field(default_factory=dict, compare=False, repr=False)

    def unmasked(self, sliding_window: int | None) -> bool:
        """Whether every chunk's mask is the plain causal one: no packed documents, no window cutting into
        the keys a chunk sees (`causal_blocks` then needs no mask)."""
        return self.documents is None and (sliding_window is None or sliding_window >= self.seq)

    def blocks(self, sliding_window: int | None) -> list[tuple[slice, int, int]]:
        """(this rank's queries, first key, end key) per chunk it holds: a chunk of global queries
        [a, a + L) attends keys [0, a + L) at most (causal), [a - window + 1, a + L) with a window,
        so the keys past it, or too far before it, are never computed."""
        length = self.seq // (2 * self.cp)
        out = []
        for i, start in enumerate((self.rank * length, (2 * self.cp - 1 - self.rank) * length)):
            first = max(0, start - sliding_window + 1) if sliding_window is not None else 0
            out.append((slice(i * length, (i + 1) * length), first, start + length))
        return out

    def masks(self, sliding_window: int | None, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per block, 0 where a query attends a key and -inf elsewhere, `[b or 1, 1, L, keys]` (cached)."""
        key = (sliding_window, dtype)
        if key not in self._masks:
            allowed = self.mask(sliding_window)  # (b or 1, 1, s / cp, s)
            self._masks[key] = [
                torch.zeros_like(allowed[:, :, rows, first:end], dtype=dtype).masked_fill_(
                    ~allowed[:, :, rows, first:end], float("-inf"))
                for rows, first, end in self.blocks(sliding_window)]
        return self._masks[key]

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
    of this rank's tokens; returns `([b, s / cp, heads, d], None)`. `attention_mask` is ignored (the model
    builds none for this implementation): the mask comes from the layer's `sequence_shard` kwarg.
    Each of the rank's two chunks of queries runs against the keys it can see, grouped keys kept grouped:
    under the plain causal mask on CPU without a mask (`causal_blocks`), otherwise through torch's SDPA
    with one additive mask tensor per chunk and microbatch (packed documents, a window, other devices)."""
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
    blocks = shard.blocks(sliding_window)
    if shard.unmasked(sliding_window) and runs_unmasked(query, dropout):
        outs = [causal_chunk_attention(query[:, :, rows], key, value, end - (rows.stop - rows.start), scaling)
                for rows, _, end in blocks]
    else:  # each chunk of queries against the keys it can see: the rest of the sequence is never computed
        grouped = query.shape[1] != key.shape[1]
        outs = [F.scaled_dot_product_attention(query[:, :, rows], key[:, :, first:end], value[:, :, first:end],
                                               attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=grouped)
                for (rows, first, end), mask in zip(blocks, shard.masks(sliding_window, query.dtype))]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `NAME` an attention implementation transformers models can be set to (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, context_parallel_attention)
