"""Applying a bound plan's tensor-parallel rules: module swaps in place, over one group."""

from __future__ import annotations

from torch import nn

from ..plan.resolve import ResolvedPlan
from .comm import SharedInputCopy
from .layers import ColumnParallelLinear, RowParallelLinear
from .replicated import make_grad_allreduce

__all__ = ["apply_tensor_parallel"]


def apply_tensor_parallel(model: nn.Module, resolved: ResolvedPlan, group) -> None:
    """Swap each planned module in place for its tensor-parallel version over `group`."""
    copies: dict[str, SharedInputCopy] = {}
    for spec in resolved.shards:
        parent_name, _, name = spec.fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, name)
        if spec.style == "grad_allreduce":
            make_grad_allreduce(module, group)
            continue
        if spec.style in ("column", "column_gather"):
            # Siblings reading one activation (q/k/v; gate/up) share one backward all-reduce.
            shared = copies.setdefault(parent_name, SharedInputCopy(group))
            new = ColumnParallelLinear.from_linear(
                module, group=group, gather_output=spec.style == "column_gather", input_copy=shared
            )
        else:
            new = RowParallelLinear.from_linear(module, group=group, input_is_parallel=spec.style == "row")
        setattr(parent, name, new)
