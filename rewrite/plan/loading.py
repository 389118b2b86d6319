"""Loading a plan: a file (YAML or JSON), a dict or a plan in, a validated `ParallelPlan` out, every problem
reported at once. `load_plan_for` adds, to a refusal, the rules matching no module of the model (so a style
typo does not hide a pattern typo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError
from torch import nn

from ..schedules import SCHEDULE_NAMES, schedule_rules
from ..values import is_count
from .files import PlanError, dotted, key_lines, read_plan_file, read_table_file, short
from .pipeline_schema import CUT_POINT_KINDS, Pipeline, cut_point_problems, schedule_fit, unknown_schedule
from .schema import CHECKPOINT_KINDS, Checkpointing, DataParallel, MeshSpec, ParallelPlan
from .size_checks import by_line
from .patterns import closest, match_pattern, unmatched_problem

__all__ = ["load_plan", "load_plan_for"]


def _problems(exc: ValidationError, lines: dict[tuple, int], data: dict) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        if len(loc) > 2 and loc[:2] == ("pipeline", "cut_points") and loc[2] in CUT_POINT_KINDS:
            loc = loc[:2] + loc[3:]
        if len(loc) > 2 and loc[0] == "activation_checkpointing" and loc[2] in CHECKPOINT_KINDS:
            loc = loc[:2] + loc[3:]  # which kind of value it was taken for: a mode, or a mapping of one
        if loc and loc[-1] == "[key]":
            loc = loc[:-1]  # the key of a mapping failed: report it at the key itself
        line = _line(lines, loc)
        where = (f"line {line}: " if line else "") + (dotted(loc) + ": " if loc else "")
        msg = err["msg"].removeprefix("Value error, ")
        if loc == ("pipeline", "schedule") and isinstance(err.get("input"), str) and err["type"] == "value_error":
            msg = unknown_schedule(err["input"], schedule_fit(data))
        elif err["type"] == "extra_forbidden":
            msg = f"unknown key {short(loc[-1])}" + _suggest_key(loc)
        elif err["type"] not in ("value_error", "missing") and "input" in err:
            msg += f" (found {short(err['input'])})"
        # A cross-field check reports its problems one a line: count each.
        problems += [(line or 10**9, where + part) for part in (msg.split("\n") if not loc else [msg])]
    return [p for _, p in sorted(problems, key=lambda item: item[0])]


def _line(lines: dict[tuple, int], loc: tuple) -> int | None:
    """The line of the deepest key along `loc` (`files.key_lines`; a key such as `1:` is the string '1' there)."""
    line, at = None, ()
    for part in loc:
        found = [(*at, p) for p in (part, str(part)) if (*at, p) in lines]
        if not found:
            break
        at = found[0]
        line = lines[at]
    return line


def _suggest_key(loc: tuple) -> str:
    """'; did you mean ...?' for an unknown key at `loc`, else the keys allowed there."""
    section = {(): ParallelPlan, ("mesh",): MeshSpec, ("pipeline",): Pipeline, ("data_parallel",): DataParallel}
    where = ("activation_checkpointing",) if loc[:1] == ("activation_checkpointing",) and len(loc) == 3 else loc[:-1]
    fields = {**section, ("activation_checkpointing",): Checkpointing}.get(tuple(where), None)
    fields = fields.model_fields if fields is not None else {}
    return closest(str(loc[-1]), list(fields)) or f"; allowed here: {', '.join(fields)}"


def load_plan(source: str | Path | dict | ParallelPlan) -> ParallelPlan:
    """Load and validate a parallel plan.

    Args:
        source: a path to a `.yaml`, `.yml` or `.json` file, a dict, or a plan.

    Returns:
        The validated `ParallelPlan`.

    Raises:
        PlanError (a ValueError): every problem found, each with its file, line and
            dotted location, the value found and what is expected.

    Example:
        >>> plan = load_plan("plans/llama-tp2.yaml")
        >>> plan.mesh.tp
        2
    """
    if isinstance(source, ParallelPlan):
        return source
    nodes, name = None, "plan"
    if isinstance(source, (str, Path)):
        path = Path(source)
        data, nodes = read_plan_file(path)
        name = str(path)
    elif isinstance(source, dict):
        data = source
    else:
        raise TypeError(f"load_plan takes a file path, a dict or a ParallelPlan, not {type(source).__name__}")
    if data is None:
        data = {}  # an empty file is the default plan: one rank
    if not isinstance(data, dict):
        raise PlanError(name, [f"a plan is a mapping of keys (mesh, tensor_parallel, pipeline), got {type(data).__name__}"])
    data = read_table_file(data, Path(name).parent if isinstance(source, (str, Path)) else Path.cwd(), name)
    lines = key_lines(nodes) if nodes is not None else {}
    try:
        plan = ParallelPlan.model_validate(data)
    except ValidationError as exc:
        problems = _problems(exc, lines, data)
        if not any(not e["loc"] for e in exc.errors()):
            # Field errors stop Pydantic before the cross-field check: run it on the raw data.
            mesh, pipe = data.get("mesh") or {}, data.get("pipeline") or {}
            if isinstance(mesh, dict) and isinstance(pipe, dict):
                pp, k, schedule = mesh.get("pp", 1), pipe.get("virtual_stages", 1), pipe.get("schedule", "afab")
                problems += cut_point_problems(pipe.get("cut_points"), pp, k)
                if is_count(pp) and is_count(k) and isinstance(schedule, str) and schedule in SCHEDULE_NAMES:
                    problems += schedule_rules(schedule, pp, k, 1)
        raise PlanError(name, problems) from None
    plan._source = name
    plan._lines = lines
    return plan


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
        also = _unmatched_in_refused_plan(source, model, refused)
        if also:
            raise PlanError(refused.source, by_line(refused.problems + also)) from None
        raise


def _unmatched_in_refused_plan(source: Any, model: nn.Module, refusal: PlanError) -> list[str]:
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
    matchable = names + [name for name, _ in model.named_parameters()]  # a rule may split a bare parameter (sinks)
    lines, out = key_lines(nodes) if nodes is not None else {}, []
    for pattern in rules:
        if not isinstance(pattern, str) or any(f"[{pattern!r}]" in p for p in refusal.problems):
            continue
        if not any(match_pattern(pattern, name) for name in matchable):
            line = lines.get(("tensor_parallel", pattern))
            out.append(unmatched_problem(f"line {line}: " if line else "", "tensor_parallel", pattern, names))
    return out
