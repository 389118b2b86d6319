"""`VocabParallelEmbedding`: an `nn.Embedding` whose vocabulary rows are split across a
tensor-parallel group (Megatron's vocab-parallel embedding); one all-reduce per forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn import functional as F

from ..models.families import embedding_scale
from ..binding.shard_layout import TensorSplit, style_split
from ..values import check_count, is_int
from .base import master
from .comm import group_rank, group_size, reduce_from_parallel

__all__ = ["VocabParallelEmbedding"]


def _check_sizes(num_embeddings: int, embedding_dim: int, padding_idx: int | None) -> int | None:
    """Validate the sizes; return padding_idx made non-negative (as nn.Embedding does)."""
    for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
        check_count("VocabParallelEmbedding", name, value)
    if padding_idx is None:
        return None
    if not is_int(padding_idx):
        raise TypeError(f"VocabParallelEmbedding: padding_idx must be an int or None, got {type(padding_idx).__name__}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"VocabParallelEmbedding: padding_idx={padding_idx} is outside the vocabulary; "
            f"use an index in [-{num_embeddings}, {num_embeddings})"
        )
    return padding_idx % num_embeddings


def _check_divisible(num_embeddings: int, tp_size: int) -> None:
    if num_embeddings % tp_size:
        working = [d for d in range(1, min(num_embeddings, 64) + 1) if num_embeddings % d == 0]
        padded = -(-num_embeddings // tp_size) * tp_size
        raise ValueError(
            f"VocabParallelEmbedding: num_embeddings={num_embeddings} is not divisible by the tensor-parallel "
            f"world size {tp_size}; use a tp size that divides it ({', '.join(map(str, working))}) or pad the "
            f"vocabulary to a multiple of {tp_size} (e.g. {padded} rows)"
        )


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` with its vocabulary split across a tensor-parallel group.

    `E = [E_1; ...; E_p]` (`[V, h]`) split along `V`: rank `i` keeps rows `[i*V/p, (i+1)*V/p)`, looks up
    the ids in its range and writes zeros for the others, so `E[x] = sum_i 1[x in range_i] E_i[x - i*V/p]`:
    one all-reduce in forward (Megatron's g), none in backward (each rank's rows get their tokens' gradients).

    Args:
        num_embeddings: vocabulary size V (all ranks together).
        embedding_dim: size h of each embedding vector.
        padding_idx: a row that is looked up but never trained (its gradient stays zero),
            as in nn.Embedding; negative values count from the end.
        master_weight: the full `[V, h]` weight; this rank keeps its rows. None: drawn with
            nn.Embedding's init (`N(0, 1)`, the padding row zeroed; seed every rank alike).
        group, device, dtype: as ColumnParallelLinear.
        scale: multiply the looked-up rows by this factor, cast to the weight's dtype as
            Gemma's scaled embedding does (`models.families.embedding_scale`).

    Raises:
        TypeError: non-int sizes or padding_idx, or a master_weight that is not a tensor.
        ValueError: V not divisible by the world size, sizes below 1, padding_idx outside
            the vocabulary, or a master_weight of the wrong shape.

    Ids outside `[0, V)` raise in nn.Embedding; here, on more than one rank, they give zero rows:
    check ids before the model (see pipeline/inputs).

    Example:
        >>> emb = VocabParallelEmbedding(32, 8, master_weight=torch.randn(32, 8))
        >>> emb(torch.tensor([[0, 31, 5]])).shape
        torch.Size([1, 3, 8])
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        master_weight: torch.Tensor | None = None,
        *,
        group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        self.padding_idx = _check_sizes(num_embeddings, embedding_dim, padding_idx)
        self.scale = scale
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group = group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        _check_divisible(num_embeddings, self.tp_size)
        self.per_rank = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.per_rank
        self.vocab_end = self.vocab_start + self.per_rank
        # Only the owner of the padding row tells F.embedding about it: elsewhere the
        # local index would name some other, trainable row.
        owns_pad = self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end
        self._local_padding_idx = self.padding_idx - self.vocab_start if owns_pad else None
        full = master("VocabParallelEmbedding", master_weight,
                      {"num_embeddings": num_embeddings, "embedding_dim": embedding_dim}, self._init, device, dtype)
        # clone(): this rank's storage holds only its rows, never the full matrix.
        self.weight = nn.Parameter(self.shard_of("weight", full).clone())

    def _init(self, weight: torch.Tensor) -> None:
        """nn.Embedding's init: N(0, 1), the padding row zeroed."""
        nn.init.normal_(weight)
        if self.padding_idx is not None:
            weight[self.padding_idx].zero_()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, group: ProcessGroup | None = None) -> VocabParallelEmbedding:
        """Shard an existing `nn.Embedding`, keeping its rows, padding_idx, requires_grad and (Gemma's) scale."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_embedding needs an nn.Embedding, got {type(embedding).__name__}")
        unsupported = [
            f"{name}={getattr(embedding, name)!r}"
            for name, default in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False))
            if getattr(embedding, name) != default
        ]
        if unsupported:
            raise ValueError(
                f"VocabParallelEmbedding.from_embedding: {', '.join(unsupported)} is not supported "
                "(each rank sees only its own rows); build the nn.Embedding without it"
            )
        layer = cls(
            embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, embedding.weight, group=group,
            scale=embedding_scale(embedding),
        )
        # A frozen source stays frozen once sharded.
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        return layer

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The rows of the unsharded `[V, h]` tensor `full` that this rank's `name` holds (a view)."""
        if name != "weight":
            raise ValueError(f"VocabParallelEmbedding has one parameter, 'weight'; got {name!r}")
        if full.shape[0] != self.num_embeddings:
            raise ValueError(
                f"VocabParallelEmbedding.shard_of: expected a tensor of {self.num_embeddings} rows "
                f"(num_embeddings), got shape {tuple(full.shape)}"
            )
        return self.split(name).take(full, self.tp_rank)

    def split(self, name: str) -> TensorSplit:
        """The weight's rows (the vocabulary, dim 0) in tp slices."""
        return style_split("vocab", name, self.tp_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VocabParallelEmbedding expects int32/int64 token ids, got {ids.dtype}")
        if self.tp_size == 1:  # no masking: out-of-range ids raise, as in nn.Embedding
            return self._scaled(F.embedding(ids, self.weight, self._local_padding_idx))
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        # Foreign ids look up local row 0, then are zeroed; their (zero) gradient adds nothing.
        local = (ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx)  # (..., h), partial
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self._scaled(reduce_from_parallel(out, self.group, inplace=True))  # (..., h), every rank's rows

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return out
        # As Gemma's embedding: a float32 scalar cast to the weight's dtype (sqrt(3072) is 55.5 in bfloat16).
        return out * torch.tensor(self.scale, device=out.device).to(self.weight.dtype)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        pad += "" if self.scale is None else f", scale={self.scale:g}"
        return (
            f"{self.num_embeddings}, {self.embedding_dim}{pad} "
            f"(rows [{self.vocab_start}, {self.vocab_end}) on rank {self.tp_rank} of {self.tp_size})"
        )
