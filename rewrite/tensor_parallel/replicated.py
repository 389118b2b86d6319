"""Modules kept whole on every tensor-parallel rank while their input is sharded.

Qwen3's per-head `q_norm`/`k_norm` run on each rank's own heads, so each rank's
weight gradient is a partial sum. Routing the parameters through f (identity
forward, all-reduce backward) makes every rank's gradient the full one.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from .comm import copy_to_parallel
from .mixins import add_mixin

__all__ = ["make_grad_allreduce", "GradAllReduce"]


class GradAllReduce:
    """Mixin: during forward, each parameter is read through f over `tp_group`."""

    tp_group: ProcessGroup

    def forward(self, *args, **kwargs):
        params = self._parameters
        saved = dict(params)
        try:
            # The module's own forward reads self.<name>: hand it f(param) for this call.
            for name, param in saved.items():
                if param is not None and param.requires_grad:
                    params[name] = copy_to_parallel(param, self.tp_group)
            return super().forward(*args, **kwargs)
        finally:
            params.update(saved)


def make_grad_allreduce(module: nn.Module, group: ProcessGroup) -> nn.Module:
    """Make `module`'s parameter gradients sum over `group`, in place.

    The object, its class's behaviour and its parameter names are kept: only its
    class becomes a subclass of the original that adds the mixin.
    """
    add_mixin(module, GradAllReduce)
    module.tp_group = group
    return module
