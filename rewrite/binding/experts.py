"""The experts a plan splits over mesh.ep: the fused experts modules its `expert_parallel` rules name. Pure.

A rank of an expert-parallel group holds experts `[ep_rank * E / ep, (ep_rank + 1) * E / ep)` of each: the
rows of every tensor of the module along dim 0 (`ExpertSpec.split_of`).

A module with Z identity experts after its E routed ones (LongCat-Flash) has tensors of E + Z rows beside
tensors of E. Each rank holds an equal share of both: the rows are read as blocks of `b = gcd(E, Z)` experts
(`ExpertSpec.block`), and ep rank `r` holds slice `r` of every block (E / b or (E + Z) / b parts), so ep must
divide b. Its routed experts are then not one contiguous range: `ExpertSpec.slots` says where each one lives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from ..models.expert_split import split_problem, tp_layout
from ..models.experts import expert_block, experts_problem, identity_experts, num_experts
from ..models.router_loss import router_loss_parts
from ..plan.patterns import general_path, match_pattern
from ..plan.schema import ParallelPlan
from .shard_layout import TensorSplit

__all__ = ["EXPERT_STYLE", "TP_STYLE", "ExpertSpec", "expert_problems"]

EXPERT_STYLE = "expert_parallel"
TP_STYLE = "expert_tensor_parallel"


@dataclass(frozen=True)
class ExpertSpec:
    """One fused experts module split over ep: its path, the rule naming it, its experts (routed, and identity
    ones after them; `widened`: its tensors holding rows for those too)."""

    fqn: str
    pattern: str
    num_experts: int
    ep: int
    identity: int = 0
    widened: frozenset[str] = frozenset()
    tp: int = 1  # > 1: each expert split over tp instead (`expert_tensor_parallel`), along `features`
    features: tuple[tuple[str, int, int], ...] = ()  # (tensor, its dim of the experts' features, packed parts)

    @property
    def local(self) -> int:
        """Routed experts each rank holds: E / ep (all of them, in slices, when split over tp)."""
        return self.num_experts // self.ep

    @property
    def splits(self) -> bool:
        """Whether a rank holds less than the whole module: its experts split over ep, or each over tp."""
        return self.ep > 1 or self.tp > 1

    @property
    def block(self) -> int:
        """Experts read as one block: gcd(E, Z), E without identity experts."""
        return math.gcd(self.num_experts, self.identity)

    def split_of(self, leaf: str) -> TensorSplit:
        """How the module's tensor `leaf` is held: ep rank `r` holds slice `r` of each block of dim 0; split
        over tp, tp rank `r` slice `r` of each packed part of its features' dim."""
        if self.tp > 1:
            dim, parts = next(((d, p) for name, d, p in self.features if name == leaf), (None, 1))
            return TensorSplit(dim, self.tp, parts) if dim is not None else TensorSplit()
        rows = self.num_experts + (self.identity if leaf in self.widened else 0)
        return TensorSplit(0, self.ep, rows // self.block, over="ep")

    @property
    def slots(self) -> tuple[int, ...]:
        """For each routed expert, `r * E / ep + i`: it is row `i` of ep rank `r`'s experts."""
        share = self.block // self.ep
        out = []
        for expert in range(self.num_experts):
            part, within = divmod(expert, self.block)
            rank, row = divmod(within, share)
            out.append(rank * self.local + part * share + row)
        return tuple(out)


def expert_problems(plan: ParallelPlan, model: nn.Module, modules: dict[str, nn.Module]) -> tuple[tuple, list[str]]:
    """(the `ExpertSpec`s of the plan's `expert_parallel` rules, every problem with them and mesh.ep)."""
    ep, specs, problems = plan.mesh.ep, [], []
    name, ep_at = type(model).__name__, plan.where("mesh", "ep")
    for pattern, style in plan.tensor_parallel.items():
        if style not in (EXPERT_STYLE, TP_STYLE):
            continue
        at = plan.where("tensor_parallel", pattern)
        for fqn in (f for f in modules if f and match_pattern(pattern, f)):
            problem = experts_problem(modules[fqn])
            if problem:
                problems.append(f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}, {problem}; leave it unsplit "
                                "(it then runs whole on every rank)")
                continue
            module = modules[fqn]
            if style == TP_STYLE:
                spec = _tp_spec(plan, model, fqn, pattern, module, problems)
                specs += [spec] if spec else []
                continue
            count, identity, block = num_experts(module), identity_experts(module), expert_block(module)
            if block % ep:
                stage = plan.mesh.dp * plan.mesh.tp
                fits = [e for e in range(1, stage + 1) if stage % e == 0 and block % e == 0]
                what = (f"the {count} experts" if not identity else
                        f"both the {count} routed and the {identity} identity experts (each rank holds as many of each)")
                problems.append(
                    f"{ep_at}mesh.ep={ep} does not divide {what} of {general_path(fqn)}; use ep "
                    f"{', '.join(map(str, fits))} (dividing both the experts and mesh.dp x mesh.tp = {stage})")
                continue
            widened = frozenset(n for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                                if identity and t.shape[0] == count + identity)
            specs.append(ExpertSpec(fqn, pattern, count, ep, identity, widened))
    if ep > 1 and not specs and not problems:
        found = sorted({general_path(f) for f, m in modules.items() if f and experts_problem(m) is None})
        problems.append(
            f"{ep_at}mesh.ep={ep} splits the experts of the modules tensor_parallel names '{EXPERT_STYLE}', and no rule "
            + (f"does; add {found[0]!r}: {EXPERT_STYLE}" if found else
               f"does: {name} has no fused experts module to split; use ep 1"))
    parts = router_loss_parts(model)
    if isinstance(parts, str):
        problems.append(f"{name}: {parts}; set config.output_router_logits = False to train on the language-model "
                        "loss alone")
    return tuple(specs), list(dict.fromkeys(problems))


def _tp_spec(plan: ParallelPlan, model: nn.Module, fqn: str, pattern: str, module: nn.Module,
             problems: list[str]) -> ExpertSpec | None:
    """The spec of experts module `fqn` with each expert split over tp (`expert_tensor_parallel`), or None
    with its problems added: its tensors split as the family's tp plan says, evenly, adding up."""
    tp, at = plan.mesh.tp, plan.where("tensor_parallel", pattern)
    count = num_experts(module)
    if plan.mesh.ep > 1:
        problems.append(f"{at}tensor_parallel[{pattern!r}] splits each expert over tp, and {plan.where('mesh', 'ep')}"
                        f"mesh.ep={plan.mesh.ep} splits experts by expert: both in one plan is not built yet; name the "
                        f"experts '{EXPERT_STYLE}' or use ep 1")
        return None
    layout = tp_layout(model, fqn, module)
    if isinstance(layout, str):
        problems.append(f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}, {layout}; split it by expert "
                        f"('{EXPERT_STYLE}' with mesh.ep) or leave it whole")
        return None
    features = tuple((leaf, dim, parts) for leaf, (dim, parts) in sorted(layout.items()))
    if tp == 1:
        return ExpertSpec(fqn, pattern, count, 1, features=features)  # checked, kept whole
    tensors = dict([*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
    uneven = [(leaf, tensors[leaf].shape[dim], parts) for leaf, dim, parts in features
              if tensors[leaf].shape[dim] % (parts * tp)]
    if uneven:
        widths = [size // parts for _, size, parts in uneven]
        fits = [t for t in range(1, max(widths) + 1) if all(w % t == 0 for w in widths) and t <= 8]
        problems.append(
            f"{plan.where('mesh', 'tp')}mesh.tp={tp} does not split the experts' features of {general_path(fqn)} evenly ("
            + ", ".join(f"{leaf}: {parts} x {size // parts}" for leaf, size, parts in uneven)
            + f"); use tp {', '.join(map(str, fits))}, or split the experts by expert ('{EXPERT_STYLE}')")
        return None
    wrong = split_problem(model, fqn, layout)
    if wrong:
        problems.append(f"{at}tensor_parallel[{pattern!r}] matches {fqn!r}: {wrong}; split it by expert "
                        f"('{EXPERT_STYLE}' with mesh.ep) or leave it whole")
        return None
    return ExpertSpec(fqn, pattern, count, 1, tp=tp, features=features)
