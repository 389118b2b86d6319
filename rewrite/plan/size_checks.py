"""Problems of a plan's sizes against a model or a world, each naming the sizes that would work."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .schema import ParallelPlan
from .wording import common_divisors, either

__all__ = ["PipelineShape", "too_many_stages", "stages_words", "by_line", "world_problem"]


@dataclass(frozen=True)
class PipelineShape:
    """All that cutting a model into stages reads of a plan: the sizes, the cuts, the lines naming them.

    Hashable: a plan search keeps cuts by it, and what is not here cannot be read (nor left out of that key).
    """

    pp: int
    virtual_stages: int
    cut_points: tuple[str, ...] | str | None
    pp_line: str = ""  # "line 3: " when the plan came from a file
    cuts_line: str = ""
    cut_lines: tuple[str, ...] = ()  # one per listed cut point

    @classmethod
    def of(cls, plan: ParallelPlan) -> PipelineShape:
        cuts = plan.pipeline.cut_points
        listed = isinstance(cuts, list)
        return cls(plan.mesh.pp, plan.pipeline.virtual_stages, tuple(cuts) if listed else cuts,
                   plan.where("mesh", "pp"), plan.where("pipeline", "cut_points"),
                   tuple(plan.where("pipeline", "cut_points", k) for k in range(len(cuts))) if listed else ())

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages


def too_many_stages(shape: PipelineShape, n: int, what: str) -> str:
    """More stages than `n` layers: the pp values that fit, and those that split the layers evenly."""
    k = shape.virtual_stages
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
    return (f"{shape.pp_line}{stages_words(shape)} but the model has {n} {what}; each stage needs at least "
            f"one layer: {fix}")


def stages_words(shape: PipelineShape) -> str:
    if shape.virtual_stages == 1:
        return f"mesh.pp={shape.pp} stages"
    return f"mesh.pp={shape.pp} x pipeline.virtual_stages={shape.virtual_stages} = {shape.stages} stages"


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
    return (f"{plan.where('mesh')}mesh: {mesh.shape_text()} = {mesh.world_size} ranks, but the world size is "
            f"{world_size}; launch {mesh.world_size} processes {fix}")
