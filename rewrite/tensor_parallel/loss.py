"""Cross-entropy over vocabulary-parallel logits: each rank holds a `[..., V/tp]` slice and
the full `[tokens, V]` logits are never built (one small all-gather of `[2, tokens]`).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ..values import is_int
from .comm import all_gather_into, group_size

__all__ = ["IGNORE_INDEX", "vocab_parallel_cross_entropy"]

IGNORE_INDEX = -100  # the target cross-entropy skips (torch's default)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean (or sum) over non-ignored tokens `t` of `lse_t - z[t, y_t]`, with `lse_t = log sum_j exp z[t, j]`.

    Rank `i` holds columns `[s_i, s_i + n)`. Forward: each rank's `lse_i,t` over its columns and
    `z[t, y_t]` where it owns `y_t` (0 elsewhere), in one all-gather of a `[2, tokens]` tensor; then on
    every rank alike, in the same order, `lse_t = logsumexp_i lse_i,t` and the target logit as their sum.
    Backward needs no communication: `dL/dz[t, j] = (softmax(z_t)_j - 1[j = y_t]) * grad / count` for the
    local columns `j`, recomputed from the saved logits and `lse_t` (no float32 softmax is kept); a sum divides by 1.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, ignore_index, summed):
        n = logits.shape[-1]
        z = logits.reshape(-1, n)  # (tokens, V / tp), logits' dtype
        y = targets.reshape(-1)  # (tokens,)
        kept = y != ignore_index
        local = y.long() - vocab_start  # gather and scatter take int64 indices
        owned = kept & (local >= 0) & (local < n)
        local = local.masked_fill(~owned, 0)
        zf = z.detach().float()
        mine = torch.stack([
            torch.logsumexp(zf, dim=-1),  # over this rank's columns
            zf.gather(1, local.unsqueeze(-1)).squeeze(-1).masked_fill_(~owned, 0.0),
        ])  # (2, tokens)
        if group_size(group) > 1:
            every = all_gather_into(mine.new_empty((group_size(group) * 2, mine.shape[1])), mine, group)
            every = every.view(-1, 2, mine.shape[1])  # (tp, 2, tokens), in rank order
            lse, target = torch.logsumexp(every[:, 0], dim=0), every[:, 1].sum(dim=0)
        else:
            lse, target = mine.unbind(0)
        per_token = (lse - target).masked_fill_(~kept, 0.0)
        count = torch.ones((), dtype=torch.int64, device=kept.device) if summed else kept.sum()
        ctx.save_for_backward(logits, lse, local, owned, kept, count)
        # 0 / 0 = nan when every token is ignored, as F.cross_entropy gives (a sum is 0 then).
        return per_token.sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, lse, local, owned, kept, count = ctx.saved_tensors
        n = logits.shape[-1]
        p = (logits.reshape(-1, n).float() - lse.unsqueeze(-1)).exp_()  # (tokens, V / tp): softmax slice
        p.scatter_add_(1, local.unsqueeze(-1), -owned.to(p.dtype).unsqueeze(-1))  # - one-hot
        # Ignored rows get 0, also when all are (count = 0): F.cross_entropy's gradient then.
        p.mul_(grad.float() / count).masked_fill_(~kept.unsqueeze(-1), 0.0)
        return p.to(logits.dtype).reshape(logits.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    vocab_start: int,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean (or summed) cross-entropy when each rank of `group` holds a slice of the vocabulary.

    Equal to `F.cross_entropy(full.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index,
    reduction=reduction)`, `full` every rank's slice concatenated: in float32, averaged over the
    non-ignored tokens (nan when all are ignored) or summed, the same on every rank. Collective.

    Args:
        logits: `[..., V/tp]`, this rank's columns `[vocab_start, vocab_start + V/tp)`
            of the logits (e.g. a `ColumnParallelLinear(gather_output=False)` head).
        targets: `[...]`, the full targets on every rank: class ids in `[0, V)` or ignore_index
            (other ids are not detected here: check them before the step, as pipeline/inputs does).
        group: the tensor-parallel group (default: the default group; world size 1 without an
            initialised process group, where this is F.cross_entropy).
        vocab_start: the first vocabulary id of this rank's slice.
        ignore_index: targets with this value add nothing to the loss or gradients.
        reduction: "mean" over the non-ignored tokens, or their "sum" (to divide by a count
            of your own, e.g. a whole batch's trained tokens).

    Returns:
        A float32 scalar; its gradient reaches `logits` in their dtype.

    Raises:
        TypeError: non-floating logits, non-integer targets, or a non-int vocab_start.
        ValueError: targets whose shape is not `logits.shape[:-1]`, a negative vocab_start, or a
            reduction other than "mean" and "sum".

    Example:
        >>> full, y = torch.randn(4, 10), torch.tensor([1, 9, -100, 3])
        >>> loss = vocab_parallel_cross_entropy(full, y, vocab_start=0)  # world size 1
        >>> torch.allclose(loss, torch.nn.functional.cross_entropy(full, y))
        True
    """
    if not torch.is_floating_point(logits):
        raise TypeError(f"vocab_parallel_cross_entropy: logits must be floating point, got {logits.dtype}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"vocab_parallel_cross_entropy: targets must be int32/int64 class ids, got {targets.dtype}")
    if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"vocab_parallel_cross_entropy: targets have shape {tuple(targets.shape)}, expected logits.shape[:-1] "
            f"= {tuple(logits.shape[:-1])} (logits {tuple(logits.shape)}); pass one target per row of logits"
        )
    for name, value in (("vocab_start", vocab_start), ("ignore_index", ignore_index)):
        if not is_int(value):
            raise TypeError(f"vocab_parallel_cross_entropy: {name} must be an int, got {type(value).__name__}")
    if vocab_start < 0:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_start must be >= 0, got {vocab_start}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, ignore_index, reduction == "sum")
