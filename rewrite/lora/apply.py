"""Putting a plan's LoRA adapters on a model, in place: the target linears carry adapters, all else is frozen."""

from __future__ import annotations

import torch
from torch import nn

from ..binding.lora_targets import is_adapter, is_lora_linear
from ..binding.resolve import ResolvedPlan
from .adapter import LoraLinear, init_adapter

__all__ = ["apply_lora", "merge_adapters"]


def apply_lora(model: nn.Module, resolved: ResolvedPlan) -> list[str]:
    """Give every layer of `resolved.lora_targets` an adapter (freshly drawn, `init_adapter`; one the model
    already carries is kept as it is) and freeze every other parameter, in place. Returns the targets.

    Runs on the whole model before tensor parallelism splits it: the parallel layers take their slices of the
    adapters as they take their weights'. A plan without `lora` changes nothing.
    """
    lora = resolved.plan.lora
    if lora is None:
        return []
    for fqn in resolved.lora_targets:
        parent_name, _, leaf = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        if is_lora_linear(linear):
            linear.lora_scaling, linear.lora_dropout = lora.scaling, lora.dropout
            continue
        layer = LoraLinear.from_linear(linear, rank=lora.rank, scaling=lora.scaling, dropout=lora.dropout)
        init_adapter(layer.lora_A, layer.lora_B, fqn, lora.seed)
        setattr(parent, leaf, layer)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return list(resolved.lora_targets)


def merge_adapters(model: nn.Module) -> list[str]:
    """Fold each adapter into its layer's weight, in place (`W + scaling * B A`, computed in float32, stored in
    W's dtype, as PEFT's `merge_and_unload`): every `LoraLinear` becomes a plain nn.Linear. Returns their paths.
    A whole (unsplit) model only."""
    merged = []
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, LoraLinear):
            continue
        with torch.no_grad():
            delta = (module.lora_B.float() @ module.lora_A.float()) * module.lora_scaling
            module.weight.add_(delta.to(module.weight.dtype))
        plain = nn.Linear(module.in_features, module.out_features, module.bias is not None, device="meta")
        plain.weight, plain.bias = module.weight, module.bias
        parent, _, leaf = fqn.rpartition(".")
        setattr(model.get_submodule(parent), leaf, plain)
        merged.append(fqn)
    return merged
