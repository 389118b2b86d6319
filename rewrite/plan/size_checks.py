"""Problems of a plan's sizes against a model or a world, each naming the sizes that would work."""

from __future__ import annotations

import re

from .schema import ParallelPlan
from .wording import common_divisors, either

__all__ = ["too_many_stages", "stage_count", "stages_words", "by_line", "world_problem"]


def too_many_stages(plan: ParallelPlan, n: int, what: str) -> str:
    """More stages than `n` layers: the pp values that fit, and those that split the layers evenly."""
    k = plan.pipeline.virtual_stages
    most = n // k  # the largest pp with at least one layer per stage
    if most == 0:
        fix = f"set pipeline.virtual_stages to at most {n}, with mesh.pp: 1"
    else:
        even = [d for d in range(1, most + 1) if n % (d * k) == 0][:8]
        fits = f"pp 1-{most}" if most > 2 else f"pp {either(range(1, most + 1))}"
        with_k = f" with virtual_stages {k}" if k > 1 else ""
        fix = f"use {fits}{with_k} (an even split: pp {either(even)})"
        if k > 1:
            fix += f", or lower pipeline.virtual_stages so that pp x virtual_stages <= {n}"
    return (
        f"{plan.where('mesh', 'pp')}{stages_words(plan)} but the model has {n} {what}; each stage needs at least "
        f"one layer: {fix}"
    )


def stage_count(plan: ParallelPlan) -> int:
    return plan.mesh.pp * plan.pipeline.virtual_stages


def stages_words(plan: ParallelPlan) -> str:
    k = plan.pipeline.virtual_stages
    if k == 1:
        return f"mesh.pp={plan.mesh.pp} stages"
    return f"mesh.pp={plan.mesh.pp} x pipeline.virtual_stages={k} = {plan.mesh.pp * k} stages"


def by_line(problems: list[str]) -> list[str]:
    """Problems that name a line of the plan file in file order, as load_plan gives its own; the rest after."""
    def line(problem: str) -> int:
        match = re.match(r"line (\d+): ", problem)
        return int(match.group(1)) if match else 10**9

    return sorted(problems, key=line)  # stable: a plan given as a dict keeps the order found


def world_problem(plan: ParallelPlan, world_size: int) -> str:
    """The mesh does not fill the world: which dp (same pp and tp) would, or which pp x tp divide it."""
    mesh, per_replica = plan.mesh, plan.mesh.pp * plan.mesh.tp
    if world_size >= 1 and world_size % per_replica == 0:
        fix = f"or set mesh.dp: {world_size // per_replica} (pp x tp = {per_replica} ranks per replica)"
    elif world_size >= 1:
        fix = f"or change the mesh: pp x tp must divide {world_size} ({either(common_divisors(world_size))})"
    else:
        fix = "or change the mesh"
    return (
        f"{plan.where('mesh')}mesh: {mesh.shape_text()} = {mesh.world_size} ranks, but the world size is "
        f"{world_size}; launch {mesh.world_size} processes {fix}"
    )
