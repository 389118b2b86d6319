"""Where one rank's part of a tensor lies in the whole (`TensorSplit`): one description, computed from the binding.

    column weight, bias  dim 0, slices tp / replicas, parts 1 or 2   (output features)
    row weight           dim 1, slices tp                            (input features; bias whole)
    column lora_B        as the weight; lora_A whole                 (a LoRA adapter, docs/lora.md)
    row lora_A           as the weight; lora_B whole
    vocab weight         dim 0, slices tp                            (rows of the vocabulary)
    experts' tensors     dim 0, slices ep, over "ep"                 (experts; ep rank r holds slice r)

`over` names the ranks that hold the slices: a stage's tp ranks, or an expert-parallel group's.
Read by the binding's shapes, the layers' `shard_of` and checkpoints; `apply_plan` marks each parameter
with its `ParamSplit`, which the gradient norm reads (`split_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ..errors import InputError
from ..plan.styles import STYLE_INFO, packed_parts

if TYPE_CHECKING:
    from .experts import ExpertSpec
    from .tp_rules import ShardSpec

__all__ = ["TensorSplit", "WHOLE", "ParamSplit", "split_dim", "style_split", "tensor_split", "state_split",
           "mark_split", "split_of"]


@dataclass(frozen=True)
class TensorSplit:
    """`parts` equal blocks side by side along `dim` (a fused gate_up_proj: 2), each in `slices` equal slices;
    tp rank `r` holds slice `r // replicas` of each, in order."""

    dim: int | None = None  # None: every rank holds the whole tensor
    slices: int = 1
    parts: int = 1
    replicas: int = 1  # neighbouring ranks holding the same slice (a k/v projection past its kv heads)
    over: Literal["tp", "ep"] = "tp"  # the ranks holding the slices: tp ranks, or an expert-parallel group's

    def holder(self, tp_rank: int, ep_rank: int) -> int:
        """This rank's place among the ranks holding the slices (its tp_rank, or its ep_rank)."""
        return ep_rank if self.over == "ep" else tp_rank

    def slot(self, tp_rank: int) -> int:
        """The slice tp rank `tp_rank` holds."""
        return tp_rank // self.replicas

    def length(self, size: int) -> int:
        """Of each part's slice, along `dim`, for a whole of `size`."""
        return size // (self.parts * self.slices)

    def ranges(self, size: int, tp_rank: int) -> list[tuple[int, int]]:
        """(start, length) along `dim` of what `tp_rank` holds, one per part, in order."""
        length, part = self.length(size), size // self.parts
        return [(p * part + self.slot(tp_rank) * length, length) for p in range(self.parts)]

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a rank holds of a whole of `shape`."""
        if self.dim is None:
            return tuple(shape)
        return (*shape[: self.dim], self.length(shape[self.dim]) * self.parts, *shape[self.dim + 1 :])

    def take(self, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """`tp_rank`'s part of `full`: a view when one part, a copy of the parts side by side when packed."""
        if self.dim is None:
            return full
        pieces = [full.narrow(self.dim, start, length) for start, length in self.ranges(full.shape[self.dim], tp_rank)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def counts_on(self, tp_rank: int) -> bool:
        """Whether this rank's part counts in a sum over tp ranks (a split tensor: once per slice)."""
        return self.dim is not None and tp_rank % self.replicas == 0


WHOLE = TensorSplit()


@dataclass(frozen=True)
class ParamSplit:
    """What one parameter of a rewritten stage is on this rank: how its tensor is split, and whether this
    rank's copy is the one that counts once in a sum over every rank (the gradient norm).

    `counts` is False on all but one holder of each element: of a slice's tp replicas (or of a whole
    tensor's tp ranks) all but the first; the last pipeline stage's end of a tied embedding; experts' copies
    other than copy 0 at cp rank 0; a plain tensor's dp x cp replicas other than (0, 0), and a DTensor's
    replicas other than coordinate 0 of a mesh dim it is replicated over (its shards each count).
    """

    split: TensorSplit
    counts: bool


_MARK = "_rewrite_split"  # the attribute on the parameter holding its ParamSplit


def mark_split(param: torch.Tensor, record: ParamSplit) -> None:
    """Attach `record` to `param` (in place), for `split_of`."""
    setattr(param, _MARK, record)


def split_of(param: torch.Tensor) -> ParamSplit:
    """The `ParamSplit` `apply_plan` attached to `param`.

    Raises:
        InputError: `param` carries none (not a parameter of a stage `apply_plan` or `rewrite`'s loaders placed).
    """
    record = getattr(param, _MARK, None)
    if not isinstance(record, ParamSplit):
        raise InputError(f"a parameter of shape {list(param.shape)} carries no split: it was not placed by apply_plan; "
                         "pass the parameters of the Stage apply_plan (or from_pretrained) returned")
    return record


def split_dim(style: str, leaf: str) -> int | None:
    """The dim along which a tensor-parallel style splits its module's tensor `leaf`; None: whole.

    A LoRA adapter (`lora_A` [r, in], `lora_B` [out, r]) is split as its layer's weight where it shares the
    weight's split dimension: a column layer's B by output features (A whole), a row layer's A by input
    features (B whole)."""
    info = STYLE_INFO.get(style)
    if info is None or leaf not in ("weight", "bias", "lora_A", "lora_B"):
        return None
    column = info.layer == "column"
    if leaf == "bias":  # a column layer's bias is split with its output features; a row layer's is whole
        return 0 if column else None
    if leaf.startswith("lora_"):
        return 0 if column and leaf == "lora_B" else 1 if info.layer == "row" and leaf == "lora_A" else None
    return {"column": 0, "vocab": 0, "row": 1}.get(info.layer)  # vocab: rows of the vocabulary


def style_split(style: str, leaf: str, tp: int, *, parts: int = 1, replicas: int = 1) -> TensorSplit:
    """How a module sharded as `style` over `tp` ranks holds its tensor `leaf` along `split_dim`: `parts`
    blocks, each in tp / `replicas` slices. Both the binding and the layers ask it."""
    dim = split_dim(style, leaf)
    if dim is None or tp == 1:
        return WHOLE
    return TensorSplit(dim, tp // replicas, parts, replicas)


def state_split(shards: Mapping[str, ShardSpec], experts: Mapping[str, ExpertSpec], name: str) -> TensorSplit:
    """How a rank holds state-dict tensor `name`, given the plan's shards and experts split over ep, by module path."""
    own = shards.get(name)
    if own is not None and own.parameter:  # a bare parameter split with the heads: rows, in tp slices
        return TensorSplit(0, own.tp) if own.tp > 1 else WHOLE
    owner, _, leaf = name.rpartition(".")
    expert = experts.get(owner)
    if expert is not None and expert.splits:
        return expert.split_of(leaf)
    return tensor_split(shards.get(owner), leaf)


def tensor_split(spec: ShardSpec | None, leaf: str) -> TensorSplit:
    """How the module bound as `spec` (None: not sharded) holds its tensor `leaf` on each tp rank."""
    if spec is None:
        return WHOLE
    return style_split(spec.style, leaf, spec.tp, parts=packed_parts(spec.style), replicas=spec.replicas)
