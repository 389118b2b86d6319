"""PEFT as the oracle for LoRA: a copy of a tiny model wrapped by `peft.get_peft_model` with adapters drawn
off zero, the same adapters put on the model rewrite will rewrite, and each parameter's PEFT counterpart."""

from __future__ import annotations

import copy

import torch
from torch import nn

from rewrite.binding.lora_targets import is_adapter
from rewrite.lora import put_adapters

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_twin(model: nn.Module, *, rank: int = 4, alpha: float = 8.0, dropout: float = 0.0,
              targets: list[str] | None = None) -> nn.Module:
    """A PEFT copy of `model` with random adapters (B off zero, so every factor has a gradient), and the same
    adapters put on `model` (in place). The plan's lora section must say the same rank and alpha."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets or PROJECTIONS)
    twin = peft.get_peft_model(copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    adapters = {n: p.detach() for n, p in twin.named_parameters() if "lora_" in n}
    put_adapters(model, adapters, scaling=alpha / rank, dropout=dropout)
    return twin


def twin_names(model: nn.Module, twin: nn.Module) -> dict[str, str]:
    """Each parameter name of `model` (adapted, not yet rewritten) -> its PEFT twin's."""
    theirs = set(dict(twin.named_parameters()))
    names = {}
    for name, _ in model.named_parameters():
        layer, _, leaf = name.rpartition(".")
        if is_adapter(name):
            other = f"base_model.model.{layer}.{leaf}.default.weight"
        else:
            other = f"base_model.model.{layer}.base_layer.{leaf}"
            other = other if other in theirs else f"base_model.model.{name}"
        assert other in theirs, f"{name}: no PEFT parameter {other}"
        names[name] = other
    return names


class Renamed(nn.Module):
    """The twin's parameters under `model`'s names (for the reference checks, which look parameters up by name)."""

    def __init__(self, twin: nn.Module, names: dict[str, str]):
        super().__init__()
        self._params = dict(twin.named_parameters())
        self._names = names

    def named_parameters(self, *args, **kwargs):  # noqa: D102 - the twin's, renamed
        return ((mine, self._params[theirs]) for mine, theirs in self._names.items())
