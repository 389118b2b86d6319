"""Applying a bound plan's tensor-parallel rules in place, over one group: module swaps,
then sequence parallelism when the plan asks for it.

Bare per-head parameters (attention sinks, `binding.tp_params`) keep this tp rank's slice of dim 0, its
heads' values; each rank's gradient is its slice's whole gradient: nothing to sum. The owner remembers
which of its parameters are split, for the HF save (`split_parameters`).
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from ..models.blocks import ATTENTION
from ..models.families import set_local_kv_groups
from ..binding.heads import head_counts
from ..binding.latent_attention import STYLE as LATENT_STYLE, rope_width
from ..binding.resolve import ResolvedPlan
from ..binding.shard_layout import TensorSplit
from ..plan.styles import COLUMN_STYLES, STYLE_INFO, packed_parts
from .comm import SharedInputCopy, group_rank
from .layers import ColumnParallelLinear, RowParallelLinear
from .mixins import add_mixin
from .partial_grads import make_grad_allreduce
from .sequence_model import apply_sequence_parallel, make_rotary_key_copy
from .vocab import VocabParallelEmbedding

__all__ = ["apply_tensor_parallel", "split_head_parameter", "split_parameters"]

_SPLIT = "_rewrite_split_parameters"


def apply_tensor_parallel(model: nn.Module, resolved: ResolvedPlan, group, *, kv_group=None) -> None:
    """Swap each planned module in place for its tensor-parallel version over `group`.

    A weight shared by two modules (tied embeddings) stays shared: both ends are
    split along the vocabulary alike, so the second end reuses the first's shard.
    k/v projections past their kv heads (`ShardSpec.replicas` > 1) hold whole kv heads,
    their gradients summed over `kv_group` (`Mesh.kv_group`), and their attention is told
    its rank's query heads per kv head.
    """
    columns = Counter(s.fqn.rpartition(".")[0] for s in resolved.shards if s.style in COLUMN_STYLES and not s.parameter)
    # Siblings reading one activation (q/k/v; gate/up) share one backward all-reduce.
    copies = {p: SharedInputCopy(group) for p, n in columns.items() if n > 1 and p}
    sharded: dict[int, nn.Parameter] = {}  # id of a replaced weight -> the shard that replaced it
    head = resolved.backbone.head if resolved.backbone is not None else None
    for spec in resolved.shards:
        if spec.parameter:  # attention sinks: this rank's heads' values
            split_head_parameter(model, spec.fqn, group_rank(group), spec.tp)
            continue
        parent_name, _, name = spec.fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, name)
        if spec.style == "grad_allreduce":
            make_grad_allreduce(module, group)
            continue
        if spec.style == LATENT_STYLE:  # multi-head latent attention: the rotary key's gradient summed
            make_rotary_key_copy(module, group, rope_width(model, parent))
            continue
        if spec.style == "vocab":
            new = VocabParallelEmbedding.from_embedding(module, group=group)
        elif spec.style in COLUMN_STYLES:
            # The LM head under loss_parallel still gathers for model(...); the runner asks for shards.
            new = ColumnParallelLinear.from_linear(
                module, group=group, gather_output=STYLE_INFO[spec.style].gathers_output or spec.fqn == head,
                input_copy=copies.get(parent_name), parts=packed_parts(spec.style),
                replicas=spec.replicas, replica_group=kv_group if spec.replicas > 1 else None,
            )
        else:
            new = RowParallelLinear.from_linear(module, group=group, input_is_parallel=STYLE_INFO[spec.style].input_sharded)
        if id(module.weight) in sharded:
            new.weight = sharded[id(module.weight)]  # tied: the same rows of the same matrix
        sharded[id(module.weight)] = new.weight
        setattr(parent, name, new)
        if spec.replicas > 1 and spec.fqn.endswith(f".{ATTENTION.kv[0]}"):
            heads, kv = head_counts(model.config, spec.out_features)
            # A rank: H / tp query heads against kv / slices (one) whole kv heads.
            set_local_kv_groups(parent, heads // spec.tp, kv // spec.slices)
    for parent_name, shared in copies.items():
        add_mixin(model.get_submodule(parent_name), _ForgetsInputCopy).input_copy_cache = shared
    if resolved.plan.sequence_parallel:
        split = {e.fqn for e in resolved.experts if e.ep > 1 or e.tp > 1}  # left to expert_parallel
        apply_sequence_parallel(model, resolved.backbone, group, {s.fqn: s.style for s in resolved.shards}, split)


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


class _ForgetsInputCopy:
    """A block whose column layers share an input copy: the cache goes when its forward returns."""

    input_copy_cache: SharedInputCopy

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.input_copy_cache.forget()
