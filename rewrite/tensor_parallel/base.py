"""What the tensor-parallel layers share: argument checks, the full weight they slice, and
the slicing bookkeeping of `_ParallelLinear`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..binding.lora_targets import is_lora_linear
from ..binding.shard_layout import TensorSplit
from ..lora.adapter import lora_delta
from ..values import check_count
from .comm import copy_to_parallel, group_rank, group_size


def _check_divisible(cls: str, dim: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(
            f"{cls}: {dim}={size} is not divisible by the tensor-parallel world size {world}; "
            f"use a world size that divides {size}"
        )


def master(
    cls: str,
    master_weight: torch.Tensor | None,
    shape: dict[str, int],
    init: Callable[[torch.Tensor], object],
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """The full weight of `shape` (dim name -> size): `master_weight` checked, else drawn and `init`ed."""
    if master_weight is None:
        # Drawn in full so every rank, seeded alike, slices the same matrix.
        weight = torch.empty(tuple(shape.values()), device=device, dtype=dtype)
        init(weight)
        return weight
    if not isinstance(master_weight, torch.Tensor):
        raise TypeError(f"{cls}: master_weight must be a torch.Tensor, got {type(master_weight).__name__}")
    if tuple(master_weight.shape) != tuple(shape.values()):
        raise ValueError(
            f"{cls}: master_weight has shape {tuple(master_weight.shape)}, expected "
            f"[{', '.join(shape)}] = [{', '.join(map(str, shape.values()))}]"
        )
    return master_weight.detach()


class _ParallelLinear(nn.Module):
    """What both layers share: group bookkeeping, slicing, building from nn.Linear, a LoRA adapter.

    Some parameters' gradients are partial sums over a group (`partial`: name -> group): a replicated k/v
    slice's over its replicas, an adapter's whole factor over tp; summed as `partial_grads` says.
    """

    _split = ""  # "out_features" (column) or "in_features" (row)
    replicas = 1  # tp ranks holding the same slice (a column k/v projection past its kv heads)
    deferred = False  # inside a step that sums the partial gradients once (`partial_grads.StepSums`)
    lora_scaling, lora_dropout = 1.0, 0.0  # a LoRA adapter's, when the layer carries one

    def _build(self, in_features, out_features, bias, master_weight, group, device, dtype) -> None:
        cls = type(self).__name__
        check_count(cls, "in_features", in_features)
        check_count(cls, "out_features", out_features)
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
        full = master(cls, master_weight, {"out_features": out_features, "in_features": in_features},
                      lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)), device, dtype)
        # clone(): this rank's storage holds only its slice, never the full matrix.
        self.weight = nn.Parameter(self.shard_of("weight", full).clone())
        if bias:
            zeros = torch.zeros(out_features, device=full.device, dtype=full.dtype)
            self.bias = nn.Parameter(self.shard_of("bias", zeros).clone())
        else:
            self.register_parameter("bias", None)
        self.register_parameter("lora_A", None)  # a LoRA adapter's factors, when it carries one (`_adapt`)
        self.register_parameter("lora_B", None)
        self.partial: dict[str, object] = self._partial_groups()

    def _partial_groups(self) -> dict[str, object]:
        """Parameter name -> the group its gradient is a partial sum over (overridden by each layer)."""
        return {}

    def summed(self, name: str) -> torch.Tensor | None:
        """Parameter `name` as the forward uses it: wrapped so that a backward outside a step sums its partial
        gradient over its group."""
        tensor, group = getattr(self, name), self.partial.get(name)
        return tensor if tensor is None or group is None or self.deferred else copy_to_parallel(tensor, group)

    def adapter(self, x: torch.Tensor, *, full_in: int | None = None, offset: int = 0) -> torch.Tensor:
        """The LoRA adapter's addition for this rank's input `x` (`lora.lora_delta`)."""
        return lora_delta(x, self.summed("lora_A"), self.summed("lora_B"), scaling=self.lora_scaling,
                          dropout=self.lora_dropout, training=self.training, full_in=full_in, offset=offset)

    def _adapt(self, linear: nn.Module) -> None:
        """Take this rank's slices of `linear`'s LoRA adapter (`rewrite.lora.LoraLinear`)."""
        for name in ("lora_A", "lora_B"):
            whole = getattr(linear, name)
            setattr(self, name, nn.Parameter(self.shard_of(name, whole.detach()).clone(),
                                             requires_grad=whole.requires_grad))
        self.lora_scaling, self.lora_dropout = linear.lora_scaling, linear.lora_dropout
        self.partial = self._partial_groups()

    def split(self, name: str) -> TensorSplit:
        """How parameter `name` is split over the group."""
        raise NotImplementedError

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of the unsharded `full` tensor that this rank's parameter `name` holds (a view;
        a copy of each part's rows when packed)."""
        return self.split(name).take(full, self.tp_rank)

    @classmethod
    def _from(cls, linear: nn.Linear, **options):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear needs an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight, **options)
        # A frozen source stays frozen once sharded.
        layer.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            layer.bias = nn.Parameter(layer.shard_of("bias", linear.bias.detach()).clone(),
                                      requires_grad=linear.bias.requires_grad)
        if is_lora_linear(linear):
            layer._adapt(linear)
        return layer
