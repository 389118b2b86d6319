"""A LoRA adapter's arithmetic, in one place for every layer that carries one, and the plain linear layer
that carries one (`LoraLinear`); the tensor-parallel layers carry theirs split (`tensor_parallel.base`).

For `y = x W^T + b` an adapter of rank r adds `s * (dropout(x) A^T) B^T`, A `[r, in]`, B `[out, r]`,
`s = alpha / r`: PEFT's `lora_B(lora_A(lora_dropout(x))) * scaling`, in its order, so one process matches
PEFT bit for bit.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["LoraLinear", "lora_delta", "init_adapter", "drawn"]


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, scaling: float, dropout: float,
               training: bool, full_in: int | None = None, offset: int = 0) -> torch.Tensor:
    """`scaling * (dropout(x) a^T) b^T`.

    `x` may be features `[offset, offset + x.shape[-1])` of an input of `full_in` (a row layer's slice):
    the dropout mask is then drawn for the whole input and this slice of it used, so ranks whose random
    states agree drop what one process dropping the whole input would (CPU draws alike; on GPUs the
    whole-input kernel draws otherwise, the mask is as random).
    """
    if dropout and training:
        if full_in is None or full_in == x.shape[-1]:
            x = F.dropout(x, dropout, True)
        else:  # F.dropout's CPU kernel: a Bernoulli mask of the input's shape, divided by the keep rate
            keep = x.new_empty((*x.shape[:-1], full_in)).bernoulli_(1 - dropout).narrow(-1, offset, x.shape[-1])
            x = x * keep.div_(1 - dropout)
    return F.linear(F.linear(x, a), b) * scaling


def init_adapter(a: torch.Tensor, b: torch.Tensor, fqn: str, seed: int = 0) -> None:
    """PEFT's initialisation, in place: A Kaiming-uniform (as nn.Linear's weight), B zero, so a fresh adapter
    adds nothing. A's draw depends only on `seed` (the plan's `lora.seed`) and the layer's path, never on a
    process's random state: every plan, every rank draws the same adapter for the same layer. On the meta
    device nothing is drawn (a loader fills it in: `drawn`)."""
    if a.is_meta:
        return
    with torch.no_grad():
        a.copy_(drawn(f"{fqn}.lora_A", tuple(a.shape), seed))
        b.zero_()


def drawn(name: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """The whole fresh factor `name` (`<layer>.lora_A` or `.lora_B`) of `shape`, in float32 on the CPU, as
    `init_adapter` draws it."""
    layer, _, leaf = name.rpartition(".")
    factor = torch.zeros(shape)
    if leaf == "lora_A":
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(layer.encode())) % 2**63)
        nn.init.kaiming_uniform_(factor, a=math.sqrt(5), generator=gen)
    return factor


class LoraLinear(nn.Linear):
    """`nn.Linear` with a LoRA adapter: `y = x W^T + b + scaling * (dropout(x) A^T) B^T`.

    Parameters `weight` and `bias` as nn.Linear's (frozen by `apply_lora`), `lora_A` `[rank, in_features]`
    and `lora_B` `[out_features, rank]`. Built by `from_linear`, which keeps the linear's own parameter objects.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int, scaling: float = 1.0,
                 dropout: float = 0.0, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        self.lora_scaling, self.lora_dropout = scaling, dropout

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, rank: int, scaling: float, dropout: float) -> LoraLinear:
        """A LoraLinear computing what `linear` does, holding `linear`'s weight and bias (the same objects: ties
        and references stay), with an uninitialised adapter on the weight's device and dtype (`init_adapter`)."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, rank=rank, scaling=scaling,
                    dropout=dropout, device="meta", dtype=weight.dtype)
        layer.weight, layer.bias = weight, linear.bias
        layer.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=weight.device, dtype=weight.dtype))
        layer.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=weight.device, dtype=weight.dtype))
        layer.train(linear.training)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + lora_delta(
            x, self.lora_A, self.lora_B, scaling=self.lora_scaling, dropout=self.lora_dropout, training=self.training)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora rank={self.lora_A.shape[0]}, scaling={self.lora_scaling:g}"
                + (f", dropout={self.lora_dropout:g}" if self.lora_dropout else ""))
