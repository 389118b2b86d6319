"""All-gather and reduce-scatter along dim 0, over pairwise swaps where that is faster.

On CPU with gloo and a power-of-two group, gloo's reduce-scatter runs a whole all-reduce and keeps a
slice, and its all-gather is a ring; here both take log2(p) rounds of P2P swaps (recursive doubling
for the gather, halving for the reduce-scatter), as `comm.all_reduce_sum` does: at tp = 2, one swap
of half the tensor. Elsewhere torch's `all_gather_single` / `reduce_scatter_single`. Tests count
calls here, whatever the transport.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..torch_internals import traced_all_gather, traced_reduce_scatter
from .comm import _group, group_rank, group_size, swap, swaps, traced

__all__ = ["all_gather_into", "reduce_scatter_into"]


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """`out` (p * n, ...) receives every rank's contiguous `x` (n, ...), in rank order; returns `out`."""
    size, rank = group_size(group), group_rank(group)
    if traced():
        return out.copy_(traced_all_gather(x, 0, _group(group)))
    if not swaps(x, group):
        dist.all_gather_single(out, x, group=group)
        return out
    blocks = out.view(size, *x.shape)  # (p, n, ...): block r is rank r's x
    blocks[rank].copy_(x)
    step = 1
    while step < size:  # after the round of `step`, each rank holds the 2 * step blocks around it
        peer = rank ^ step
        mine, theirs = rank // step * step, peer // step * step
        swap(blocks[mine : mine + step], blocks[theirs : theirs + step], peer, group)
        step *= 2
    return out


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """`out` (n, ...) becomes block `rank` of the sum over ranks of the contiguous `x` (p * n, ...).

    On the swap path `x` is used as scratch space (callers pass a private buffer).
    """
    size, rank = group_size(group), group_rank(group)
    if traced():
        return out.copy_(traced_reduce_scatter(x, 0, _group(group)))
    if not swaps(x, group):
        dist.reduce_scatter_single(out, x, group=group)
        return out
    blocks = x.view(size, *out.shape)  # (p, n, ...): this rank's partial sum of every block
    lo, span = 0, size
    while span > 1:  # keep the half of [lo, lo + span) holding `rank`; send the other half away
        half = span // 2
        peer = rank ^ half
        low = rank < lo + half
        keep = slice(lo, lo + half) if low else slice(lo + half, lo + span)
        give = slice(lo + half, lo + span) if low else slice(lo, lo + half)
        received = torch.empty_like(blocks[keep])
        swap(blocks[give], received, peer, group)
        blocks[keep].add_(received)
        lo, span = keep.start, half
    return out.copy_(blocks[rank])
