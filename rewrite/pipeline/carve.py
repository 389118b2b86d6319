"""Carving this rank's pipeline stage out of a model, in place.

HF LLaMA-family models keep their own module objects at their original paths (the
layer list becomes a `ModuleDict` keyed by original index); other modules become an
fx `GraphModule` over the model's own submodules. Everything this stage does not
run is released.
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from torch import fx, nn

from ..mesh import Mesh
from ..models import fx_graph
from ..models.hf_llama import run_backbone
from ..plan.resolve import ResolvedPlan
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .stage import Stage

__all__ = ["carve_stage", "carve_unused", "build_stage_module"]


def carve_stage(model: nn.Module, resolved: ResolvedPlan, mesh: Mesh) -> Stage:
    """Keep only this rank's stage in `model` (in place) and wrap it in a `Stage`."""
    bb = resolved.backbone
    if bb is not None:
        return _carve_hf(model, resolved, mesh)
    if mesh.pp == 1:
        return Stage(model=model, module=model, resolved=resolved, mesh=mesh, forward_fn=model)
    traced = fx_graph.trace(model, leaf_types=(ColumnParallelLinear, RowParallelLinear))
    graph = fx_graph.stage_graph(traced, list(resolved.cut_points), mesh.pp_rank)
    carve_unused(model, fx_graph.used_targets(graph))
    module = build_stage_module(model, graph)
    return Stage(model=model, module=module, resolved=resolved, mesh=mesh, forward_fn=module)


def _carve_hf(model: nn.Module, resolved: ResolvedPlan, mesh: Mesh) -> Stage:
    bb, s = resolved.backbone, mesh.pp_rank
    first, last = s == 0, s == mesh.pp - 1
    indices = list(resolved.layer_indices[s])
    base = model.get_submodule(bb.base) if bb.base else model
    tied_weight = None
    if bb.head and model.lm_head.weight is base.embed_tokens.weight:
        tied_weight = base.embed_tokens.weight
    if mesh.pp > 1:
        # Keep the original layer objects under their original indices; drop the rest.
        base.layers = nn.ModuleDict({str(i): base.layers[i] for i in indices})
        if not first:
            base.embed_tokens = None
        if not last:
            base.norm = None
            if bb.head:
                model.lm_head = None
    tied = []
    if tied_weight is not None and mesh.pp > 1 and (first or last):
        # Each end holds a copy of the shared matrix: start them equal, sum their grads.
        # (A meta-device model has no values yet: whoever materialises it loads both.)
        if not tied_weight.is_meta:
            dist.broadcast(tied_weight.data, src=mesh.global_rank(0), group=mesh.tied_group)
        tied = [tied_weight]
    forward = partial(run_backbone, model, bb, layer_indices=indices, first=first, last=last)
    return Stage(model=model, module=model, resolved=resolved, mesh=mesh, forward_fn=forward, tied=tied)


def carve_unused(model: nn.Module, keep: set[str]) -> None:
    """Remove, in place, every submodule, parameter and buffer no path in `keep` needs."""

    def join(path: str, name: str) -> str:
        return f"{path}.{name}" if path else name

    def needed(path: str) -> bool:
        return any(k == path or k.startswith(path + ".") or path.startswith(k + ".") for k in keep)

    def walk(module: nn.Module, path: str) -> None:
        if path in keep:
            return  # a module a stage calls keeps everything it holds
        for name in [*module._parameters, *module._buffers]:
            if join(path, name) not in keep:
                module._parameters.pop(name, None)
                module._buffers.pop(name, None)
        for name, child in list(module._modules.items()):
            if child is None or not needed(join(path, name)):
                delattr(module, name)
            else:
                walk(child, join(path, name))

    walk(model, "")


def build_stage_module(model: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule over `model`'s own submodules at their original paths."""
    return fx.GraphModule(model, graph, class_name=f"{type(model).__name__}Stage")
