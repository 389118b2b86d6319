"""Partial gradients: parameters whole on every tensor-parallel rank whose gradients each rank holds in part.

Qwen3's per-head `q_norm`/`k_norm` run on each rank's own heads, and under sequence parallelism every
norm runs on each rank's own tokens, so each rank's weight gradient is a partial sum. A hook on each such
parameter (`Tensor.register_hook`: handed a backward's whole gradient of the parameter, every use summed,
before it is accumulated) sums it over the tp group. A k/v projection past its kv heads
(`ColumnParallelLinear(replicas=r)`) is the same over its replica group, and a LoRA adapter's factor held
whole beside its layer's split one (a column layer's A, a row layer's B) over tp. A training step sums
them once at its end instead (`StepSums`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..grad_finish import GradFinish, flat_sum
from . import comm
from .base import _ParallelLinear
from .mixins import add_mixin

__all__ = ["make_grad_allreduce", "GradAllReduce", "StepSums"]

_SUMMED = "_grad_summed_over_tp"  # on a parameter: a hook sums its gradient (one hook, however often it is set)


class GradAllReduce:
    """Mixin: each parameter's gradient is summed over `tp_group` as a backward hands it over (unless deferred).

    Parameters assigned later carry the sum too (FSDP2 sets its sharded and gathered parameters as
    attributes, as `module.weight = ...` does). The module's forward is the original class's.
    """

    tp_group: ProcessGroup
    deferred = False  # inside a step that sums the gradients once at its end (`StepSums`)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, nn.Parameter):
            _sum_gradient(self, value)


def _sum_gradient(module: GradAllReduce, param: nn.Parameter) -> None:
    """Have `param`'s gradient summed over `module.tp_group` in each backward, once per parameter object."""
    if hasattr(param, _SUMMED) or not param.is_floating_point():  # only floating point ever has a gradient
        return

    def summed(grad: torch.Tensor) -> torch.Tensor | None:
        if module.deferred:
            return None  # the step sums it once at its end
        # The engine may hand the same tensor elsewhere: sum a private copy, never in place.
        return comm.all_reduce_sum(grad.clone(memory_format=torch.contiguous_format), module.tp_group)

    frozen = not param.requires_grad  # hooked all the same: one unfrozen later must be summed too
    param.requires_grad_(True)  # (a hook is registered only on a tensor that requires grad; it stays when frozen)
    param.register_hook(summed)
    param.requires_grad_(not frozen)
    setattr(param, _SUMMED, True)


def make_grad_allreduce(module: nn.Module, group: ProcessGroup) -> nn.Module:
    """Make `module`'s own parameter gradients sum over `group`, in place (`add_mixin`: names kept); a module
    holding none (a wrapper) is left as it is."""
    if not any(True for _ in module.parameters(recurse=False)):
        return module
    add_mixin(module, GradAllReduce)
    module.tp_group = group
    for param in module.parameters(recurse=False):
        _sum_gradient(module, param)
    return module


class StepSums(GradFinish):
    """One step's partial gradients in `root` (`GradAllReduce` modules, replicated k/v
    projections, adapters' whole factors), summed over their group once.

    `begin()` sets aside the (complete) gradients they already hold and defers the modules'
    sums; `end()` lifts the deferral (call it however the step ends); `finish()` sums the step's
    parts in one collective per tp group, after any data-parallel reduction (both are sums: order
    does not matter), and adds back what was set aside. A gradient sharded by FSDP2 is summed as
    its local shard: every tp rank of a replica holds the same rows.

    Collective: `finish` on every rank of each tp group, at the same point of the step.
    """

    doing = "the sum of partial gradients over tp"

    def __init__(self, root: nn.Module):
        self.modules = [m for m in root.modules() if _partial_params(m)]
        self.stash: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    def __bool__(self) -> bool:
        return bool(self.modules)

    def _params(self) -> dict[ProcessGroup, list[nn.Parameter]]:
        groups: dict[ProcessGroup, list[nn.Parameter]] = {}
        for m in self.modules:
            for p, group in _partial_params(m):
                if p.requires_grad:
                    groups.setdefault(group, []).append(p)
        return groups

    def begin(self) -> None:
        self.stash = [(p, p.grad) for ps in self._params().values() for p in ps]
        for p, _ in self.stash:
            p.grad = None
        for m in self.modules:
            m.deferred = True

    def end(self) -> None:
        for m in self.modules:
            m.deferred = False

    def finish(self) -> None:
        for group, params in self._params().items():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat_sum([g.to_local() if hasattr(g, "to_local") else g for g in grads], group, comm.all_reduce_sum)
            for p, grad in zip(params, grads):
                p.grad = grad
        for p, before in self.stash:
            if before is not None:
                p.grad = before.add_(p.grad)
        self.stash = []


def _partial_params(module: nn.Module) -> list[tuple[nn.Parameter, ProcessGroup]]:
    """`module`'s own parameters whose gradients are partial, each with the group they are partial over: the
    registered ones (FSDP2's sharded ones between uses)."""
    if isinstance(module, GradAllReduce):
        return [(p, module.tp_group) for p in module.parameters(recurse=False)]
    if isinstance(module, _ParallelLinear):
        return [(p, group) for name, group in module.partial.items() if (p := getattr(module, name)) is not None]
    return []
