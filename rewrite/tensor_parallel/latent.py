"""Multi-head latent attention's kv_a projection under tp (style `mla_kv_a`, checked by `binding.latent_attention`).

`kv_a_proj_with_mqa` stays a whole nn.Linear on every tp rank. Its output is the kv latent (into
`kv_b_proj`, a column layer whose f sums its gradient over tp) and, in its last `rope` features, the
rotary key every head shares, which reaches this rank's heads directly: those go through f, so the
projection's gradient is the whole one on every rank.

Under sequence parallelism the gather's reduce-scatter sums what reaches the attention's input: the
rotary key's gradient stays this rank's share (`sequence`), and the projection's weight gradient is
summed over tp as the block's other whole modules' are (`sequence_model`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .comm import copy_to_parallel
from .mixins import add_mixin

__all__ = ["RotaryKeyCopy", "make_rotary_key_copy"]


class RotaryKeyCopy:
    """Mixin in front of an nn.Linear: its last `rope` output features read through f over `tp_group`."""

    tp_group: ProcessGroup
    rope: int
    sequence = False  # under sequence parallelism: no f here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.sequence:
            return out
        latent, rotary = out.split([out.shape[-1] - self.rope, self.rope], dim=-1)
        return torch.cat([latent, copy_to_parallel(rotary, self.tp_group)], dim=-1)


def make_rotary_key_copy(module: nn.Module, group: ProcessGroup, rope: int) -> nn.Module:
    """Sum the gradient of `module`'s last `rope` output features over `group`, in place."""
    add_mixin(module, RotaryKeyCopy)
    module.tp_group, module.rope = group, rope
    return module
