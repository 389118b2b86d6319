"""What the tensor-parallel linears share: argument checks, the full weight they slice, and
the slicing bookkeeping of `_ParallelLinear`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..values import check_count
from .comm import group_rank, group_size

def _check_features(cls: str, in_features: int, out_features: int) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        check_count(cls, name, value)


def _check_divisible(cls: str, dim: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(
            f"{cls}: {dim}={size} is not divisible by the tensor-parallel world size {world}; "
            f"use a world size that divides {size}"
        )


def _master(
    cls: str,
    master_weight: torch.Tensor | None,
    out_features: int,
    in_features: int,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """The full `[out, in]` weight: the one given, or nn.Linear's default init."""
    if master_weight is None:
        # Drawn in full so every rank, seeded alike, slices the same matrix.
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        return weight
    if not isinstance(master_weight, torch.Tensor):
        raise TypeError(f"{cls}: master_weight must be a torch.Tensor, got {type(master_weight).__name__}")
    if tuple(master_weight.shape) != (out_features, in_features):
        raise ValueError(
            f"{cls}: master_weight has shape {tuple(master_weight.shape)}, expected "
            f"[out_features, in_features] = [{out_features}, {in_features}]"
        )
    return master_weight.detach()


class _ParallelLinear(nn.Module):
    """What both layers share: group bookkeeping, slicing, building from nn.Linear."""

    _split = ""  # "out_features" (column) or "in_features" (row)
    replicas = 1  # tp ranks holding the same slice (a column k/v projection past its kv heads)

    def _build(self, in_features, out_features, bias, master_weight, group, device, dtype) -> None:
        cls = type(self).__name__
        _check_features(cls, in_features, out_features)
        self.in_features, self.out_features = in_features, out_features
        self.group = group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        split = getattr(self, self._split)
        if self.tp_size % self.replicas:
            raise ValueError(f"{cls}: replicas={self.replicas} must divide the tensor-parallel world size {self.tp_size}")
        slices = self.tp_size // self.replicas
        _check_divisible(cls, self._split, split, slices)
        self.per_rank = split // slices
        self.slot = self.tp_rank // self.replicas  # which slice this rank holds
        full = _master(cls, master_weight, out_features, in_features, device, dtype)
        # clone(): this rank's storage holds only its slice, never the full matrix.
        self.weight = nn.Parameter(self.shard_of("weight", full).clone())
        if bias:
            zeros = torch.zeros(out_features, device=full.device, dtype=full.dtype)
            self.bias = nn.Parameter(self.shard_of("bias", zeros).clone())
        else:
            self.register_parameter("bias", None)

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of the unsharded `full` tensor that this rank's parameter `name` holds (a view)."""
        raise NotImplementedError

    @classmethod
    def _from(cls, linear: nn.Linear, **options):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear needs an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight, **options)
        if linear.bias is not None:
            layer.bias = nn.Parameter(layer.shard_of("bias", linear.bias.detach()).clone())
        # A frozen source stays frozen once sharded.
        layer.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer
