"""Cutting a plan's pipeline into stages: layer indices per stage (the LLaMA-family walker), or
module paths per stage from a torch.fx trace. Pure; used by `resolve`, problems returned, not raised.
"""

from __future__ import annotations

from torch import nn

from ..models import fx_graph
from ..models.flops import Costs
from ..models.hf_decoder import Backbone, backbone_problem
from ..models.oracle import exception_line
from .cuts import balanced_split, best_split
from ..plan.schema import ParallelPlan
from ..plan.size_checks import PipelineShape, stage_count, stages_words, too_many_stages
from ..plan.patterns import closest

__all__ = ["hf_stages", "fx_stages"]


def hf_stages(
    shape: PipelineShape, n: int, bb: Backbone, costs: Costs | str
) -> tuple[list[list[int]], list[str], list[str]]:
    """Layer indices per stage, the cut layers, and problems. `costs` is a message when unknown."""
    pp, cuts = shape.stages, shape.cut_points
    names = [bb.layer(i) for i in range(n)]
    if pp > n:
        return [], [], [too_many_stages(shape, n, "layers")]
    if cuts is None:
        starts = [sum(balanced_split(n, pp)[:s]) for s in range(pp)]
    elif cuts == "auto":
        if isinstance(costs, str):
            return [], [], [
                f"{shape.cuts_line}pipeline.cut_points: 'auto' cannot estimate "
                f"this model's compute: {costs}; list the "
                f"pp - 1 = {pp - 1} layers where stages start (e.g. {names[n // 2]!r}), or omit cut_points"
            ]
        sizes = best_split(costs.folded(), pp)
        starts = [sum(sizes[:s]) for s in range(pp)]
    else:
        problems, at, cuts = [], shape.cuts_line, list(cuts)
        for k, cut in enumerate(cuts):
            if cut not in names:
                problems.append(
                    f"{shape.cut_lines[k]}pipeline.cut_points[{k}] {cut!r} is not a layer of "
                    "the model's layer sequence "
                    f"({names[0]} .. {names[-1]}){closest(cut, names)}"
                )
        if problems:
            return [], [], problems
        starts = [0] + [names.index(c) for c in cuts]
        if starts != sorted(starts):
            return [], [], [
                f"{at}pipeline.cut_points {cuts} are out of order; list them as the layers run: "
                f"{sorted(cuts, key=names.index)}"
            ]
        if starts[1] == 0:
            return [], [], [
                f"{at}pipeline.cut_points[0] {cuts[0]!r} leaves stage 0 without a layer; cut after {names[0]}"
            ]
    bounds = starts + [n]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(pp)], [names[i] for i in starts[1:]], []


def fx_stages(plan: ParallelPlan, model: nn.Module) -> tuple[list[list[str]], list[str], list[str]]:
    pp, seq = stage_count(plan), fx_graph.layer_sequence(model)
    if plan.pipeline.cut_points == "auto":
        shown = ", ".join(seq[:4]) + (", ..." if len(seq) > 4 else "")
        fix = "omit cut_points: one stage needs none" if pp == 1 else (
            f"list the pp - 1 = {pp - 1} module paths where stages start (its layer sequence: {shown}), "
            "or omit cut_points for a balanced split"
        )
        return [], [], [
            "pipeline.cut_points: 'auto' balances the estimated compute of Hugging Face LLaMA-family layers, "
            f"but {type(model).__name__} is split by torch.fx and its modules have no cost estimate; {fix}"
        ]
    if pp == 1:
        return [[name for name, _ in model.named_children()]], [], []
    try:
        traced = fx_graph.trace(model)
    except ValueError as exc:
        walker = backbone_problem(model)
        if walker is None:
            return [], [], [str(exc)]
        return [], [], [
            f"{type(model).__name__} ({model.config.model_type}) cannot be split into pipeline stages: {walker}, "
            f"and torch.fx cannot trace it ({exception_line(exc.__cause__ or exc)}); use mesh.pp: 1"
        ]
    cuts = plan.pipeline.cut_points
    if cuts is None:
        if len(seq) < pp:
            return [], [], [
                f"{stages_words(PipelineShape.of(plan))}: a balanced split needs a layer sequence of at least {pp} modules, found "
                f"{len(seq)} in {type(model).__name__}; list pipeline.cut_points instead, or use at most "
                f"{len(seq)} stages (pp x virtual_stages)"
            ]
        cuts = [seq[sum(balanced_split(len(seq), pp)[:s])] for s in range(1, pp)]
    problems = fx_graph.split_problems(traced, list(cuts))
    if problems:
        return [], list(cuts), problems
    stages = []
    for s in range(pp):
        graph = fx_graph.stage_graph(traced, list(cuts), s)
        used = [n.target for n in graph.nodes if n.op in ("call_module", "get_attr")]
        collapsed = [next((e for e in seq if t == e or t.startswith(e + ".")), t) for t in used]
        stages.append(list(dict.fromkeys(collapsed)))
    return stages, list(cuts), []
