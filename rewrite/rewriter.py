"""Applying a plan: in-place module surgery on every rank.

`apply_plan` binds the plan (identically on every rank, before any collective),
builds the mesh, swaps sharded linears for their parallel versions at the same
dotted paths, and carves out this rank's pipeline stage.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import torch.distributed as dist
from torch import nn

from . import fxsplit
from .backbone import run_backbone
from .comm import SharedInputCopy
from .layers import ColumnParallelLinear, RowParallelLinear
from .mesh import Mesh, build_mesh, check_world
from .plan import ParallelPlan, load_plan
from .replicated import make_grad_allreduce
from .resolve import ResolvedPlan, resolve
from .stage import Stage

__all__ = ["apply_plan", "apply_tensor_parallel", "carve_stage"]


def apply_plan(model: nn.Module, plan: ParallelPlan | str | Path | dict) -> Stage:
    """Rewrite `model` in place for this rank and return its `Stage`.

    Collective: every rank of the default process group calls it with the same
    model and plan. Global rank = pp_rank * tp + tp_rank.

    Args:
        model: a Hugging Face LLaMA-family model, or any module torch.fx can trace
            (the fx path is only needed when pp > 1).
        plan: a `ParallelPlan`, or a path / dict for `load_plan`.

    Returns:
        This rank's `Stage`. With pp == 1 `stage.model` is still a complete model
        (`model(input_ids=...)`, `model.generate(...)` work on every rank).

    Raises:
        ValueError: no process group, a world size other than pp * tp, or any
            problem `resolve` finds; raised on every rank before any collective,
            and the model is left untouched.

    Example:
        >>> dist.init_process_group("gloo")          # under torchrun, 2 processes
        >>> stage = apply_plan(model, "plans/llama-tp2.yaml")
        >>> logits = model(input_ids=ids).logits     # same as before, on every rank
    """
    plan = load_plan(plan)
    check_world(plan.mesh.pp, plan.mesh.tp)
    resolved = resolve(plan, model, world_size=dist.get_world_size())
    mesh = build_mesh(plan.mesh.pp, plan.mesh.tp)  # the first collective
    _check_ranks_agree(resolved, model)
    if mesh.tp > 1:
        apply_tensor_parallel(model, resolved, mesh.tp_group)
    return carve_stage(model, resolved, mesh)


def _check_ranks_agree(resolved: ResolvedPlan, model: nn.Module) -> None:
    """Every rank must bind the same plan to the same model, or stages would not fit."""
    text = resolved.plan.model_dump_json() + f"|{resolved.model_name}|{resolved.total_params}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, digest)
    if len(set(seen)) > 1:
        groups = {d: [r for r, x in enumerate(seen) if x == d] for d in set(seen)}
        raise ValueError(
            f"ranks were given different plans or models (ranks grouped by what they got: "
            f"{sorted(groups.values())}); pass the same plan and model on every rank"
        )


def apply_tensor_parallel(model: nn.Module, resolved: ResolvedPlan, group) -> None:
    """Swap each planned module in place for its tensor-parallel version over `group`."""
    copies: dict[str, SharedInputCopy] = {}
    for spec in resolved.shards:
        parent_name, _, name = spec.fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, name)
        if spec.style == "grad_allreduce":
            make_grad_allreduce(module, group)
            continue
        if spec.style in ("column", "column_gather"):
            # Siblings reading one activation (q/k/v; gate/up) share one backward all-reduce.
            shared = copies.setdefault(parent_name, SharedInputCopy(group))
            new = ColumnParallelLinear.from_linear(
                module, group=group, gather_output=spec.style == "column_gather", input_copy=shared
            )
        else:
            new = RowParallelLinear.from_linear(module, group=group, input_is_parallel=spec.style == "row")
        setattr(parent, name, new)


def carve_stage(model: nn.Module, resolved: ResolvedPlan, mesh: Mesh) -> Stage:
    """Keep only this rank's stage in `model` (in place) and wrap it in a `Stage`."""
    bb = resolved.backbone
    if bb is not None:
        return _carve_hf(model, resolved, mesh)
    if mesh.pp == 1:
        return Stage(model=model, module=model, resolved=resolved, mesh=mesh, forward_fn=model)
    traced = fxsplit.trace(model)
    graph = fxsplit.stage_graph(traced, list(resolved.cut_points), mesh.pp_rank)
    fxsplit.carve_unused(model, fxsplit.used_targets(graph))
    module = fxsplit.build_stage_module(model, graph)
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
