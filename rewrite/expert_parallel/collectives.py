"""The collectives of expert parallelism: how many rows go where, and the rows themselves (autograd-aware).

Both are `all_to_all_single` over the expert-parallel group; the row exchange's backward is the same
exchange with the splits reversed. Every rank of the group calls each one, rows or none, so none waits alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["exchange_counts", "exchange_rows"]


def exchange_counts(per_expert: torch.Tensor, ep: int, group: ProcessGroup) -> torch.Tensor:
    """Rows this rank receives, `[ep, E / ep]`: from source rank `s` for local expert `e`, given the rows
    it sends to each of the `E` experts (`per_expert`, int64, experts of rank `r` at `[r * E / ep, ...)`)."""
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert.contiguous(), group=group)
    return received.view(ep, -1)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def exchange_rows(rows: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup) -> torch.Tensor:
    """Rows `[sum(send), ...]`, the first `send[0]` to rank 0 of `group` and so on, exchanged for
    `[sum(receive), ...]` (those from rank 0 first); differentiable."""
    return _Exchange.apply(rows, send, receive, group)
