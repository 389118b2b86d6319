"""Rules that match no module, found even in a plan that failed validation: a style typo must not
hide a pattern typo in the same file until it is fixed (every problem of a file at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from .files import PlanError, line_of, read_plan_file
from .schema import ParallelPlan, load_plan
from .size_checks import by_line
from .tp_rules import closest, match_pattern

__all__ = ["unmatched_problem", "unmatched_in_refused_plan", "load_plan_for"]


def unmatched_problem(at: str, pattern: str, names: list[str]) -> str:
    """'line 3: tensor_parallel['...'] matches no module; did you mean '...'?'."""
    return f"{at}tensor_parallel[{pattern!r}] matches no module{closest(pattern, names)}"


def unmatched_in_refused_plan(source: Any, model: nn.Module, refusal: PlanError) -> list[str]:
    """The tensor_parallel patterns of the plan `load_plan` refused (`refusal`) that match no module of
    `model`, beside what it said (patterns it named already are left to its own words)."""
    data, nodes = source, None
    if isinstance(source, (str, Path)):
        try:
            data, nodes = read_plan_file(Path(source))
        except PlanError:
            return []
    rules = data.get("tensor_parallel") if isinstance(data, dict) else None
    if not isinstance(rules, dict):
        return []
    names = [name for name, _ in model.named_modules() if name]
    out = []
    for pattern in rules:
        if not isinstance(pattern, str) or any(f"[{pattern!r}]" in p for p in refusal.problems):
            continue
        if not any(match_pattern(pattern, name) for name in names):
            line = line_of(nodes, ("tensor_parallel", pattern)) if nodes is not None else None
            out.append(unmatched_problem(f"line {line}: " if line else "", pattern, names))
    return out


def load_plan_for(source: Any, model: nn.Module) -> ParallelPlan:
    """`load_plan(source)`; when it refuses the plan, its problems and the rules matching no module of
    `model`, in one PlanError.

    Example:
        >>> load_plan_for("plans/llama-tp2.yaml", model).mesh.tp
        2
    """
    try:
        return load_plan(source)
    except PlanError as refused:
        also = unmatched_in_refused_plan(source, model, refused)
        if also:
            raise PlanError(refused.source, by_line(refused.problems + also)) from None
        raise
