"""The experts a plan splits over mesh.ep: the fused experts modules its `expert_parallel` rules name.

Pure; used by `resolve`. A rank of an expert-parallel group holds experts
`[ep_rank * E / ep, (ep_rank + 1) * E / ep)` of each: the rows of every tensor of the module
along its first dimension (`ExpertSpec.split`, read by the rewriter, checkpoints and norms).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..models.experts import experts_problem, num_experts, router_loss_parts
from ..plan.patterns import match_pattern
from ..plan.schema import ParallelPlan
from .shard_layout import TensorSplit

__all__ = ["EXPERT_STYLE", "ExpertSpec", "expert_problems"]

EXPERT_STYLE = "expert_parallel"


@dataclass(frozen=True)
class ExpertSpec:
    """One fused experts module split over ep: its path, the rule naming it, its experts."""

    fqn: str
    pattern: str
    num_experts: int
    ep: int

    @property
    def local(self) -> int:
        """Experts each rank holds: E / ep."""
        return self.num_experts // self.ep

    @property
    def split(self) -> TensorSplit:
        """Every tensor of the module, by expert: ep rank `r` holds slice `r` of dim 0."""
        return TensorSplit(0, self.ep, over="ep")


def _general(fqn: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


def expert_problems(plan: ParallelPlan, model: nn.Module, modules: dict[str, nn.Module]) -> tuple[tuple, list[str]]:
    """(the `ExpertSpec`s of the plan's `expert_parallel` rules, every problem with them and mesh.ep)."""
    ep, specs, problems = plan.mesh.ep, [], []
    name, ep_at = type(model).__name__, plan.where("mesh", "ep")
    for pattern, style in plan.tensor_parallel.items():
        if style != EXPERT_STYLE:
            continue
        at = plan.where("tensor_parallel", pattern)
        for fqn in (f for f in modules if f and match_pattern(pattern, f)):
            problem = experts_problem(modules[fqn])
            if problem:
                problems.append(f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}, {problem}; leave it unsplit "
                                "(it then runs whole on every rank)")
                continue
            count = num_experts(modules[fqn])
            if count % ep:
                fits = [e for e in range(1, plan.mesh.dp + 1) if plan.mesh.dp % e == 0 and count % e == 0]
                problems.append(
                    f"{ep_at}mesh.ep={ep} does not divide the {count} experts of {_general(fqn)}; use ep "
                    f"{', '.join(map(str, fits))} (dividing both the experts and mesh.dp={plan.mesh.dp})")
                continue
            specs.append(ExpertSpec(fqn, pattern, count, ep))
    if ep > 1 and not specs and not problems:
        found = sorted({_general(f) for f, m in modules.items() if f and experts_problem(m) is None})
        problems.append(
            f"{ep_at}mesh.ep={ep} splits the experts of the modules tensor_parallel names '{EXPERT_STYLE}', and no rule "
            + (f"does; add {found[0]!r}: {EXPERT_STYLE}" if found else
               f"does: {name} has no fused experts module to split; use ep 1"))
    parts = router_loss_parts(model)
    if isinstance(parts, str):
        problems.append(f"{name}: {parts}; set config.output_router_logits = False to train on the language-model "
                        "loss alone")
    elif parts is not None and (plan.mesh.pp > 1 or plan.pipeline.virtual_stages > 1 or plan.mesh.cp > 1):
        problems.append(
            f"{name}: config.output_router_logits is True: the routers' auxiliary loss pools every layer's rows of a "
            "microbatch, and counting it across pipeline stages or sequence shards is not built yet; use one stage "
            "and cp 1, or set config.output_router_logits = False")
    return tuple(specs), list(dict.fromkeys(problems))
