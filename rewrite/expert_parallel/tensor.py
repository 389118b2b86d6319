"""A fused experts module with each expert split over tp (`expert_tensor_parallel`).

Every tp rank holds every expert's slice of the intermediate features (`ExpertSpec.split_of`) and runs all
the stage's tokens through them, a dense MLP split column then row: partial outputs summed over tp
(Megatron's g), the tokens' and routing weights' gradients in the backward (Megatron's f). Under sequence
parallelism the tokens are all-gathered first and the outputs reduce-scattered. Data parallelism shards
and reduces these parameters like any tp-split tensor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..models.experts import every_token, num_experts
from ..tensor_parallel.comm import copy_to_parallel, reduce_from_parallel
from ..tensor_parallel.mixins import add_mixin
from ..tensor_parallel.sequence import gather_from_sequence, reduce_scatter_to_sequence
from ..torch_internals import buffer_persists

__all__ = ["ExpertTensorParallelMixin", "keep_part", "split_experts_over_tp"]


class ExpertTensorParallelMixin:
    """Put in front of a fused experts module's class: its forward on this rank's slices, summed over tp."""

    tp_group: ProcessGroup
    sequence = False  # under sequence parallelism: the rank's part of the tokens, gathered and scattered again

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self.sequence:
            return self._on_parts(hidden_states, *args, **kwargs)
        hidden_states = copy_to_parallel(hidden_states, self.tp_group)
        if len(args) >= 2 and not every_token(self):  # (top_k_index, top_k_weights, ...): the weights' gradient too
            args = (args[0], copy_to_parallel(args[1], self.tp_group), *args[2:])
        return reduce_from_parallel(super().forward(hidden_states, *args, **kwargs), self.tp_group)

    def _on_parts(self, hidden_states: torch.Tensor, *args, **kwargs):
        group, hidden = self.tp_group, hidden_states.shape[-1]
        if every_token(self):  # (E T, H): each expert's rows gathered along T
            experts = num_experts(self)
            rows = gather_from_sequence(hidden_states.reshape(experts, -1, hidden), group)
            out = super().forward(rows.reshape(-1, hidden), *args, **kwargs)
            return reduce_scatter_to_sequence(out.reshape(experts, -1, hidden), group).reshape(-1, hidden)
        index, weights, *rest = args
        rows = gather_from_sequence(hidden_states.reshape(-1, hidden), group)  # (tp T, H): every part, rank order
        out = super().forward(rows, gather_from_sequence(index, group), gather_from_sequence(weights, group),
                              *rest, **kwargs)
        return reduce_scatter_to_sequence(out, group)


def keep_part(module: nn.Module, spec, rank: int) -> None:
    """Replace `module`'s own parameters and buffers by their part `rank` (`spec.split_of`), in place."""
    for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        part = spec.split_of(name).take(tensor.detach(), rank).clone()
        if isinstance(tensor, nn.Parameter):
            setattr(module, name, nn.Parameter(part, requires_grad=tensor.requires_grad))
        else:  # kept out of the state dict where the family registered it so
            module.register_buffer(name, part, persistent=buffer_persists(module, name))


def split_experts_over_tp(module: nn.Module, spec, tp_rank: int, group: ProcessGroup, *, sequence: bool = False) -> None:
    """Keep this tp rank's slices of every expert of `module` (an `ExpertSpec` with tp > 1), in place;
    `sequence`: each tp rank holds its part of the tokens (sequence parallelism)."""
    keep_part(module, spec, tp_rank)
    mixin = add_mixin(module, ExpertTensorParallelMixin)
    mixin.tp_group, mixin.sequence = group, sequence
