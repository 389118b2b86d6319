"""A fused experts module with each expert split over tp (`expert_tensor_parallel`).

Every tp rank holds every expert's slice of the intermediate features (`ExpertSpec.split_of`: gate_up_proj's
gate and up slices, down_proj's input slice) and runs all of the stage's tokens through them, as a dense
MLP split column then row: its own forward gives a partial output, and the partial outputs are summed
over tp (Megatron's g). The tokens and their routing weights are the same on every tp rank; their
gradients are partial sums there, so they are summed over tp in the backward (Megatron's f). The
experts' parameters are a tp-split tensor like any other: data parallelism shards and reduces them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..models.experts import every_token
from ..tensor_parallel.comm import copy_to_parallel, reduce_from_parallel
from ..tensor_parallel.mixins import add_mixin

__all__ = ["ExpertTensorParallelMixin", "split_experts_over_tp"]


class ExpertTensorParallelMixin:
    """Put in front of a fused experts module's class: its forward on this rank's slices, summed over tp."""

    tp_group: ProcessGroup

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        hidden_states = copy_to_parallel(hidden_states, self.tp_group)
        if len(args) >= 2 and not every_token(self):  # (top_k_index, top_k_weights, ...): the weights' gradient too
            args = (args[0], copy_to_parallel(args[1], self.tp_group), *args[2:])
        return reduce_from_parallel(super().forward(hidden_states, *args, **kwargs), self.tp_group)


def split_experts_over_tp(module: nn.Module, spec, tp_rank: int, group: ProcessGroup) -> None:
    """Keep this tp rank's slices of every expert of `module` (an `ExpertSpec` with tp > 1), in place."""
    for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        part = spec.split_of(name).take(tensor.detach(), tp_rank).clone()
        if isinstance(tensor, nn.Parameter):
            setattr(module, name, nn.Parameter(part, requires_grad=tensor.requires_grad))
        else:
            module.register_buffer(name, part)
    add_mixin(module, ExpertTensorParallelMixin).tp_group = group
