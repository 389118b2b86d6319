"""Bare per-head parameters (attention sinks) split over tp, in place.

Such a parameter (`binding.tp_params`) keeps this tp rank's slice of dim 0, its heads' values; each
rank's gradient is its slice's whole gradient: nothing to sum. The owner remembers which of its
parameters are split, for the HF save (`split_parameters`).
"""

from __future__ import annotations

from torch import nn

from ..binding.shard_layout import TensorSplit

__all__ = ["split_head_parameter", "split_parameters"]

_SPLIT = "_rewrite_split_parameters"


def split_head_parameter(model: nn.Module, name: str, tp_rank: int, tp: int) -> None:
    """Keep tp rank `tp_rank`'s slice (of `tp`) of `model`'s parameter `name` along dim 0, in place."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    param = getattr(owner, leaf)
    part = TensorSplit(0, tp).take(param.detach(), tp_rank).clone()
    setattr(owner, leaf, nn.Parameter(part, requires_grad=param.requires_grad))
    object.__setattr__(owner, _SPLIT, (*getattr(owner, _SPLIT, ()), leaf))


def split_parameters(module: nn.Module) -> tuple[str, ...]:
    """The names of `module`'s own parameters split with its heads."""
    return getattr(module, _SPLIT, ())

