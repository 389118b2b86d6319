"""Gradient clipping on the global norm of a model split over tp, pp and dp: the norm
`torch.nn.utils.clip_grad_norm_` would compute on the whole, unsharded model.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..expert_parallel import expert_parameters
from ..expert_parallel.tensor import ExpertTensorParallelMixin
from ..lent import lend
from ..tensor_parallel.head_params import split_parameter_ids
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.vocab import VocabParallelEmbedding
from .stage import Stage

__all__ = ["clip_grad_norm_"]

_EPS = 1e-6  # added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does


def clip_grad_norm_(stage: Stage, max_norm: float | None, *, norm_type: float = 2.0) -> torch.Tensor:
    """Measure the gradient norm of the whole model and clip this rank's gradients to it, in place.

    Each gradient element of the unsharded model is counted once, wherever it lives:

    - tensor parallel: a split weight `W = [W_1; ...; W_tp]` contributes `sum_i ||W_i||^2`,
      one slice per tp rank; a weight whole on every tp rank (norms, row biases; their
      gradients are equal across tp) only from tp_rank 0. A k/v projection past its kv
      heads is split `tp / r` ways, each slice held by `r` neighbouring tp ranks (gradients
      already summed over them): it counts on the first of each, `tp_rank % r == 0`.
    - pipeline: each rank holds its own stages' parameters; a tied embedding held by the
      first and the last pipeline rank (`stage.tied`, gradients already summed) counts
      once, on the first.
    - data parallel: a gradient sharded over dp (FSDP2 DTensors) contributes every shard;
      one replicated over dp (`sharding: replicate`, already averaged: a DTensor, or a
      plain tensor under DDP) only once, on dp_rank 0. The cp ranks of a stage hold the same
      parameters as replicas do (FSDP2 shards them over dp x cp): counted alike.
    - experts split over tp (`expert_tensor_parallel`): every tensor a slice on each tp rank.
    - expert parallel: an ep group (ep of a stage's dp x tp ranks) holds every expert once,
      one block a rank; the same block on the other ep groups of the stage and on the other
      cp ranks (`mesh.expert_copy`, `cp_rank`) counts once, on copy 0 at cp_rank 0.

    With norm_type 2 the total is `sqrt(sum of squares)` over every rank, with inf
    `max |g|`: one all-reduce of one float32 tensor on the default group. When
    `max_norm / (total + 1e-6) < 1`, every local gradient (replicas included) is scaled
    by it, so all copies of a gradient stay equal. A non-finite total is returned as is
    (and then scales the gradients to 0 or NaN), as torch does by default.

    Collective: every rank of the default group calls it after the step's backward
    (`run_schedule`) and before the optimizer step. Parameters without a gradient are skipped.

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

    Example:
        >>> loss = rewrite.run_schedule(stage, ids, targets)
        >>> total = clip_grad_norm_(stage, 1.0)          # on every rank
        >>> optimizer.step()
    """
    norm_type = _check(stage, max_norm, norm_type)
    mesh = stage.mesh
    split = _tp_split_ids(stage.module, mesh.tp_rank) if mesh.tp > 1 else set()
    not_mine = {id(p) for p in stage.tied} if not stage.is_first else set()
    experts = {id(p) for p in expert_parameters(stage.module)}
    grads, counted, partial = [], [], []
    for name, param in stage.module.named_parameters():  # a tied object once
        if param.grad is None:
            continue
        expert = id(param) in experts  # its copies: the stage's ep groups (over dp x tp) times cp
        replica = mesh.expert_copy if expert else mesh.dp_rank
        grad, once = _local_grad(param, replica + mesh.cp_rank)  # 0 on the first of the dp x cp copies
        if once is None:
            partial.append(name)
            continue
        grads.append(grad)
        # A copy held elsewhere too counts on exactly one rank.
        if once and (expert or id(param) in split or mesh.tp_rank == 0) and id(param) not in not_mine:
            counted.append(grad)
    device = grads[0].device if grads else stage.device
    # Packed: [this rank's sum of squares (or max), its count of unreduced gradients].
    packed = torch.zeros(2, dtype=torch.float32, device=device)
    packed[1] = len(partial)
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


def _tp_split_ids(module: nn.Module, tp_rank: int) -> set[int]:
    """Ids of the parameters split over tp that count on tp rank `tp_rank`: column weight and
    bias, row weight, vocabulary rows; a slice held by `replicas` ranks only on the first of them."""
    out = split_parameter_ids(module)  # bare per-head parameters (attention sinks): a slice on each rank
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            # A row layer's bias is whole on every rank; a replica's slice counts on the first of its holders.
            out |= {id(p) for name, p in m.named_parameters(recurse=False) if m.split(name).counts_on(tp_rank)}
        elif isinstance(m, ExpertTensorParallelMixin):  # every tensor of it split over tp: a slice on each rank
            out |= {id(p) for p in m.parameters(recurse=False)}
    return out


def _local_grad(param: nn.Parameter, dp_rank: int) -> tuple[torch.Tensor, bool | None]:
    """This rank's gradient storage, and whether it counts here as far as dp is concerned.

    A DTensor gradient counts on every shard, and for each mesh dimension it is
    replicated over, only at coordinate 0 there; None when it is partial (unreduced).
    A plain one is whole on every replica (dp = 1, or DDP's): it counts on dp_rank 0.
    """
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad, dp_rank == 0
    coordinate = grad.device_mesh.get_coordinate()
    once = coordinate is not None
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Replicate):
            once = once and coordinate[dim] == 0
        elif not isinstance(placement, Shard):
            once = None
            break
    with torch.no_grad():
        return grad.to_local(), once
