"""Parallel plans: the Pydantic schema and loading plan files (YAML or JSON).

A plan is data. Nothing here touches a model or torch.distributed; binding a
plan to a model is `rewrite.resolve`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from ..schedules import SCHEDULE_NAMES, schedule_rules
from ..values import is_count
from .files import PlanError, dotted, key_lines, line_of, read_plan_file, read_table_file, short
from .ranks import global_rank, shape_text
from .styles import Style
from .pipeline_schema import (
    CUT_POINT_KINDS, Pattern, Pipeline, StrictModel, cut_point_problems, schedule_fit, schedule_problems,
    unknown_schedule,
)

__all__ = ["ParallelPlan", "MeshSpec", "DataParallel", "Pipeline", "PlanError", "load_plan"]

class MeshSpec(StrictModel):
    """How the ranks are arranged: world size = dp * pp * tp.

    Global rank = (dp_rank * pp + pp_rank) * tp + tp_rank: tensor-parallel ranks are
    neighbours (one machine), data-parallel replicas the outermost (across machines).
    """

    # The plan's `mesh` section (`ranks.global_rank` is the formula); `rewrite.Mesh` is a running
    # mesh with its process groups. Titled "Mesh" in the JSON schema, as the plan names it.
    model_config = ConfigDict(extra="forbid", frozen=True, title="Mesh")

    dp: Annotated[
        int,
        Field(
            ge=1,
            strict=True,
            description=(
                "Data-parallel replicas (>= 1): each runs the whole pipeline on its own slice of the "
                "global batch; see data_parallel for how parameters are shared out."
            ),
        ),
    ] = 1
    pp: Annotated[
        int, Field(ge=1, strict=True, description="Pipeline ranks (>= 1), each holding pipeline.virtual_stages stages.")
    ] = 1
    tp: Annotated[
        int, Field(ge=1, strict=True, description="Tensor-parallel ranks per stage (>= 1); contiguous global ranks.")
    ] = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def shape_text(self) -> str:
        """`pp=2 x tp=2`, with `dp=2 x ` in front when there are replicas."""
        return shape_text(self.dp, self.pp, self.tp)

    def global_rank(self, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> int:
        """The global rank of these coordinates (`ranks.global_rank`)."""
        return global_rank(dp_rank, pp_rank, tp_rank, pp=self.pp, tp=self.tp)


class DataParallel(StrictModel):
    """How data-parallel replicas hold parameters, gradients and optimizer state (mesh.dp > 1)."""

    sharding: Annotated[
        Literal["full", "grad_op", "replicate"],
        Field(
            description=(
                "'full' (default): torch FSDP2 `fully_shard` per decoder layer: parameters, gradients and "
                "optimizer state divided by dp, parameters gathered for each use (ZeRO-3); 'grad_op': the "
                "same, parameters kept gathered from forward to backward (ZeRO-2-like); 'replicate': whole "
                "parameters on every replica, gradients averaged once per step. Ignored when mesh.dp = 1."
            )
        ),
    ] = "full"


class ParallelPlan(StrictModel):
    """A parallel plan: the mesh, which linears to shard, and the pipeline.

    Example:
        >>> plan = ParallelPlan.model_validate({"mesh": {"tp": 2},
        ...     "tensor_parallel": {"model.layers.*.mlp.up_proj": "colwise"}})
        >>> plan.tensor_parallel["model.layers.*.mlp.up_proj"]
        'column'
    """

    model_config = ConfigDict(extra="forbid", frozen=True, title="rewrite parallel plan")

    description: Annotated[str | None, Field(description="Free text: what the plan is for.")] = None
    mesh: Annotated[MeshSpec, Field(description="World size = dp * pp * tp.")] = MeshSpec()
    tensor_parallel: Annotated[
        dict[Pattern, Style],
        Field(
            description=(
                "Module-path pattern -> style. `*` matches within one path segment. "
                "With mesh.tp = 1 the rules are still checked against the model but change nothing."
            )
        ),
    ] = {}
    pipeline: Annotated[Pipeline, Field(description="Microbatches, schedule, virtual stages and stage cut points.")] = Pipeline()
    data_parallel: Annotated[
        DataParallel, Field(description="How the mesh.dp replicas share parameters (torch DDP-style or FSDP2).")
    ] = DataParallel()
    activation_checkpointing: Annotated[
        dict[Pattern, Literal["full"]],
        Field(
            description=(
                "Module-path pattern -> mode. 'full': the matched modules keep only their inputs from the "
                "forward and run it again in the backward (torch's non-reentrant torch.utils.checkpoint), "
                "trading compute for activation memory; e.g. {'model.layers.*': full}. Works with tp, pp, "
                "dp and every schedule."
            )
        ),
    ] = {}
    loss_parallel: Annotated[
        bool,
        Field(
            description=(
                "With the LM head sharded as 'column': the runner's cross-entropy works on vocabulary "
                "shards (max, sum of exponentials and target logit reduced over tp), never building full "
                "[tokens, vocab] logits. model(...) and generate still return full logits."
            )
        ),
    ] = False
    sequence_parallel: Annotated[
        bool,
        Field(
            description=(
                "Between the tensor-parallel attention and MLP blocks, split the hidden states along the "
                "sequence over tp: norms and residual adds run on 1/tp of the tokens, each block "
                "all-gathers its input and reduce-scatters its output (HF LLaMA-family models)."
            )
        ),
    ] = False
    _source: str = PrivateAttr(default="plan")  # file the plan was read from, for messages
    _lines: dict = PrivateAttr(default_factory=dict)  # (key, key, ...) -> line in that file

    @property
    def source(self) -> str:
        """Where the plan came from: its file path, or 'plan'."""
        return self._source

    def where(self, *loc: str | int) -> str:
        """'line 7: ' for the key at `loc` (e.g. 'tensor_parallel', pattern) in the plan file; '' for a dict."""
        line = self._lines.get(loc)
        return f"line {line}: " if line else ""

    @model_validator(mode="after")
    def _pipeline_fits_mesh(self) -> ParallelPlan:
        # Cut points for pp x virtual_stages stages; the schedule's rules; a custom table run on paper.
        pipe, pp = self.pipeline, self.mesh.pp
        problems = cut_point_problems(pipe.cut_points, pp, pipe.virtual_stages)
        problems += schedule_problems(pipe.schedule, pipe.table, pp, pipe.virtual_stages, pipe.microbatches)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def to_yaml(self) -> str:
        """The plan as YAML text that `load_plan` reads back to an equal plan."""
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


def _problems(exc: ValidationError, nodes: Any, data: Any = None) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        if len(loc) > 2 and loc[:2] == ("pipeline", "cut_points") and loc[2] in CUT_POINT_KINDS:
            loc = loc[:2] + loc[3:]
        if loc and loc[-1] == "[key]":
            loc = loc[:-1]  # the key of a mapping failed: report it at the key itself
        line = line_of(nodes, loc) if nodes is not None else None
        where = (f"line {line}: " if line else "") + (dotted(loc) + ": " if loc else "")
        msg = err["msg"].removeprefix("Value error, ")
        if loc == ("pipeline", "schedule") and isinstance(err.get("input"), str) and err["type"] == "value_error":
            msg = unknown_schedule(err["input"], schedule_fit(data))
        elif err["type"] == "extra_forbidden":
            msg = f"unknown key {short(loc[-1])}" + _suggest_key(exc, loc)
        elif err["type"] not in ("value_error", "missing") and "input" in err:
            msg += f" (found {short(err['input'])})"
        # A cross-field check reports its problems one a line: count each.
        problems += [(line or 10**9, where + part) for part in (msg.split("\n") if not loc else [msg])]
    return [p for _, p in sorted(problems, key=lambda item: item[0])]


def _raw_schedule_rules(schedule: Any, pp: Any, k: Any) -> list[str]:
    # The schedule's rules on raw data, when their values passed their own checks.
    valid = all(is_count(v) for v in (pp, k))
    known = isinstance(schedule, str) and schedule in SCHEDULE_NAMES
    return schedule_rules(schedule, pp, k, 1) if valid and known else []


def _suggest_key(exc: ValidationError, loc: tuple) -> str:
    fields: dict[str, Any] = {
        (): ParallelPlan.model_fields,
        ("mesh",): MeshSpec.model_fields,
        ("pipeline",): Pipeline.model_fields,
        ("data_parallel",): DataParallel.model_fields,
    }.get(tuple(loc[:-1]), {})
    close = difflib.get_close_matches(str(loc[-1]), list(fields), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; allowed here: {', '.join(fields)}"


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
    try:
        plan = ParallelPlan.model_validate(data)
    except ValidationError as exc:
        problems = _problems(exc, nodes, data)
        if not any(not e["loc"] for e in exc.errors()):
            # Field errors stop Pydantic before the cross-field check: run it on the raw data.
            mesh, pipe = data.get("mesh") or {}, data.get("pipeline") or {}
            if isinstance(mesh, dict) and isinstance(pipe, dict):
                pp, k = mesh.get("pp", 1), pipe.get("virtual_stages", 1)
                problems += cut_point_problems(pipe.get("cut_points"), pp, k)
                problems += _raw_schedule_rules(pipe.get("schedule", "afab"), pp, k)
        raise PlanError(name, problems) from None
    plan._source = name
    plan._lines = key_lines(nodes) if nodes is not None else {}
    return plan
