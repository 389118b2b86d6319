"""The steps of binding a plan to one model, each a function of hashable plan values and the model:
what `resolve` runs, and what a plan search may keep across the plans it tries (`estimate.bind_memo`).
"""

from __future__ import annotations

from torch import nn

from ..models.flops import Costs, estimate_costs
from ..models.hf_decoder import Backbone
from ..models.oracle import narrowed_problem, walker_problem
from ..plan.size_checks import PipelineShape
from ..plan.styles import WHOLE_STYLES
from .experts import ExpertSpec
from .params import HeldParameter, held_by_stage, held_parameters, parameter_walk
from .cuts import hf_stages
from .tp_rules import ShardSpec, TpRules, shard_problems

__all__ = ["BindSteps"]


class BindSteps:
    """The binding steps of one model, computed each time they are asked for. Each reads the model (which must
    not change meanwhile) and its arguments only: a subclass may keep results by the arguments."""

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
        return hf_stages(shape, bb.num_layers, bb, costs)

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
