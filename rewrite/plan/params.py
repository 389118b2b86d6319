"""The one walk over the parameters a rank holds: each once, with its shape after tensor parallelism.

`resolve` counts each stage's parameters with it; `rewrite.estimate` adds data-parallel
sharding (memory) and sums per stage or rank (balance) on top of the same walk.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from .tp_rules import ShardSpec

__all__ = ["HeldParameter", "held_parameters", "held_count"]


@dataclass(frozen=True)
class HeldParameter:
    """One parameter as a rank holds it."""

    name: str  # its first path in the model (a tied parameter's other paths are skipped)
    shape: tuple[int, ...]  # on each tp rank: the shard's shape where the plan splits it
    element_size: int  # bytes per element

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def held_parameters(
    model: nn.Module, modules: Iterable[str], shards: Mapping[str, ShardSpec] | Iterable[ShardSpec] = ()
) -> list[HeldParameter]:
    """Every parameter under `modules` ("" for the whole model), each once, with its per-rank shape.

    Args:
        model: the model the plan was resolved against (meta will do); not changed.
        modules: module paths a rank runs.
        shards: the plan's `ShardSpec`s (or fqn -> spec); a `grad_allreduce` module is whole.

    Example:
        >>> sum(p.numel for p in held_parameters(model, ["model.layers.0"], resolved.shards))
    """
    modules = tuple(modules)
    specs = shards.values() if isinstance(shards, Mapping) else shards
    split = {s.fqn: s for s in specs if s.style != "grad_allreduce"}
    seen, out = set(), []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen or not any(not m or name == m or name.startswith(m + ".") for m in modules):
            continue
        seen.add(id(param))
        owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        shard = split.get(owner)
        shape = {"weight": shard.weight_shape, "bias": shard.bias_shape}.get(leaf) if shard else None
        out.append(HeldParameter(name, tuple(shape or param.shape), param.element_size()))
    return out


def held_count(model: nn.Module, modules: Iterable[str], shards: Mapping[str, ShardSpec] | Iterable[ShardSpec] = ()) -> int:
    """Elements of `held_parameters`: what a rank holds for `modules`."""
    return sum(p.numel for p in held_parameters(model, modules, shards))
