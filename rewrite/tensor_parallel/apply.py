"""Applying a bound plan's tensor-parallel rules: module swaps in place, over one group.

Then, when the plan asks for them, sequence parallelism is wired in and the LM head
is told to keep its vocabulary shards for the runner's loss.
"""

from __future__ import annotations

from torch import nn

from ..plan.resolve import ResolvedPlan
from .comm import SharedInputCopy
from .layers import ColumnParallelLinear, RowParallelLinear
from .replicated import make_grad_allreduce
from .sequence_model import apply_sequence_parallel
from .vocab import VocabParallelEmbedding

__all__ = ["apply_tensor_parallel"]


def apply_tensor_parallel(model: nn.Module, resolved: ResolvedPlan, group) -> None:
    """Swap each planned module in place for its tensor-parallel version over `group`.

    A weight shared by two modules (tied embeddings) stays shared: both ends are
    split along the vocabulary alike, so the second end reuses the first's shard.
    """
    copies: dict[str, SharedInputCopy] = {}
    sharded: dict[int, nn.Parameter] = {}  # id of a replaced weight -> the shard that replaced it
    for spec in resolved.shards:
        parent_name, _, name = spec.fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, name)
        if spec.style == "grad_allreduce":
            make_grad_allreduce(module, group)
            continue
        if spec.style == "vocab":
            new = VocabParallelEmbedding.from_embedding(module, group=group)
        elif spec.style in ("column", "column_gather"):
            # Siblings reading one activation (q/k/v; gate/up) share one backward all-reduce.
            shared = copies.setdefault(parent_name, SharedInputCopy(group))
            # The LM head under loss_parallel still gathers for model(...); the runner asks for shards.
            new = ColumnParallelLinear.from_linear(
                module, group=group, gather_output=spec.style == "column_gather" or spec.fqn == _head(resolved),
                input_copy=shared,
            )
        else:
            new = RowParallelLinear.from_linear(module, group=group, input_is_parallel=spec.style == "row")
        if id(module.weight) in sharded:
            new.weight = sharded[id(module.weight)]  # tied: the same rows of the same matrix
        sharded[id(module.weight)] = new.weight
        setattr(parent, name, new)
    if resolved.plan.sequence_parallel:
        apply_sequence_parallel(model, resolved.backbone, group)


def _head(resolved: ResolvedPlan) -> str | None:
    bb = resolved.backbone
    return bb.head if bb is not None else None
