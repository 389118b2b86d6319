"""The layout save and load share: file names, and which rank holds which slice of which checkpoint tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.names import canonical_names
from ..binding.resolve import ResolvedPlan

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SAVE_ID = "rewrite_save_id"  # key, in every shard's safetensors metadata and the index's, of the save that wrote it


@dataclass(frozen=True)
class Entry:
    """One state-dict tensor on one rank: which full checkpoint tensor it is, and which slice."""

    name: str  # the key in this rank's model.state_dict()
    canonical: str  # the key in the checkpoint (tied weights: the first name sharing it)
    full_shape: tuple[int, ...]
    dim: int | None  # sharded along this dim, None when whole
    start: int  # in each part
    length: int  # of each part
    parts: int = 1  # equal parts packed along `dim` (a fused gate_up_proj: 2), each sliced alike
    replicas: int = 1  # neighbouring tp ranks holding this same slice (a k/v projection past its kv heads)
    over: str = "tp"  # the ranks holding the slices: a stage's tp ranks, or an expert-parallel group's ("ep")

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if self.dim is not None:
            shape[self.dim] = self.length * self.parts
        return tuple(shape)

    def slices(self) -> list[slice]:
        """This rank's ranges along `dim` of the full tensor, one per part, in order."""
        part = self.full_shape[self.dim] // self.parts
        return [slice(p * part + self.start, p * part + self.start + self.length) for p in range(self.parts)]


def shard_file(pp_rank: int, pp: int) -> str:
    """The weights file pipeline rank `pp_rank` writes (all its stages)."""
    return SINGLE if pp == 1 else f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"


def is_weight_file(name: str) -> bool:
    """A file a save replaces (the index and `model*.safetensors`), as opposed to one it keeps (a tokenizer)."""
    return name == INDEX or (name.startswith("model") and name.endswith(".safetensors"))


def meta_model(config, **kwargs) -> nn.Module:
    """The causal LM of `config` (`from_config`'s `kwargs`) with no storage: enough to bind a plan to."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def stage_entries(meta: nn.Module, resolved: ResolvedPlan, pp_rank: int, tp_rank: int, ep_rank: int = 0) -> list[Entry]:
    """Every state-dict tensor pipeline rank `pp_rank` holds (all its stages), with the slice of tp rank
    `tp_rank` (and, of experts split over ep, of ep rank `ep_rank`).

    A tensor split `slices` ways (`spec.slices`: tp, or tp / replicas for a k/v projection
    past its kv heads) is held by tp rank `i` as slice `i // replicas`; an experts tensor split
    over ep by ep rank `r` as slice `r` (`ResolvedPlan.split_of`).
    """
    mods = [""] if resolved.pp == 1 else list(resolved.rank_modules(pp_rank))
    canonical = canonical_names(meta)
    entries = []
    for name, tensor in meta.state_dict(keep_vars=True).items():
        if not any(not m or name == m or name.startswith(m + ".") for m in mods):
            continue
        split, shape = resolved.split_of(name), tuple(tensor.shape)
        length = split.length(shape[split.dim]) if split.dim is not None else 0
        start = split.slot(split.holder(tp_rank, ep_rank)) * length
        entries.append(Entry(name, canonical.get(name, name), shape, split.dim, start, length, split.parts,
                             split.replicas, split.over))
    return entries


def written_by_stage(entries_per_stage: list[list[Entry]]) -> list[list[Entry]]:
    """Per stage, the entries it writes: each checkpoint tensor once, by the first stage holding it."""
    seen: set[str] = set()  # `not seen.add(...)`: always true, marks the tensor written
    return [[e for e in entries if e.canonical not in seen and not seen.add(e.canonical)] for entries in entries_per_stage]
