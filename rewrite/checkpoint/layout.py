"""The layout save and load share: file names, and which rank holds which slice of which checkpoint
tensor; and what `save_pretrained` checks on each rank before anything is written: the model holds the
tensors, parallel layers and data-parallel split the plan gives this rank (`save_problems`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..binding.resolve import ResolvedPlan, resolve
from ..binding.shard_layout import WHOLE, TensorSplit
from ..expert_parallel.tensor import ExpertTensorParallelMixin
from ..models.experts import num_experts
from ..models.hf_decoder import meta_model
from ..models.names import canonical_names
from ..pipeline.stage import Stage
from ..plan.ranks import expert_place
from ..plan.schema import ParallelPlan, PlanError
from ..plan.wording import first_few
from ..tensor_parallel.apply import split_parameters
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.vocab import VocabParallelEmbedding

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SAVE_ID = "rewrite_save_id"  # key, in every shard's safetensors metadata and the index's, of the save that wrote it


@dataclass(frozen=True)
class Entry:
    """One state-dict tensor on one rank: which full checkpoint tensor it is, and which slice."""

    name: str  # the key in this rank's model.state_dict()
    canonical: str  # the key in the checkpoint (tied weights: the first name sharing it)
    full_shape: tuple[int, ...]
    split: TensorSplit = WHOLE  # how the ranks hold it (`ResolvedPlan.split_of`): dim, parts, replicas, over
    holder: int = 0  # this rank's place among the ranks holding the slices (`TensorSplit.holder`)

    @property
    def dim(self) -> int | None:
        return self.split.dim  # None: whole on every rank

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.split.local_shape(self.full_shape)

    def slices(self) -> list[slice]:
        """This rank's ranges along `dim` of the full tensor, one per part, in order."""
        return [slice(start, start + n) for start, n in self.split.ranges(self.full_shape[self.dim], self.holder)]

    def cut(self, whole, lead: int = 0) -> torch.Tensor:
        """This rank's slices of `whole` side by side along `dim` (all of it when whole): `whole` a tensor, or a
        safetensors `get_slice` (only the slices are read); `lead`: leading dims it lacks (an expert's row)."""
        if self.dim is None:
            return whole[...]
        dim = self.dim - lead
        pieces = [whole[(slice(None),) * dim + (s,)] for s in self.slices()]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def shard_file(pp_rank: int, pp: int) -> str:
    """The weights file pipeline rank `pp_rank` writes (all its stages)."""
    return SINGLE if pp == 1 else f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"


def is_weight_file(name: str) -> bool:
    """A file a save replaces (the index and `model*.safetensors`), as opposed to one it keeps (a tokenizer)."""
    return name == INDEX or (name.startswith("model") and name.endswith(".safetensors"))


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
        split = resolved.split_of(name)
        entries.append(Entry(name, canonical.get(name, name), tuple(tensor.shape), split, split.holder(tp_rank, ep_rank)))
    return entries


def _summary(head: str, items: list[str], shown: int = 3) -> list[str]:
    """One problem for many alike: the count and the first few."""
    if not items:
        return []
    return [head.format(n=len(items)) + " " + first_few(items, shown, "; ")]


def _expected_layer(model: nn.Module, entry: Entry, tp_rank: int) -> str | None:
    """Why the module holding `entry` is not the parallel layer the plan says, or None."""
    if entry.dim is None:
        return None
    owner = model.get_submodule(entry.name.rpartition(".")[0])
    if entry.split.over == "ep":
        shard = getattr(owner, "expert_shard", None)
        if shard is None:
            return f"{entry.name}: the plan splits its experts over ep, the model holds a {type(owner).__name__} whole"
        if shard.first != (start := entry.slices()[0].start):
            return f"{entry.name}: the module holds experts from {shard.first}, the plan gives this rank {start}"
        return None
    if isinstance(owner, ExpertTensorParallelMixin):
        return None  # each expert's slices: the module's tensors are this tp rank's (`split_experts_over_tp`)
    if entry.name.rpartition(".")[2] in split_parameters(owner):
        return None  # a bare per-head parameter, this tp rank's heads' values (`split_head_parameter`)
    if num_experts(owner) is not None:
        return f"{entry.name}: the plan splits each expert over tp, the model holds a {type(owner).__name__} whole"
    classes = (ColumnParallelLinear, VocabParallelEmbedding) if entry.dim == 0 else (RowParallelLinear,)
    if not isinstance(owner, classes):
        wanted = " or ".join(c.__name__ for c in classes)
        return f"{entry.name}: the plan shards it as {wanted}, the model holds {type(owner).__name__}"
    if owner.tp_rank != tp_rank:
        return f"{entry.name}: the layer is tp rank {owner.tp_rank}, this rank is tp rank {tp_rank} of the plan"
    replicas = getattr(owner, "replicas", 1)
    if replicas != entry.split.replicas:
        return f"{entry.name}: the layer's slice is held by {replicas} tp ranks, the plan's by {entry.split.replicas}"
    return None


def save_problems(model: nn.Module, plan: ParallelPlan, rank: int, stage: Stage | None) -> tuple[list[str], list[Entry]]:
    """Check this rank's model against the plan; returns (problems, the entries this rank writes).

    A stage rewritten with this very plan holds its binding; any other plan is bound afresh to a
    meta copy of the model, so a plan that does not match the model is found either way.
    """
    config = getattr(model, "config", None)
    if config is None:
        return [f"{type(model).__name__} has no .config: only Hugging Face models can be saved"], []
    meta = meta_model(config)
    if stage is not None and stage.resolved.plan.model_dump() == plan.model_dump():
        resolved = stage.resolved
    else:
        try:
            resolved = resolve(plan, meta)
        except PlanError as exc:
            return [f"the model's config does not fit the plan: {exc}"], []
    dp, cp, at = plan.mesh.dp, plan.mesh.cp, plan.mesh.shape.coords(rank)
    pp_rank, tp_rank = at.pp, at.tp
    mine = stage_entries(meta, resolved, pp_rank, tp_rank, expert_place(plan.mesh.shape, at)[0])
    by_expert = {e.name for e in mine if e.split.over == "ep"}  # whole on each rank of their group: never dp-sharded
    have = {n: tuple(t.shape) for n, t in model.state_dict().items()}  # a DTensor's shape: its whole tp slice
    want = {e.name: e.local_shape for e in mine}
    where = (f"dp_rank {at.dp}, " if dp > 1 else "") + f"pp_rank {pp_rank}, tp_rank {tp_rank}"
    problems = _summary(
        f"{where}: {{n}} tensors have other shapes than the plan gives this rank, e.g.",
        [f"{n}: {list(have[n])} here, {list(s)} in the plan" for n, s in want.items() if n in have and have[n] != s],
    )
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    if missing or extra:
        problems.append(f"{where}: should hold {len(want)} tensors but holds {len(have)}: missing {missing[:3]}"
                        f"{' ...' if len(missing) > 3 else ''}, unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''}")
    if not problems:
        problems = _summary(f"{where}: {{n}} layers are not what the plan makes of them:",
                            [p for e in mine if (p := _expected_layer(model, e, tp_rank))])
    replicas = dp * cp  # the ranks holding the same parameters: FSDP2 spreads them over all of them
    split = f"not split over its {replicas} data-parallel ranks" if replicas > 1 else "split over data-parallel ranks"
    ddp = replicas > 1 and plan.data_parallel.sharding == "replicate"  # torch's DDP keeps plain parameters
    # Over how many data-parallel ranks FSDP2 (or its replicate) spread each parameter; None: a plain tensor.
    spread = {n: p.device_mesh.size() if isinstance(p, DTensor) else None for n, p in model.named_parameters()}
    problems += _summary(
        f"{where}: the plan has mesh.dp={dp}" + (f" x cp={cp}" if cp > 1 else "") + f", but {{n}} parameters are {split}, e.g.",
        [f"{n}: " + (f"a DTensor over {s} ranks" if s else "a plain tensor") for n, s in spread.items()
         if (s or 1) != replicas and not (ddp and s is None) and n not in by_expert],
    )
    if problems:
        problems[-1] += "; pass the plan the model was rewritten with"
    # Each checkpoint tensor is written once, by the first stage holding it (`not seen.add`: always true).
    seen = {e.canonical for s in range(pp_rank) for e in stage_entries(meta, resolved, s, 0)}
    return problems, [e for e in mine if e.canonical not in seen and not seen.add(e.canonical) and e.name in have]
