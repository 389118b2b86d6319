"""The one collective context parallelism adds: keys and values gathered over the cp ranks.

Forward: each rank's `[b, kv_heads, s / cp, d]` keys (or values) all-gathered into `[b, kv_heads, s, d]`
in global token order. Backward: each rank's gradient is its own queries' share, so the gradients are
reduce-scattered. Bytes a rank receives per layer and microbatch, forward: 2 (k and v) x b x kv_heads
x d x s x (cp - 1) / cp x dtype bytes; backward as many again.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ..tensor_parallel.exchange import all_gather_into, reduce_scatter_into
from .shard import gathered_order, held

__all__ = ["gather_sequence"]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp, seq):
        ctx.group, ctx.cp, ctx.seq = group, cp, seq
        local = x.permute(2, 0, 1, 3).contiguous()  # (s / cp, b, kv, d): the sequence first, as the exchange cuts
        out = local.new_empty((cp * local.shape[0], *local.shape[1:]))
        all_gather_into(out, local, group)  # rank-major: rank r's two chunks, then r + 1's
        ordered = out.index_select(0, gathered_order(seq, cp, out.device))  # (s, b, kv, d) in token order
        return ordered.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad):
        ordered = grad.permute(2, 0, 1, 3)  # (s, b, kv, d), token order
        cp, seq = ctx.cp, ctx.seq
        rank_major = torch.cat([held(seq, cp, r, ordered.device) for r in range(cp)])
        partial = ordered.index_select(0, rank_major).contiguous()  # back to the ranks' order; a private buffer
        mine = partial.new_empty((seq // cp, *partial.shape[1:]))
        reduce_scatter_into(mine, partial, ctx.group)  # summed over the ranks' queries, this rank's rows kept
        return mine.permute(1, 2, 0, 3), None, None, None


def gather_sequence(x: torch.Tensor, group: ProcessGroup, cp: int, seq: int) -> torch.Tensor:
    """`[b, h, seq / cp, d]` on each cp rank -> `[b, h, seq, d]` in token order (autograd: reduce-scatter back)."""
    return _GatherSequence.apply(x, group, cp, seq)
