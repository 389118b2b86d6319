"""Where a pipeline is cut: layers per stage, even by count or balanced by a cost per layer; a plan's stages
as layer indices (the LLaMA-family walker) or module paths (a torch.fx trace). Problems returned, not raised.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ..models import fx_graph
from ..models.flops import Costs
from ..models.hf_decoder import Backbone, backbone_problem
from ..models.oracle import exception_line
from ..plan.patterns import closest
from ..plan.schema import ParallelPlan, PlanError
from ..plan.size_checks import PipelineShape, stages_words, too_many_stages
from .tp_rules import TpRules

if TYPE_CHECKING:
    from .resolve import BindSteps

__all__ = ["balanced_split", "best_split", "hf_stages", "fx_stages", "Cut", "hf_cut", "fx_cut"]


def balanced_split(num_layers: int, pp: int) -> list[int]:
    """Layers per stage, differing by at most one; the first `num_layers % pp` stages get the extra
    (the last stage also runs the norm and the often large LM head)."""
    base, extra = divmod(num_layers, pp)
    return [base + (s < extra) for s in range(pp)]


def _fewest_stages(weights: Sequence[int], bound: int) -> int:
    """Stages needed when each holds as many layers as fit under `bound` (each weight fits)."""
    stages, load = 1, 0
    for w in weights:
        if load + w > bound:
            stages, load = stages + 1, 0
        load += w
    return stages


def best_split(weights: Sequence[int], pp: int) -> list[int]:
    """Layers per stage: `pp` contiguous non-empty stages whose most loaded is lightest.

    Exact. Of the splits with the lightest most loaded stage, the one whose next most loaded stage is
    lightest, and so on; of those still equal, the one giving the earliest stages the most layers.

    Args:
        weights: non-negative integer cost per layer, in order (see `Costs.folded`).
        pp: the number of stages, 1 <= pp <= len(weights).

    Example:
        >>> best_split([1, 1, 1, 1, 1, 3], 2)
        [4, 2]
    """
    n = len(weights)
    if not 1 <= pp <= n:
        raise ValueError(f"best_split: {pp} stages for {n} layers; need 1 <= pp <= {n}")
    # The lightest bound that pp stages can meet: binary search with the greedy packing.
    low, high = max(weights), sum(weights)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if _fewest_stages(weights, mid) <= pp else (mid + 1, high)
    prefix = [0, *itertools.accumulate(weights)]
    # best[j]: (stage costs sorted heaviest first, minus the stage sizes) of the best split of
    # the first j layers into k stages. Adding the same stage to two splits keeps their order,
    # so the best split of j layers extends a best split of fewer.
    best: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {0: ((), ())}
    for k in range(1, pp + 1):
        step = {}
        for j in range(k, n - (pp - k) + 1):  # leave every later stage a layer
            for i in range(j - 1, k - 2, -1):  # the k-th stage holds layers i .. j-1
                cost = prefix[j] - prefix[i]
                if cost > low:
                    break  # only heavier further back
                if i in best:
                    loads, sizes = best[i]
                    key = (tuple(sorted((*loads, cost), reverse=True)), (*sizes, i - j))
                    if j not in step or key < step[j]:
                        step[j] = key
        best = step
    return [-size for size in best[n][1]]


def hf_stages(shape: PipelineShape, bb: Backbone, costs: Costs | str) -> tuple[list[list[int]], list[str], list[str]]:
    """Layer indices per stage, the cut layers, and problems. `costs` is a message when unknown."""
    pp, cuts, n = shape.stages, shape.cut_points, bb.num_layers
    names = [bb.layer(i) for i in range(n)]
    if pp > n:
        return [], [], [too_many_stages(shape, n, "layers")]
    if cuts is None:
        starts = _starts(balanced_split(n, pp))
    elif cuts == "auto":
        if isinstance(costs, str):
            return [], [], [f"{shape.cuts_line}pipeline.cut_points: 'auto' cannot estimate "
                            f"this model's compute: {costs}; list the "
                            f"pp - 1 = {pp - 1} layers where stages start (e.g. {names[n // 2]!r}), or omit cut_points"]
        starts = _starts(best_split(costs.folded(), pp))
    else:
        at, cuts = shape.cuts_line, list(cuts)
        problems = [f"{shape.cut_lines[k]}pipeline.cut_points[{k}] {cut!r} is not a layer of the model's layer "
                    f"sequence ({names[0]} .. {names[-1]}){closest(cut, names)}"
                    for k, cut in enumerate(cuts) if cut not in names]
        if problems:
            return [], [], problems
        starts = [0] + [names.index(c) for c in cuts]
        if starts != sorted(starts):
            return [], [], [f"{at}pipeline.cut_points {cuts} are out of order; list them as the layers run: "
                            f"{sorted(cuts, key=names.index)}"]
        if starts[1] == 0:
            return [], [], [f"{at}pipeline.cut_points[0] {cuts[0]!r} leaves stage 0 without a layer; cut after "
                            f"{names[0]}"]
    bounds = starts + [n]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(pp)], [names[i] for i in starts[1:]], []


def _starts(sizes: list[int]) -> list[int]:
    """The first layer of each stage, from layers per stage."""
    return [0, *itertools.accumulate(sizes[:-1])]


def fx_stages(plan: ParallelPlan, model: nn.Module) -> tuple[list[list[str]], list[str], list[str]]:
    """Module paths per stage, the cuts and problems, from a torch.fx trace cut at the plan's cut points."""
    pp, seq = PipelineShape.of(plan).stages, fx_graph.layer_sequence(model)
    if plan.pipeline.cut_points == "auto":
        shown = ", ".join(seq[:4]) + (", ..." if len(seq) > 4 else "")
        fix = "omit cut_points: one stage needs none" if pp == 1 else (f"list the pp - 1 = {pp - 1} module paths where "
                                                                       f"stages start (its layer sequence: {shown}), "
                                                                       "or omit cut_points for a balanced split")
        return [], [], ["pipeline.cut_points: 'auto' balances the estimated compute of Hugging Face LLaMA-family "
                        f"layers, but {type(model).__name__} is split by torch.fx and its modules have no cost "
                        f"estimate; {fix}"]
    if pp == 1:
        return [[name for name, _ in model.named_children()]], [], []
    try:
        traced = fx_graph.trace(model)
    except ValueError as exc:
        walker = backbone_problem(model)
        if walker is None:
            return [], [], [str(exc)]
        return [], [], [f"{type(model).__name__} ({model.config.model_type}) cannot be split into pipeline stages: "
                        f"{walker}, and torch.fx cannot trace it ({exception_line(exc.__cause__ or exc)}); use "
                        "mesh.pp: 1"]
    cuts = plan.pipeline.cut_points
    if cuts is None:
        if len(seq) < pp:
            return [], [], [f"{stages_words(PipelineShape.of(plan))}: a balanced split needs a layer sequence of at "
                            f"least {pp} modules, found {len(seq)} in {type(model).__name__}; list pipeline.cut_points "
                            f"instead, or use at most {len(seq)} stages (pp x virtual_stages)"]
        cuts = [seq[i] for i in _starts(balanced_split(len(seq), pp))[1:]]
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


@dataclass
class Cut:
    """The model cut into stages: per stage its modules, layer indices and layer names; the cuts, costs, problems."""

    module_sets: list[list[str]]
    layer_sets: list[list[int]]
    layer_names: list[list[str]]
    cuts: list[str]
    costs: Costs | None
    problems: list[str]


def hf_cut(steps: BindSteps, plan: ParallelPlan, bb: Backbone, rules: TpRules, shards: tuple) -> Cut:
    """A Hugging Face decoder's layers cut into stages (by estimated cost for `cut_points: auto`)."""
    model, shape = steps.model, PipelineShape.of(plan)
    guard = steps.walker()
    if guard:  # every other problem would be moot: no plan runs this family correctly
        raise PlanError(plan.source, [f"{type(model).__name__} ({model.config.model_type}): {guard}; rewrite refuses "
                                      "it rather than train a different model, and no plan setting changes that"])
    costs = steps.costs(rules.tp, plan.pipeline.seq_len, bb, shards)
    layer_sets, cuts, stage_problems = steps.stages(shape, bb, costs)
    stage_problems = list(stage_problems)
    norm = model.get_submodule(bb.norm)
    pp = shape.stages
    if bb.norm_first and pp > 1 and any(True for _ in norm.parameters()):
        stage_problems.append(f"{plan.where('mesh', 'pp')}mesh.pp={plan.mesh.pp}: {type(model).__name__} runs "
                              f"{bb.norm} before its first layer and after its last, on two ranks, and its weights "
                              "would be a second copy to keep equal; use pp 1")
    module_sets = [bb.stage_modules(ls, first=s == 0, last=s == pp - 1) for s, ls in enumerate(layer_sets)]
    layer_names = [[bb.layer(i) for i in ls] for ls in layer_sets]
    return Cut(module_sets, layer_sets, layer_names, cuts, costs if isinstance(costs, Costs) else None, stage_problems)


def fx_cut(plan: ParallelPlan, model: nn.Module) -> Cut:
    """Any other model cut by torch.fx tracing at the plan's cut points."""
    module_sets, cuts, stage_problems = fx_stages(plan, model)
    if plan.mesh.cp > 1:
        stage_problems.append(
            f"{plan.where('mesh', 'cp')}mesh.cp={plan.mesh.cp}: context parallelism runs a Hugging Face decoder "
            f"model's own attention on sequence shards, and {type(model).__name__} is not one; use cp 1")
    return Cut(module_sets, [], module_sets, cuts, None, stage_problems)
