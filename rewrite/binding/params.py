"""The one walk over the parameters a rank holds: each once, with its shape after tensor parallelism.
`resolve` counts each stage's parameters with it; `rewrite.estimate` builds memory and balance on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import nn

from ..plan.styles import WHOLE_STYLES
from .experts import ExpertSpec
from .tp_rules import ShardSpec

__all__ = ["HeldParameter", "held_parameters", "held_by_stage", "parameter_walk"]


@dataclass(frozen=True)
class HeldParameter:
    """One parameter as a rank holds it."""

    name: str  # its first path in the model (a tied parameter's other paths are skipped)
    shape: tuple[int, ...]  # on each tp rank: the shard's shape where the plan splits it
    element_size: int  # bytes per element
    ident: int = field(default=0, compare=False, repr=False)  # id() of the parameter: one tied to another is one
    by_expert: bool = False  # experts split over ep (its shape a rank's E / ep): never sharded over dp
    trained: bool = True  # has a gradient and optimizer state (under a LoRA plan, only the adapters do)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def held_parameters(model: nn.Module, modules: Iterable[str], shards: Iterable[ShardSpec] = ()) -> list[HeldParameter]:
    """Every parameter under `modules` ("" for the whole model) of `model` (meta will do), each once, with its
    per-rank shape under the plan's `shards` (`held_by_stage` of one set)."""
    return held_by_stage(model, [modules], shards)[0]


def parameter_walk(model: nn.Module) -> tuple[tuple, ...]:
    """(name, shape, bytes per element, id, the module paths it is inside, owner, leaf) of every parameter
    path of `model`, tied ones at each path: what `held_by_stage` reads, kept by a search across calls."""
    out = []
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        out.append((name, tuple(param.shape), param.element_size(), id(param), tuple(_prefixes(name)), owner, leaf))
    return tuple(out)


def held_by_stage(
    model: nn.Module, module_sets: Sequence[Iterable[str]], shards: Iterable[ShardSpec] = (),
    walk: tuple[tuple, ...] | None = None, experts: Iterable[ExpertSpec] = (),
) -> list[list[HeldParameter]]:
    """`held_parameters` of each set of modules (a stage's), in one walk over the model's parameters
    (`walk`: `parameter_walk(model)`, when the caller keeps it); `experts` as `ExpertSpec.split_of` holds them.
    A parameter shared by two sets (tied embeddings) is in both; `HeldParameter.ident` says it is one.
    """
    sets = [set(m) for m in module_sets]
    split = {s.fqn: s for s in shards if s.style not in WHOLE_STYLES}
    by_expert = {s.fqn: s for s in experts if s.splits}
    # Which sets hold each module path: a parameter is looked up by its few prefixes, not tested against
    # every set (a 70B model over 32 stages: 700 parameters x 32 sets per walk otherwise).
    everything = {i for i, modules in enumerate(sets) if "" in modules}
    holders: dict[str, set[int]] = {}
    for i, modules in enumerate(sets):
        for module in modules:
            holders.setdefault(module, set()).add(i)
    seen: list[set[int]] = [set() for _ in sets]
    out: list[list[HeldParameter]] = [[] for _ in sets]
    for name, whole, element_size, ident, prefixes, owner, leaf in walk or parameter_walk(model):
        found = everything.union(*(holders.get(prefix, ()) for prefix in prefixes))
        if not found:
            continue
        shard, spec, own = split.get(owner), by_expert.get(owner), split.get(name)
        shape = {"weight": shard.weight_shape, "bias": shard.bias_shape}.get(leaf) if shard else None
        if own is not None and own.parameter:  # a bare parameter split with the heads
            shape = own.weight_shape
        if spec is not None:
            shape = spec.split_of(leaf).local_shape(whole)
        held = HeldParameter(name, tuple(shape or whole), element_size, ident, spec is not None and spec.ep > 1)
        for i in sorted(found):
            if ident not in seen[i]:
                seen[i].add(ident)
                out[i].append(held)
    return out


def _prefixes(name: str) -> list[str]:
    """`a.b.c` -> [a, a.b, a.b.c]: the module paths a parameter named `name` is inside (and itself)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]

