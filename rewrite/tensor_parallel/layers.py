"""Tensor-parallel linear layers: `ColumnParallelLinear` and `RowParallelLinear`.

For `Y = X W^T + b` with `W` of shape `[out, in]` on `p` ranks:

- column: `W = [W_1; ...; W_p]` split along `out`. Rank `i` computes
  `Y_i = X W_i^T + b_i`, a `[..., out/p]` slice of `Y`.
- row: `W = [W_1 ... W_p]` split along `in`, and `X = [X_1 ... X_p]` likewise.
  Rank `i` computes the partial `X_i W_i^T`; `Y = sum_i X_i W_i^T + b`.

A column layer feeding a row layer (Megatron's pairing) needs no communication
between them: one all-reduce closes the pair in forward, one opens it in backward.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn import functional as F

from ..binding.shard_layout import TensorSplit, style_split
from ..values import is_count
from .base import _ParallelLinear
from .comm import (
    SharedInputCopy, copy_to_parallel, gather_from_parallel, group_size, reduce_from_parallel, scatter_to_parallel,
)
from .sequence import reduce_scatter_to_sequence

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "local_shard"]


class ColumnParallelLinear(_ParallelLinear):
    """`nn.Linear` with its output features split across a tensor-parallel group.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample (all ranks together).
        bias: add a learnable bias, sharded like the output and initialised to zero.
        master_weight: the full `[out_features, in_features]` weight; this rank keeps rows
            `[rank*out/ws, (rank+1)*out/ws)`. None: drawn with nn.Linear's init (seed every rank alike).
        gather_output: all-gather the output so every rank returns `[..., out]` (default).
            False leaves it sharded, `[..., out/ws]`, to feed a `RowParallelLinear` directly.
        group: process group to split over (default: the default group); world size 1
            without an initialised process group.
        device, dtype: only used to create the weight when master_weight is None.
        parts: the output features are this many equal parts side by side (a fused `gate_up_proj`
            is 2: `W = [G; U]`); a rank keeps `[G_r; U_r]`, so `y.chunk(parts, -1)` gives its slice of each.
        replicas: this many neighbouring ranks hold the same slice (a k/v projection with fewer kv
            heads than ranks: `tp / kv`): rank `i` keeps slice `i // replicas` of `ws / replicas`, its
            gradients summed over `replica_group` (each rank's share comes from its own query heads).
        replica_group: the `replicas` ranks holding this rank's slice (needed when replicas > 1).

    Raises:
        ValueError: out_features not divisible by the world size (times `parts`, over
            `replicas`), a master_weight of the wrong shape, or replicas with a gathered
            or packed output, or without a replica group of that size.

    Example:
        >>> layer = ColumnParallelLinear(64, 128, True, torch.randn(128, 64))
        >>> layer(torch.randn(2, 5, 64)).shape
        torch.Size([2, 5, 128])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        master_weight: torch.Tensor | None = None,
        *,
        gather_output: bool = True,
        group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        parts: int = 1,
        replicas: int = 1,
        replica_group: ProcessGroup | None = None,
    ):
        super().__init__()
        _check_column_options(out_features, gather_output, group, parts, replicas, replica_group)
        self.gather_output, self.parts = gather_output, parts
        self.replicas, self.replica_group = replicas, replica_group
        self._build(in_features, out_features, bias, master_weight, group, device, dtype)
        self.out_per_rank = self.per_rank
        # f; sibling column layers reading one activation may share one (`comm.SharedInputCopy`).
        self.input_copy = partial(copy_to_parallel, group=group)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group: ProcessGroup | None = None,
        gather_output: bool = True,
        input_copy: SharedInputCopy | None = None,
        parts: int = 1,
        replicas: int = 1,
        replica_group: ProcessGroup | None = None,
    ) -> ColumnParallelLinear:
        """Shard an existing `nn.Linear`, keeping its trained weight and bias slices.

        `input_copy`: one backward all-reduce shared by layers reading the same activation (over
        the same group). `parts`, `replicas`: see the class.
        """
        layer = cls._from(linear, gather_output=gather_output, group=group, parts=parts, replicas=replicas,
                          replica_group=replica_group)
        if input_copy is not None:
            layer.input_copy = input_copy
        return layer

    _split = "out_features"

    def split(self, name: str) -> TensorSplit:
        """Weight and bias: output features (dim 0), `parts` blocks each in tp / replicas slices."""
        return style_split("column", name, self.tp_size, parts=self.parts, replicas=self.replicas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear expects inputs with last dimension in_features={self.in_features}, "
                f"got shape {tuple(x.shape)}"
            )
        y = self.forward_shard(x)  # (..., out / tp)
        return gather_from_parallel(y, self.group) if self.gather_output else y

    def forward_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's `(..., out / tp)` slice of the output, whatever `gather_output` says."""
        x = self.input_copy(x)  # f: identity here, all-reduce of dL/dx in backward
        y = F.linear(x, self.summed("weight"), self.summed("bias"))
        return y if self.lora_A is None else y + self.adapter(x)  # (..., out / tp): A whole, B this rank's rows

    def _partial_groups(self) -> dict[str, ProcessGroup]:
        """Past the kv heads each holder's gradient of its slice is its own query heads' share (summed over the
        replicas); an adapter's whole A gets a share from each rank's rows of B (summed over tp)."""
        partial = dict.fromkeys(("weight", "bias", "lora_B"), self.replica_group) if self.replicas > 1 else {}
        return {**partial, "lora_A": self.group}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_per_rank} on rank {self.tp_rank} of {self.tp_size}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
            + (f", parts={self.parts}" if self.parts > 1 else "")
            + (f", replicas={self.replicas} (slice {self.slot})" if self.replicas > 1 else "")
        )


def _check_column_options(out_features, gather_output: bool, group, parts, replicas, replica_group) -> None:
    if not is_count(replicas):
        raise ValueError(f"ColumnParallelLinear: replicas must be an int >= 1, got {replicas!r}")
    if replicas > 1 and (gather_output or parts > 1):
        raise ValueError(
            f"ColumnParallelLinear: replicas={replicas} needs gather_output=False and parts=1 (replicated slices feed "
            "their own ranks' attention; a gather would repeat them)"
        )
    if replicas > 1 and (replica_group is None or group_size(replica_group) != replicas):
        found = "none" if replica_group is None else f"a group of {group_size(replica_group)}"
        raise ValueError(f"ColumnParallelLinear: replicas={replicas} needs a replica_group of {replicas} ranks, got {found}")
    if not is_count(parts):
        raise ValueError(f"ColumnParallelLinear: parts must be an int >= 1, got {parts!r}")
    if parts > 1 and (gather_output or out_features % (parts * group_size(group))):
        raise ValueError(
            f"ColumnParallelLinear: parts={parts} needs gather_output=False (the packed shards feed a row layer) "
            f"and out_features={out_features} divisible by parts x the world size {group_size(group)}"
        )


class RowParallelLinear(_ParallelLinear):
    """`nn.Linear` with its input features split across a tensor-parallel group.

    Args:
        in_features: size of each input sample (all ranks together).
        out_features: size of each output sample.
        bias: add a learnable bias of shape `[out_features]`, full on every rank,
            initialised to zero and added once after the sum.
        master_weight: the full `[out_features, in_features]` weight; this rank keeps columns
            `[rank*in/ws, (rank+1)*in/ws)`. None: drawn with nn.Linear's init (seed every rank alike).
        input_is_parallel: forward() receives this rank's slice `[..., in/ws]` of the
            input (default). False: it receives the full input and splits it itself.
        group, device, dtype: as ColumnParallelLinear.
        sequence_parallel: reduce-scatter the `(b, s, out)` partial sums along the sequence instead
            of all-reducing them: each rank returns its `(b, ceil(s/ws), out)` rows of the sum, and
            the bias, added to those rows only, has its gradient summed over the group.

    Raises:
        ValueError: in_features not divisible by the world size, or a master_weight
            of the wrong shape.

    Example:
        >>> layer = RowParallelLinear(128, 64, True, torch.randn(64, 128))
        >>> layer(torch.randn(2, 5, 128)).shape  # world size 1: the slice is everything
        torch.Size([2, 5, 64])
    """

    sums_in_place = True  # False inside a selectively checkpointed module, which may keep the product it sums

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        master_weight: torch.Tensor | None = None,
        *,
        input_is_parallel: bool = True,
        group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self._build(in_features, out_features, bias, master_weight, group, device, dtype)
        self.in_per_rank = self.per_rank

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group: ProcessGroup | None = None,
        input_is_parallel: bool = True,
    ) -> RowParallelLinear:
        """Shard an existing `nn.Linear`, keeping its trained weight slice and full bias."""
        return cls._from(linear, input_is_parallel=input_is_parallel, group=group)

    _split = "in_features"

    def split(self, name: str) -> TensorSplit:
        """The weight's input features (dim 1) in tp slices; the bias whole, added once after the sum."""
        return style_split("row", name, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            if x.shape[-1] != self.in_features:
                raise ValueError(
                    f"RowParallelLinear(input_is_parallel=False) expects the full input, last dimension "
                    f"in_features={self.in_features}; got shape {tuple(x.shape)}"
                )
            x = scatter_to_parallel(x, self.group)  # (..., in / tp)
        elif x.shape[-1] != self.in_per_rank:
            raise ValueError(
                f"RowParallelLinear expects this rank's input slice, last dimension "
                f"{self.in_per_rank} (in_features={self.in_features} / world size {self.tp_size}); "
                f"got shape {tuple(x.shape)}. Pass input_is_parallel=False to split a full input."
            )
        partial = F.linear(x, self.weight)  # (..., out), this rank's share of the sum
        if self.lora_A is not None:  # A's columns for this rank's input features, B whole: its share too
            partial = partial + self.adapter(x, full_in=self.in_features, offset=self.tp_rank * self.in_per_rank)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, self.group)  # (b, ceil(s / tp), out)
            # Each rank adds the bias to its own tokens only: its gradient sums over tp (f).
            bias = None if self.bias is None else copy_to_parallel(self.bias, self.group)
        else:
            y = reduce_from_parallel(partial, self.group, inplace=self.sums_in_place)  # (..., out)
            bias = self.bias
        return y if bias is None else y + bias

    def _partial_groups(self) -> dict[str, ProcessGroup]:
        """An adapter's whole B gets a share from each rank's input features (summed over tp)."""
        return {"lora_B": self.group}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_per_rank} on rank {self.tp_rank} of {self.tp_size}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}"
            + (", sequence_parallel=True" if self.sequence_parallel else "")
        )


def local_shard(model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the unsharded tensor `full` that parameter `name` of a rewritten `model` holds
    (a sharded layer's `shard_of`; every other parameter is whole)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    shard_of = getattr(owner, "shard_of", None)
    return shard_of(leaf, full) if callable(shard_of) else full
