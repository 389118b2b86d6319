"""Attention on a context-parallel rank, plugged into the model through transformers' `AttentionInterface`.

Why all-gather of K/V (Llama 3, section 3.3.2) rather than a ring or all-to-all (Ulysses): with
grouped-query attention K and V are `kv_heads / heads` of Q's bytes, the smallest exchange; it splits no
heads (Ulysses spends them, and tp already does), so it composes with tp and kv-head replication; and
every mask (causal, sliding window, packed documents) is a predicate on global token indices, evaluated
for this rank's queries against all keys. The cost is holding the whole sequence's K and V during a
layer (`gather_sequence` has the bytes). The model's own layers run unchanged, calling the function
registered under `NAME`; `sequence_part` cuts a microbatch into what each rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from torch.distributed import ProcessGroup

from ..models.hf_decoder import document_index
from ..tensor_parallel.comm import _Adjoint, all_gather_into, reduce_scatter_into
from .causal_blocks import causal_chunk_attention, runs_unmasked
from .shard import gathered_order, held, shard_sequence

__all__ = ["NAME", "SequenceShard", "sequence_shard", "SequencePart", "sequence_part", "gather_sequence",
           "context_parallel_attention", "register"]

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


@dataclass(frozen=True)
class SequencePart:
    """This rank's part of one microbatch. Positions are the tokens' own (0 .. seq - 1, or a packed row's
    restarting ones), so rotary embeddings see where each token is; `shard` keeps the whole row's documents.
    Each rank's loss sums its own tokens; the runner divides by the global batch's count, so the cp ranks'
    losses add up."""

    ids: torch.Tensor  # [mb, seq / cp]
    positions: torch.Tensor  # [mb, seq / cp]
    shard: SequenceShard
    targets: torch.Tensor | None  # [mb, seq / cp] (None where the stage computes no loss)


def sequence_part(ids: torch.Tensor, positions: torch.Tensor | None, targets: torch.Tensor | None, *,
                  group: ProcessGroup | None, cp: int, rank: int, device: torch.device) -> SequencePart:
    """This rank's part of a microbatch of whole `ids` `[mb, seq]` (and `positions`, `targets` alike)."""
    seq = ids.shape[-1]
    mine = held(seq, cp, rank).expand(ids.shape[0], -1) if positions is None else shard_sequence(positions, cp, rank)
    return SequencePart(
        ids=shard_sequence(ids, cp, rank).to(device),
        positions=mine.to(device),
        shard=sequence_shard(group, cp, rank, seq, device=device, position_ids=positions),
        targets=None if targets is None else shard_sequence(targets, cp, rank).to(device),
    )


def _gather_kv(x: torch.Tensor, group: ProcessGroup, cp: int, seq: int) -> torch.Tensor:
    local = x.permute(2, 0, 1, 3).contiguous()  # (s / cp, b, kv, d): the sequence first, as the exchange cuts
    out = local.new_empty((cp * local.shape[0], *local.shape[1:]))
    all_gather_into(out, local, group)  # rank-major: rank r's two chunks, then r + 1's
    ordered = out.index_select(0, gathered_order(seq, cp, out.device))  # (s, b, kv, d) in token order
    return ordered.permute(1, 2, 0, 3)


def _scatter_kv(grad: torch.Tensor, group: ProcessGroup, cp: int, seq: int) -> torch.Tensor:
    ordered = grad.permute(2, 0, 1, 3)  # (s, b, kv, d), token order
    rank_major = torch.cat([held(seq, cp, r, ordered.device) for r in range(cp)])
    partial = ordered.index_select(0, rank_major).contiguous()  # back to the ranks' order; a private buffer
    mine = partial.new_empty((seq // cp, *partial.shape[1:]))
    reduce_scatter_into(mine, partial, group)  # summed over the ranks' queries, this rank's rows kept
    return mine.permute(1, 2, 0, 3)


def gather_sequence(x: torch.Tensor, group: ProcessGroup, cp: int, seq: int) -> torch.Tensor:
    """`[b, h, seq / cp, d]` on each cp rank -> `[b, h, seq, d]` in token order, the one collective context
    parallelism adds. Backward: each rank's gradient is its own queries' share, so the gradients are
    reduce-scattered. Bytes a rank receives per layer and microbatch, forward: 2 (k and v) x b x kv_heads
    x d x s x (cp - 1) / cp x dtype bytes; backward as many again."""
    return _Adjoint.apply(x, _gather_kv, (group, cp, seq), _scatter_kv, (group, cp, seq))


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
