"""Binding a plan to a model: expand patterns, check shapes, heads and cut points, every problem raised once.
Pure: it reads the model (a meta-device model will do), never changes it, and needs no process group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..models.flops import Costs, estimate_costs
from ..models.hf_decoder import Backbone, find_backbone
from ..models.oracle import narrowed_problem, walker_problem
from ..schedules import placement
from .params import HeldParameter, held_by_stage, held_parameters, parameter_walk
from ..plan.schema import ParallelPlan, PlanError
from ..plan.size_checks import PipelineShape, by_line, world_problem
from ..plan.styles import WHOLE_STYLES
from .cuts import Cut, fx_cut, hf_cut, hf_stages
from ..plan.patterns import match_pattern, unmatched_problem
from .experts import ExpertSpec, expert_problems
from .lora_targets import lora_targets, with_adapters
from .shard_layout import TensorSplit, state_split
from .tp_rules import ShardSpec, TpRules, shard_problems
from ..plan.wording import collapse_repeats
from .tp_switches import option_problems
from ..plan.loading import load_plan_for

__all__ = ["ResolvedPlan", "StageSpec", "BindSteps", "resolve", "resolve_with", "APPLIED"]

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
    selective: tuple[str, ...] = ()  # of those, the ones checkpointed op by op ('selective')
    warnings: tuple[str, ...] = ()  # valid, but worth a line at `validate` and `show` (a rule that changes nothing)
    experts: tuple[ExpertSpec, ...] = ()  # fused experts modules split over mesh.ep (each checked, ep > 1 or not)
    lora_targets: tuple[str, ...] = ()  # the linear layers that get LoRA adapters (plan.lora), in model order

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


def _recomputed(plan: ParallelPlan, modules: dict[str, nn.Module]) -> tuple[list[str], list[str], list[str]]:
    """Modules `activation_checkpointing` matches (the outermost of nested matches), those of them checkpointed
    'selective', and problems (a pattern matching nothing; a module two patterns give different modes)."""
    names, modes, problems = [n for n in modules if n], {}, []
    for pattern, value in plan.activation_checkpointing.items():
        mode, every = (value, 1) if isinstance(value, str) else (value.mode, value.every)
        found = [n for n in names if match_pattern(pattern, n)]
        if not found:
            problems.append(unmatched_problem(plan.where("activation_checkpointing", pattern), "activation_checkpointing",
                                              pattern, names))
        for name in found[::every]:  # the first of every `every`, in the model's order
            first = modes.setdefault(name, (pattern, mode))
            if first[1] != mode:
                problems.append(f"{plan.where('activation_checkpointing', pattern)}activation_checkpointing[{pattern!r}] "
                                f"makes {name} {mode!r}, but {first[0]!r} makes it {first[1]!r}: give each module one mode")
    outer = [n for n in modes if not any(n.startswith(h + ".") for h in modes)]
    return outer, [n for n in outer if modes[n][1] == "selective"], list(dict.fromkeys(problems))


class BindSteps:
    """The binding steps of one model, computed each time they are asked for. Each reads the model (which must
    not change meanwhile) and its arguments only, hashable plan values: a subclass may keep results by the
    arguments, as a plan search does across the plans it tries (`estimate.bind_memo`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def modules(self) -> dict[str, nn.Module]:
        """The model's modules by dotted path."""
        return dict(self.model.named_modules())

    def parallel(self) -> list[str]:
        """Paths of the modules already parallel (they expose `shard_of`, the slicing rule of tensor_parallel.layers)."""
        return [f for f, m in self.modules().items() if callable(getattr(m, "shard_of", None))]

    def walker(self) -> str | None:
        """Why the Hugging Face decoder walker cannot run this model's family correctly (None: it can)."""
        return walker_problem(self.model)

    def shards(self, rules: TpRules) -> tuple[tuple[ShardSpec, ...], tuple[str, ...], tuple[str, ...]]:
        """(shards, problems, notes) of the tensor_parallel rules, the model's own forward checked on them."""
        model, notes = self.model, []
        shards, problems = shard_problems(rules, model, self.modules(), notes)
        if rules.tp > 1 and not problems and hasattr(getattr(model, "config", None), "model_type"):
            narrowed = narrowed_problem(model, {s.fqn: s.style for s in shards},
                                        [s.fqn for s in shards if s.replicas > 1])
            problems += [f"{type(model).__name__} ({model.config.model_type}): {narrowed}"] if narrowed else []
        return tuple(shards), tuple(problems), tuple(notes)

    def costs(self, tp: int, seq_len: int, bb: Backbone, shards: tuple[ShardSpec, ...]) -> Costs | str:
        """Estimated compute per part on one rank of its stage, or why there is none."""
        sharded = [s.fqn for s in shards if s.style not in WHOLE_STYLES] if tp > 1 else []
        try:
            return estimate_costs(self.model.config, bb, num_layers=bb.num_layers, seq_len=seq_len, tp=tp,
                                  sharded=sharded)
        except ValueError as exc:
            return str(exc)

    def stages(self, shape: PipelineShape, bb: Backbone, costs: Costs | str) -> tuple[list, list, list]:
        """Layer indices per stage, the cut layers and problems (`cuts.hf_stages`)."""
        return hf_stages(shape, bb, costs)

    def walk(self) -> tuple[tuple, ...]:
        """What `held_by_stage` reads of every parameter (`params.parameter_walk`)."""
        return parameter_walk(self.model)

    def held(self, sets: tuple[tuple[str, ...], ...], shards: tuple[ShardSpec, ...],
             experts: tuple[ExpertSpec, ...]) -> list[list[HeldParameter]]:
        """The parameters each set of modules (a stage's) holds on one of its ranks."""
        return held_by_stage(self.model, sets, shards, self.walk(), experts)

    def totals(self) -> tuple[int, int]:
        """The whole model's parameter count and bytes."""
        whole = held_parameters(self.model, [""])
        return sum(p.numel for p in whole), sum(p.numel * p.element_size for p in whole)


def resolve(plan: ParallelPlan | str | Path | dict, model: nn.Module, *, world_size: int | None = None) -> ResolvedPlan:
    """Bind a plan to a model, checking everything that needs the model.

    Args:
        plan: a `ParallelPlan`, or anything `load_plan` takes.
        model: the model to bind to (it is not changed; a meta-device model works).
        world_size: when given, must equal `mesh.dp * mesh.pp * mesh.cp * mesh.tp`.

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
    return resolve_with(BindSteps(model), plan, world_size=world_size)


def resolve_with(steps: BindSteps, plan: ParallelPlan | str | Path | dict, *, world_size: int | None = None
                 ) -> ResolvedPlan:
    """`resolve(plan, steps.model)`, each binding step asked of `steps` (a plan search keeps their results)."""
    model = steps.model
    plan = load_plan_for(plan, model)  # a refused file's problems and the model's, so all are fixed in one go
    problems = [world_problem(plan, world_size)] if world_size is not None and world_size != plan.mesh.world_size else []
    _refuse_rewritten(plan, model, steps)
    rules = TpRules.of(plan)
    shards, tp_problems, notes = steps.shards(rules)
    modules = steps.modules()
    experts, expert_issues = expert_problems(plan, model, modules)
    recomputed, selective, ac_problems = _recomputed(plan, modules)
    bb = find_backbone(model)
    adapted, lora_problems = lora_targets(plan, modules, bb)
    cut = hf_cut(steps, plan, bb, rules, shards) if bb is not None else fx_cut(plan, model)
    problems += list(tp_problems) + list(expert_issues) + ac_problems + lora_problems
    problems += cut.problems + option_problems(plan, model, bb, list(shards))
    if problems:
        raise PlanError(plan.source, by_line(collapse_repeats(problems)))
    total, total_bytes = steps.totals()
    return ResolvedPlan(
        plan=plan, model_name=type(model).__name__, kind="hf" if bb is not None else "fx", backbone=bb,
        shards=tuple(shards), stages=_stage_specs(steps, plan, cut, shards, experts, adapted), cut_points=tuple(cut.cuts),
        total_params=total, total_bytes=total_bytes, layer_indices=tuple(tuple(ls) for ls in cut.layer_sets),
        costs=cut.costs, stage_rank=placement(plan.pipeline.schedule, plan.mesh.pp, plan.pipeline.virtual_stages),
        recomputed=tuple(recomputed), selective=tuple(selective), warnings=tuple(collapse_repeats(list(notes))),
        experts=experts, lora_targets=adapted)


def _refuse_rewritten(plan: ParallelPlan, model: nn.Module, steps: BindSteps) -> None:
    """Raise when the model was rewritten already: by apply_plan, or with parallel layers of its own."""
    applied = getattr(model, APPLIED, None)
    if applied:
        raise PlanError(plan.source, [f"the model was already rewritten by apply_plan (it holds {applied}); "
                                      "apply a plan to a model that has not been rewritten (build or load it again)"])
    done = steps.parallel()
    if done:
        raise PlanError(plan.source, [f"the model is already rewritten ({done[0]} is parallel); bind plans to an unmodified model"])


def _stage_specs(steps: BindSteps, plan: ParallelPlan, cut: Cut, shards: tuple, experts: tuple,
                 adapted: tuple[str, ...] = ()) -> tuple[StageSpec, ...]:
    """Each stage's modules, layers, compute share and the parameters one of its ranks holds (a LoRA plan's
    adapters among them, every other parameter frozen: `lora_targets.with_adapters`)."""
    costs = cut.costs
    shares = costs.shares([len(ls) for ls in cut.layer_sets]) if costs else [None] * len(cut.module_sets)
    sets = tuple(map(tuple, cut.module_sets if PipelineShape.of(plan).stages > 1 else [[""]]))
    helds = steps.held(sets, shards, experts)
    if plan.lora is not None:
        helds = with_adapters(helds, sets, adapted, plan.lora.rank, shards, steps.modules())
    return tuple(StageSpec(s, tuple(cut.module_sets[s]), tuple(cut.layer_names[s]), sum(p.numel for p in held),
                           sum(p.nbytes for p in held), shares[s], tuple(held))
                 for s, held in enumerate(helds))
