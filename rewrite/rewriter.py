"""Applying a plan: in-place module surgery on every rank.

`apply_plan` binds the plan (identically on every rank, before any collective),
builds the mesh, swaps sharded linears for their parallel versions at the same
dotted paths, and carves out this rank's pipeline stage.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.distributed as dist
from torch import nn

from .mesh import build_mesh, check_world
from .pipeline.carve import carve_stage
from .pipeline.stage import Stage
from .plan.resolve import ResolvedPlan, resolve
from .plan.schema import ParallelPlan, load_plan
from .tensor_parallel.apply import apply_tensor_parallel

__all__ = ["apply_plan"]


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
