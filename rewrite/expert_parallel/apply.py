"""Splitting a model's fused experts over mesh.ep, in place, and their gradients' reduction.

Each experts module a plan names keeps its rank's experts (`ExpertSpec.split_of`) and sends tokens to
them (`dispatch`). Data parallelism leaves these parameters alone: they differ across an ep group.
`ExpertSums` sums their gradients over the ranks holding the same experts ((dp x tp / ep) x cp: between
them they saw every replica's tokens once) and divides by dp x cp, as the dense gradients are averaged.
"""

from __future__ import annotations

import torch
from torch import nn

from ..binding.resolve import ResolvedPlan
from ..grad_finish import GradFinish, flat_sum
from ..mesh import Mesh
from ..tensor_parallel.mixins import add_mixin
from ..models.experts import every_token, set_expert_counts
from .dispatch import EveryTokenMixin, ExpertParallelMixin, ExpertShard, ShardedExperts
from .tensor import keep_part, split_experts_over_tp

__all__ = ["apply_expert_parallel", "expert_parameters", "ExpertSums"]


def apply_expert_parallel(model: nn.Module, resolved: ResolvedPlan, mesh: Mesh, *, cast: torch.dtype | None = None
                          ) -> None:
    """Keep this rank's experts of every module the plan splits over ep, in place (ep 1: nothing), and
    this tp rank's slices of every expert of each it splits over tp. `cast`: the dtype experts split over ep
    compute in, their parameters kept as they are (mixed precision where FSDP2 casts the rest)."""
    sequence = resolved.plan.sequence_parallel and mesh.tp > 1  # each tp rank already holds its part of the tokens
    tokens_over = mesh.tp_group if mesh.tp > 1 and not sequence else None  # the same tokens: each sends its chunk
    for spec in resolved.experts:
        module = model.get_submodule(spec.fqn)
        if spec.tp > 1:
            split_experts_over_tp(module, spec, mesh.tp_rank, mesh.tp_group, sequence=sequence)
        if mesh.ep == 1:
            continue
        keep_part(module, spec, mesh.ep_rank)
        set_expert_counts(module, spec.local, spec.identity // spec.ep)  # the family's forward counts with them
        mixin = EveryTokenMixin if every_token(module) else ExpertParallelMixin
        add_mixin(module, mixin).expert_shard = ExpertShard(spec, mesh.ep_rank, mesh.ep_group, cast, tokens_over)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` that hold this rank's experts only (split over ep)."""
    return [p for m in module.modules() if isinstance(m, ShardedExperts) for p in m.parameters()]


class ExpertSums(GradFinish):
    """The experts' gradient sum, once per step after the dense ones' reduction (`expert_replica_group`
    None: their sum is this rank's)."""

    doing = "the experts' gradient sum over the ranks holding them"

    def __init__(self, params: list[nn.Parameter], mesh: Mesh):
        self.params, self.mesh = params, mesh

    def finish(self) -> None:
        for param in self.params:  # a rank whose experts saw no row all step still adds its zeros
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in self.params if p.requires_grad]
        if self.mesh.expert_replica_group is not None:
            flat_sum(grads, self.mesh.expert_replica_group)
        for grad in grads:
            grad.div_(self.mesh.replicas)
