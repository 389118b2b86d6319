"""Binding a plan to a model: expand patterns, check shapes, heads and cut points.

Pure: it reads the model (a meta-device model will do) and never changes it, and
it needs no process group. Every problem is collected and raised once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..models.flops import Costs, estimate_costs
from ..models.hf_decoder import Backbone, find_backbone
from ..models.oracle import narrowed_problem, walker_problem
from ..schedules import placement
from .params import HeldParameter, held_by_stage, held_parameters, parameter_walk
from ..plan.schema import ParallelPlan, PlanError
from ..plan.size_checks import PipelineShape, by_line, stage_count, world_problem
from .stage_split import fx_stages, hf_stages
from ..plan.patterns import closest, match_pattern
from ..plan.styles import WHOLE_STYLES
from .experts import ExpertSpec, expert_problems
from .shard_layout import TensorSplit, state_split
from .tp_rules import ShardSpec, TpRules, shard_problems
from ..plan.wording import collapse_repeats
from .tp_switches import option_problems
from ..plan.loading import load_plan_for

__all__ = ["ResolvedPlan", "StageSpec", "resolve", "APPLIED"]

# Set on a model by apply_plan: which stage of which plan it now holds.
APPLIED = "_rewrite_applied"


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: the modules it runs, in order, and its parameters per rank."""

    stage_idx: int
    modules: tuple[str, ...]
    layers: tuple[str, ...]
    param_count: int  # on each rank of the stage, after tensor-parallel sharding
    param_bytes: int
    est_compute: float | None = None  # share of the step's estimated training FLOPs; "hf" only
    held: tuple[HeldParameter, ...] = field(default=(), compare=False, repr=False)  # its parameters, as a rank holds them


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan bound to a model: what the rewriter applies and `rewrite show` prints."""

    plan: ParallelPlan
    model_name: str
    kind: str  # "hf": the LLaMA-family walker; "fx": torch.fx tracing
    backbone: Backbone | None
    shards: tuple[ShardSpec, ...]
    stages: tuple[StageSpec, ...]
    cut_points: tuple[str, ...]
    total_params: int
    total_bytes: int
    layer_indices: tuple[tuple[int, ...], ...] = field(default=())  # per stage, "hf" only
    costs: Costs | None = None  # estimated compute per part, for pipeline.seq_len tokens; "hf" only
    stage_rank: tuple[int, ...] = (0,)  # the pp rank holding each stage
    recomputed: tuple[str, ...] = ()  # modules whose activations are recomputed (activation_checkpointing)
    warnings: tuple[str, ...] = ()  # valid, but worth a line at `validate` and `show` (a rule that changes nothing)
    experts: tuple[ExpertSpec, ...] = ()  # fused experts modules split over mesh.ep (each checked, ep > 1 or not)

    @property
    def num_stages(self) -> int:
        """Pipeline stages: pp * pipeline.virtual_stages."""
        return len(self.stages)

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pp rank `pp_rank` holds, in model order."""
        return tuple(s for s, r in enumerate(self.stage_rank) if r == pp_rank)

    def rank_modules(self, pp_rank: int) -> tuple[str, ...]:
        """Module paths the stages of `pp_rank` run, in model order, each once."""
        mods = [m for s in self.rank_stages(pp_rank) for m in self.stages[s].modules]
        return tuple(dict.fromkeys(mods))

    @property
    def tp(self) -> int:
        return self.plan.mesh.tp

    @property
    def pp(self) -> int:
        return self.plan.mesh.pp

    @property
    def world_size(self) -> int:
        return self.plan.mesh.world_size

    def split_of(self, name: str) -> TensorSplit:
        """How each rank holds state-dict tensor `name` (`shard_layout.state_split`)."""
        return state_split(self._by_fqn[0], self._by_fqn[1], name)

    @functools.cached_property
    def _by_fqn(self) -> tuple[dict, dict]:
        return {s.fqn: s for s in self.shards}, {e.fqn: e for e in self.experts}

    @property
    def kv_replicas(self) -> int:
        """tp ranks holding each kv head (tp / kv when tp passes the kv heads; 1 when tp divides them)."""
        return max((s.replicas for s in self.shards), default=1)


def _recomputed(plan: ParallelPlan, modules: dict[str, nn.Module]) -> tuple[list[str], list[str]]:
    """Modules `activation_checkpointing` matches (the outermost of nested matches), and problems."""
    names, hits, problems = [n for n in modules if n], [], []
    for pattern in plan.activation_checkpointing:
        found = [n for n in names if match_pattern(pattern, n)]
        if not found:
            problems.append(
                f"{plan.where('activation_checkpointing', pattern)}activation_checkpointing[{pattern!r}] matches "
                f"no module{closest(pattern, names)}"
            )
        hits += found
    hits = list(dict.fromkeys(hits))
    return [n for n in hits if not any(n.startswith(h + ".") for h in hits)], problems


def _estimate(rules: TpRules, seq_len: int, model: nn.Module, bb: Backbone, n: int, shards: tuple) -> Costs | str:
    """Estimated compute per part on one rank of its stage, or why there is none (`shards`: `rules` bound)."""
    sharded = [s.fqn for s in shards if s.style not in WHOLE_STYLES] if rules.tp > 1 else []
    try:
        return estimate_costs(model.config, bb, num_layers=n, seq_len=seq_len, tp=rules.tp, sharded=sharded)
    except ValueError as exc:
        return str(exc)


def _memo(cache: dict | None, key: tuple, make: Callable[[], object]):
    """`make()`, computed once per `key` when a cache is given (None: not cached).

    `key` names the result and holds everything of the plan it depends on, as hashable values
    (`TpRules`, `PipelineShape`, sizes); what it reads of the model is left out: a cache is kept
    for one unchanged model.
    """
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _parallel_modules(modules: dict[str, nn.Module]) -> list[str]:
    # Parallel layers expose `shard_of` (the slicing rule of tensor_parallel.layers).
    return [f for f, m in modules.items() if callable(getattr(m, "shard_of", None))]


def _bind_shards(rules: TpRules, model: nn.Module, modules: dict[str, nn.Module]) -> tuple[tuple, tuple, tuple]:
    """(shards, problems, notes) of the tensor_parallel rules, the model's own forward checked on them."""
    notes: list[str] = []
    shards, problems = shard_problems(rules, model, modules, notes)
    if rules.tp > 1 and not problems and hasattr(getattr(model, "config", None), "model_type"):
        narrowed = narrowed_problem(model, {s.fqn: s.style for s in shards}, [s.fqn for s in shards if s.replicas > 1])
        problems += [f"{type(model).__name__} ({model.config.model_type}): {narrowed}"] if narrowed else []
    return tuple(shards), tuple(problems), tuple(notes)


def _totals(model: nn.Module) -> tuple[int, int]:
    whole = held_parameters(model, [""])
    return sum(p.numel for p in whole), sum(p.numel * p.element_size for p in whole)


def resolve(
    plan: ParallelPlan | str | Path | dict, model: nn.Module, *, world_size: int | None = None, cache: dict | None = None
) -> ResolvedPlan:
    """Bind a plan to a model, checking everything that needs the model.

    Args:
        plan: a `ParallelPlan`, or anything `load_plan` takes.
        model: the model to bind to (it is not changed; a meta-device model works).
        world_size: when given, must equal `mesh.dp * mesh.pp * mesh.cp * mesh.tp`.
        cache: a dict kept across calls on the same, unchanged model (a plan search): what depends only on
            the tensor_parallel rules and tp (shards, their checks, costs) or on the stages' modules
            (their parameters) is computed once, not per mesh, schedule or switch.

    Returns:
        A `ResolvedPlan`: per module its style and per-rank shapes, per stage its modules.

    Raises:
        PlanError (a ValueError): every problem found, each with the fix.

    Example:
        >>> resolved = resolve("plans/llama-tp2.yaml", model)
        >>> resolved.shards[0].weight_shape
        (32, 64)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"resolve() needs an nn.Module, got {type(model).__name__}")
    plan = load_plan_for(plan, model)  # a refused file's problems and the model's, so all are fixed in one go
    pp, problems = stage_count(plan), []
    if world_size is not None and world_size != plan.mesh.world_size:
        problems.append(world_problem(plan, world_size))
    applied = getattr(model, APPLIED, None)
    if applied:
        raise PlanError(plan.source, [
            f"the model was already rewritten by apply_plan (it holds {applied}); "
            "apply a plan to a model that has not been rewritten (build or load it again)"
        ])
    modules = _memo(cache, ("modules",), lambda: dict(model.named_modules()))
    done = _memo(cache, ("parallel",), lambda: _parallel_modules(modules))
    if done:
        raise PlanError(plan.source, [f"the model is already rewritten ({done[0]} is parallel); bind plans to an unmodified model"])
    rules, seq_len, shape = TpRules.of(plan), plan.pipeline.seq_len, PipelineShape.of(plan)
    shards, tp_problems, notes = _memo(cache, ("shards", rules), lambda: _bind_shards(rules, model, modules))
    problems += tp_problems
    experts, expert_issues = expert_problems(plan, model, modules)
    problems += expert_issues
    recomputed, ac_problems = _recomputed(plan, modules)
    problems += ac_problems
    bb = find_backbone(model)
    costs: Costs | str | None = None
    if bb is not None:
        guard = _memo(cache, ("walker",), lambda: walker_problem(model))
        if guard:  # every other problem would be moot: no plan runs this family correctly
            raise PlanError(plan.source, [
                f"{type(model).__name__} ({model.config.model_type}): {guard}; rewrite refuses it rather than train a "
                "different model, and no plan setting changes that"
            ])
        n = bb.num_layers
        costs = _memo(cache, ("costs", rules, seq_len), lambda: _estimate(rules, seq_len, model, bb, n, shards))
        layer_sets, cuts, stage_problems = _memo(cache, ("stages", rules, seq_len, shape),
                                                 lambda: hf_stages(shape, n, bb, costs))
        stage_problems = list(stage_problems)
        norm = model.get_submodule(bb.norm)
        if bb.norm_first and pp > 1 and any(True for _ in norm.parameters()):
            stage_problems.append(
                f"{plan.where('mesh', 'pp')}mesh.pp={plan.mesh.pp}: {type(model).__name__} runs {bb.norm} "
                "before its first layer and after its last, on two ranks, and its weights would be a second copy "
                "to keep equal; use pp 1"
            )
        module_sets = [bb.stage_modules(ls, first=s == 0, last=s == pp - 1) for s, ls in enumerate(layer_sets)]
        layer_names = [[bb.layer(i) for i in ls] for ls in layer_sets]
    else:
        module_sets, cuts, stage_problems = fx_stages(plan, model)
        layer_sets, layer_names = [], module_sets
        if plan.mesh.cp > 1:
            stage_problems.append(
                f"{plan.where('mesh', 'cp')}mesh.cp={plan.mesh.cp}: context parallelism runs a Hugging Face decoder "
                f"model's own attention on sequence shards, and {type(model).__name__} is not one; use cp 1")
    problems += stage_problems + option_problems(plan, model, bb, list(shards))
    if problems:
        raise PlanError(plan.source, by_line(collapse_repeats(problems)))
    costs = costs if isinstance(costs, Costs) else None
    shares = costs.shares([len(ls) for ls in layer_sets]) if costs else [None] * len(module_sets)
    sets = module_sets if pp > 1 else [[""]]
    walk = _memo(cache, ("walk",), lambda: parameter_walk(model)) if cache is not None else None
    sets = tuple(map(tuple, sets))
    held_sets = _memo(cache, ("held", rules, sets, experts), lambda: held_by_stage(model, sets, shards, walk, experts))
    stages = []
    for s, held in enumerate(held_sets):
        count, size = sum(p.numel for p in held), sum(p.nbytes for p in held)
        stages.append(StageSpec(s, tuple(module_sets[s]), tuple(layer_names[s]), count, size, shares[s], tuple(held)))
    total, total_bytes = _memo(cache, ("totals",), lambda: _totals(model))
    return ResolvedPlan(
        plan=plan,
        model_name=type(model).__name__,
        kind="hf" if bb is not None else "fx",
        backbone=bb,
        shards=tuple(shards),
        stages=tuple(stages),
        cut_points=tuple(cuts),
        total_params=total,
        total_bytes=total_bytes,
        layer_indices=tuple(tuple(ls) for ls in layer_sets),
        costs=costs,
        stage_rank=placement(plan.pipeline.schedule, plan.mesh.pp, plan.pipeline.virtual_stages),
        recomputed=tuple(recomputed),
        warnings=tuple(collapse_repeats(list(notes))),
        experts=experts,
    )
