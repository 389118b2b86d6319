"""Gradient clipping on the global norm of a model split over tp, pp and dp: the norm
`torch.nn.utils.clip_grad_norm_` would compute on the whole, unsharded model.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..binding.shard_layout import split_of
from ..errors import InputError
from ..lent import lend
from .stage import Stage

__all__ = ["clip_grad_norm_"]

_EPS = 1e-6  # added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does


def clip_grad_norm_(stage: Stage, max_norm: float | None, *, norm_type: float = 2.0) -> torch.Tensor:
    """Measure the gradient norm of the whole model and clip this rank's gradients to it, in place.

    Each gradient element of the unsharded model counts once, wherever it lives: each parameter's
    `ParamSplit` (attached by `apply_plan`, read with `binding.shard_layout.split_of`) says
    whether this rank's copy is the one that counts:

    - tensor parallel: a split weight `W = [W_1; ...; W_tp]` contributes `sum_i ||W_i||^2`,
      one slice per tp rank; a weight whole on every tp rank (equal gradients) only from
      tp_rank 0; a k/v projection past its kv heads, split `tp / r` ways and each slice held
      by `r` neighbouring tp ranks, on `tp_rank % r == 0`.
    - pipeline: a rank's own stages; a tied embedding (`stage.tied`) once, on the first stage.
    - data parallel: a gradient sharded over dp (FSDP2) contributes every shard; one replicated
      over dp (a DTensor, or a plain tensor under DDP) only on dp_rank 0. cp ranks count as replicas.
    - experts split over tp (`expert_tensor_parallel`): every tensor a slice on each tp rank.
    - expert parallel: each expert block once, on copy 0 (`mesh.expert_copy`) at cp_rank 0.

    The total is `sqrt(sum of squares)` over every rank (norm_type 2) or `max |g|` (inf): one
    all-reduce of one float32 tensor on the default group. When `max_norm / (total + 1e-6) < 1`,
    every local gradient (replicas included) is scaled by it, so all copies stay equal. A
    non-finite total is returned as is (scaling the gradients to 0 or NaN), as torch does.

    Collective: every rank calls it after `run_schedule`, before the optimizer step. Parameters
    without a gradient are skipped.

    Args:
        stage: this rank's `Stage`, from `apply_plan`.
        max_norm: the largest total norm allowed; None only measures.
        norm_type: 2 (Euclidean) or `float("inf")` (largest absolute value).

    Returns:
        The total norm before clipping: a float32 scalar, the same on every rank, on the
        stage's device.

    Raises:
        TypeError: `stage` is not a Stage, or `max_norm` is not a number.
        ValueError: `max_norm` is not positive (or NaN), or a norm_type other than 2 or
            inf (before any collective); a gradient still partial over dp, not yet reduced
            (after the one all-reduce, on every rank alike).
        InputError: a parameter carries no split (not placed by `apply_plan`), likewise
            after the all-reduce.

    Example:
        >>> loss = rewrite.run_schedule(stage, ids, targets)
        >>> total = clip_grad_norm_(stage, 1.0)          # on every rank
        >>> optimizer.step()
    """
    norm_type = _check(stage, max_norm, norm_type)
    grads, counted, partial, unplaced = [], [], [], None
    for name, param in stage.module.named_parameters():  # a tied object once
        if param.grad is None:
            continue
        grad = param.grad
        if isinstance(grad, DTensor):  # its shards over dp x cp are in its placements; Partial: not yet reduced
            if not all(isinstance(p, (Shard, Replicate)) for p in grad.placements):
                partial.append(name)
                continue
            with torch.no_grad():  # to_local without autograd is the shard itself, not a temporary view
                grad = grad.to_local()
        grads.append(grad)
        try:
            if split_of(param).counts:  # this rank's copy is the one that counts, of every rank holding it
                counted.append(grad)
        except InputError as exc:
            unplaced = exc  # raised after the collective, on every rank alike
    device = grads[0].device if grads else stage.device
    # Packed: [this rank's sum of squares (or max), its unreduced gradients, its parameters without a split].
    packed = torch.zeros(3, dtype=torch.float32, device=device)
    packed[1], packed[2] = len(partial), unplaced is not None
    if counted:
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for g in counted])
        packed[0] = norms.max() if math.isinf(norm_type) else norms.square().sum()
    dist.all_reduce(packed, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    lend(packed)
    if packed[1] > 0:  # every rank learns it from the same collective and raises alike
        held = f"; this rank's: {', '.join(partial[:3])}" if partial else ""
        raise ValueError(
            "clip_grad_norm_: some gradients are still partial sums over data-parallel ranks (not yet "
            f"reduced){held}; call it after run_schedule, which reduces them once per step"
        )
    if packed[2] > 0:
        raise unplaced or InputError("clip_grad_norm_: parameters of other ranks carry no split; see their error")
    total = packed[0].clone() if math.isinf(norm_type) else packed[0].sqrt()
    if max_norm is not None and grads:
        coef = (max_norm / (total + _EPS)).clamp(max=1.0)  # 1.0 leaves a gradient unchanged
        with torch.no_grad():
            for grad in grads:
                grad.mul_(coef.to(grad.device))
    return total


def _check(stage: Stage, max_norm, norm_type) -> float:
    """The norm type as a float; TypeError / ValueError for bad arguments (no collective yet)."""
    if not isinstance(stage, Stage):
        raise TypeError(f"clip_grad_norm_: expected the Stage that apply_plan returned, got {type(stage).__name__}")
    if max_norm is not None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, Real):
            raise TypeError(f"clip_grad_norm_: max_norm must be a number or None, got {type(max_norm).__name__}")
        if math.isnan(max_norm) or max_norm <= 0:
            raise ValueError(
                f"clip_grad_norm_: max_norm must be > 0, got {max_norm}; pass e.g. 1.0, or None to only measure"
            )
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = None
    if isinstance(norm_type, bool) or value not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be 2 or float('inf'), got {norm_type!r}")
    return value
