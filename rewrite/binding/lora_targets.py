"""Which linear layers a plan's `lora` section puts adapters on, and every problem with them. Pure."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..models.blocks import ATTENTION, LATENT_ATTENTION, MLP, PACKED_MLP
from ..models.hf_decoder import Backbone
from ..plan.patterns import match_pattern, unmatched_problem
from ..plan.schema import ParallelPlan
from .params import HeldParameter
from .shard_layout import tensor_split

__all__ = ["DEFAULT_LEAVES", "lora_targets", "is_adapter", "is_lora_linear", "with_adapters"]

# A decoder layer's projections that get adapters unless the plan lists its own targets.
DEFAULT_LEAVES = tuple(dict.fromkeys((*ATTENTION.members, *LATENT_ATTENTION.members, *MLP.members,
                                      *PACKED_MLP.members)))


def is_adapter(name: str) -> bool:
    """Whether parameter `name` (a dotted path) is a LoRA adapter's A or B."""
    return name.rpartition(".")[2] in ("lora_A", "lora_B")


def lora_targets(plan: ParallelPlan, modules: dict[str, nn.Module], bb: Backbone | None
                 ) -> tuple[tuple[str, ...], list[str]]:
    """(the paths of the linear layers that get adapters, in the model's order; problems). The model's
    `modules` by path; `bb` its decoder backbone (None: not a Hugging Face decoder, no default targets)."""
    carried = [f for f, m in modules.items() if is_lora_linear(m)]
    lora = plan.lora
    if lora is None:
        if carried:
            return (), [f"the model carries LoRA adapters ({carried[0]}{' and others' if len(carried) > 1 else ''}) "
                        "but the plan has no lora section; add one (its rank and targets those of the adapters)"]
        return (), []
    experts = tuple(f for f in modules if f.rpartition(".")[2] == "experts")  # routed experts: fused or listed
    at = plan.where("lora", "targets") or plan.where("lora")
    if lora.targets is None:
        if bb is None:
            return (), [f"{at}lora.targets: {type(modules['']).__name__} is not a Hugging Face decoder, so there are "
                        "no default targets; list the linear layers (module-path patterns)"]
        layers = bb.layers + "."
        found = [f for f, m in modules.items() if f.startswith(layers) and f.rpartition(".")[2] in DEFAULT_LEAVES
                 and isinstance(m, nn.Linear) and not _inside(f, experts)]
        if not found:
            return (), [f"{at}lora: no decoder layer has a linear projection named {', '.join(DEFAULT_LEAVES)}; "
                        "list lora.targets"]
        return _checked(found, modules, lora.rank, carried, at)
    problems, found = [], []
    names = [f for f in modules if f]
    for pattern in lora.targets:
        matched = [f for f in names if match_pattern(pattern, f)]
        if not matched:
            problems.append(unmatched_problem(at, "lora.targets", pattern, names))
        for fqn in matched:
            module = modules[fqn]
            if _inside(fqn, experts) or getattr(module, "num_experts", None):
                problems.append(f"{at}lora.targets[{pattern!r}] matches {fqn}, inside a routed-experts module: "
                                "adapters on routed experts are not built; target attention and dense or shared MLPs")
            elif not isinstance(module, nn.Linear):
                problems.append(f"{at}lora.targets[{pattern!r}] matches {fqn}, a {type(module).__name__}: adapters "
                                "go on nn.Linear layers only; narrow the pattern to the projections")
            else:
                found.append(fqn)
    order = {f: i for i, f in enumerate(modules)}
    targets, more = _checked(sorted(set(found), key=order.__getitem__), modules, lora.rank, carried, at)
    return targets, problems + more


def is_lora_linear(module: nn.Module) -> bool:
    """Whether `module` is a linear layer carrying an adapter (`rewrite.lora.LoraLinear`)."""
    # `_parameters` read directly: nn.Module's attribute lookup raising for every plain linear is most of a plan
    # search's binding time on an 80-layer model
    return isinstance(module, nn.Linear) and isinstance(module._parameters.get("lora_A"), nn.Parameter)


def _inside(fqn: str, experts: tuple[str, ...]) -> bool:
    return any(fqn == e or fqn.startswith(e + ".") for e in experts)


def _checked(targets: list[str], modules: dict[str, nn.Module], rank: int, carried: list[str], at: str
             ) -> tuple[tuple[str, ...], list[str]]:
    """Adapters the model already carries must be the plan's: on its targets only, of its rank."""
    problems = []
    stray = sorted(set(carried) - set(targets))
    if stray:
        problems.append(f"{at}lora: the model carries adapters on {stray[0]}, which lora.targets does not name; "
                        "name every adapted layer")
    ranks = {modules[f].lora_A.shape[0] for f in carried if f in targets}
    if ranks - {rank}:
        problems.append(f"{at}lora.rank={rank}, but the adapters the model carries have rank {sorted(ranks)[0]}; "
                        "use that rank")
    if carried and set(carried) != set(targets) and not stray:
        missing = sorted(set(targets) - set(carried))
        problems.append(f"{at}lora: the model carries adapters, but not on {missing[0]}; load them all or none")
    return tuple(targets), problems


def with_adapters(helds: list[list[HeldParameter]], sets: tuple[tuple[str, ...], ...], targets: tuple[str, ...],
                  rank: int, shards, modules: dict[str, nn.Module]) -> list[list[HeldParameter]]:
    """Each stage's held parameters under a LoRA plan: every one frozen, and the adapters of the `targets` the
    stage holds added, each split as its layer's style splits it (`shard_layout.split_dim`). New lists: the
    given ones may be a plan search's, kept for other plans."""
    by_fqn = {s.fqn: s for s in shards}
    out = []
    for held, modules_here in zip(helds, sets):
        frozen = [p if is_adapter(p.name) else replace(p, trained=False) for p in held]
        names = {p.name for p in held}
        for fqn in targets:
            if not any(m == "" or fqn == m or fqn.startswith(m + ".") for m in modules_here):
                continue
            linear = modules[fqn]
            size = linear.weight.element_size()
            for leaf, whole in (("lora_A", (rank, linear.in_features)), ("lora_B", (linear.out_features, rank))):
                if f"{fqn}.{leaf}" not in names:  # adapters the model already carries are in `held`
                    shape = tensor_split(by_fqn.get(fqn), leaf).local_shape(whole)
                    name = f"{fqn}.{leaf}"  # its own identity: one parameter, counted once per rank
                    frozen.append(HeldParameter(name, shape, size, ident=hash(name)))
        out.append(frozen)
    return out
