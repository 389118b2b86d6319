"""Parallel plans: the Pydantic schema and loading plan files (YAML or JSON).

A plan is data. Nothing here touches a model or torch.distributed; binding a
plan to a model is `rewrite.resolve`.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    model_validator,
)

from .files import PlanError, dotted, line_of, read_plan_file, short
from .schedules import read_table_file, schedule_problems

__all__ = ["ParallelPlan", "Mesh", "Pipeline", "PlanError", "load_plan", "STYLES", "STYLE_ALIASES"]

STYLES: dict[str, str] = {
    "column": "output features split; output stays sharded, to feed a `row` layer",
    "row": "input features split; input arrives sharded, partial outputs are summed",
    "column_gather": "output features split; output all-gathered (the standalone layer's default)",
    "row_split": "input features split; the layer splits a full input itself, outputs summed",
    "grad_allreduce": "any module kept whole whose input is sharded (e.g. per-head q/k norms): "
    "its parameter gradients are summed over the tensor-parallel group",
}

# Hugging Face transformers' tensor-parallel style names, and the style each means here.
STYLE_ALIASES: dict[str, str] = {
    "colwise": "column",
    "local_colwise": "column",
    "rowwise": "row",
    "local_rowwise": "row",
    "rowwise_rep": "row",
    "colwise_gather_output": "column_gather",
    "colwise_rep": "column_gather",
    "rowwise_split_input": "row_split",
    "replicated_with_grad_allreduce": "grad_allreduce",
}

# A segment is a name or index; `*` inside a segment matches any characters but '.'.
_PATTERN = re.compile(r"^[A-Za-z0-9_*]+(\.[A-Za-z0-9_*]+)*$")


def _style(value: Any) -> Any:
    """Map HF aliases onto our style names; reject unknown names with a suggestion."""
    if not isinstance(value, str):
        return value  # the Literal check reports the type
    if value in STYLES:
        return value
    if value in STYLE_ALIASES:
        return STYLE_ALIASES[value]
    known = [*STYLES, *STYLE_ALIASES]
    close = difflib.get_close_matches(value, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown style {short(value)}: use one of {', '.join(STYLES)} "
        f"(Hugging Face names {', '.join(STYLE_ALIASES)} are accepted too){hint}"
    )


Style = Annotated[
    Literal["column", "row", "column_gather", "row_split", "grad_allreduce"],
    BeforeValidator(_style, json_schema_input_type=Literal[tuple([*STYLES, *STYLE_ALIASES])]),
]


def _pattern(value: Any) -> Any:
    if isinstance(value, str) and not _PATTERN.match(value):
        raise ValueError(
            f"{short(value)} is not a module-path pattern: dotted names or indices, `*` matching "
            "within one segment (e.g. 'model.layers.*.mlp.up_proj')"
        )
    return value


Pattern = Annotated[str, BeforeValidator(_pattern)]


def _auto(value: Any) -> Any:
    if value != "auto":
        one_cut = f"; for one cut write a list, cut_points: [{short(value)}]" if isinstance(value, str) else ""
        raise ValueError(
            f"{short(value)} is neither a list of module paths nor 'auto'{one_cut}; "
            "or write 'auto' to balance estimated compute"
        )
    return value


def _cut_points_kind(value: Any) -> str:
    # Route every non-list to the 'auto' branch: one message, not one per branch of the union.
    return "none" if value is None else "paths" if isinstance(value, (list, tuple)) else "auto"


# The union's branch names; they appear in Pydantic's error locations and are left out of ours.
_CUT_POINT_KINDS = ("paths", "auto", "none")
CutPoints = Annotated[
    Union[
        Annotated[list[Pattern], Tag("paths")],
        Annotated[Literal["auto"], BeforeValidator(_auto), Tag("auto")],
        Annotated[None, Tag("none")],
    ],
    Discriminator(_cut_points_kind),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Mesh(_Strict):
    """How the ranks are arranged: world size = pp * tp."""

    pp: Annotated[int, Field(ge=1, strict=True, description="Pipeline stages (>= 1).")] = 1
    tp: Annotated[
        int, Field(ge=1, strict=True, description="Tensor-parallel ranks per stage (>= 1); contiguous global ranks.")
    ] = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.tp


class Pipeline(_Strict):
    """How a batch flows through the stages."""

    microbatches: Annotated[
        int, Field(ge=1, strict=True, description="Microbatches per training step (>= 1); may be fewer than pp.")
    ] = 1
    schedule: Annotated[
        Literal["afab", "1f1b", "custom"],
        Field(
            description=(
                "Schedule: 'afab' (all forward, then all backward: every microbatch's activations alive "
                "at once), '1f1b' (after pp - s - 1 warm-up forwards, stage s alternates forward and "
                "backward: at most pp - s microbatches alive), or 'custom' (your own `table`)."
            )
        ),
    ] = "afab"
    table: Annotated[
        list[str] | str | None,
        Field(
            description=(
                "With schedule 'custom': one string per rank listing its actions in order, e.g. "
                "'F0 F1 B0 B1' (F = forward, B = backward of that microbatch); or the path of a CSV "
                "file beside the plan with one row per rank and one action per cell. Checked on paper "
                "when the plan is loaded."
            )
        ),
    ] = None
    virtual_stages: Annotated[
        int,
        Field(
            ge=1,
            strict=True,
            description=(
                "Stages each rank holds (>= 1): the model is cut into pp * virtual_stages stages. "
                "Rank r holds stages r, r + pp, ... (looped), or r and 2pp - 1 - r for 'zbv' (V-shaped)."
            ),
        ),
    ] = 1
    cut_points: Annotated[
        CutPoints,
        Field(
            description=(
                "Module paths where a new stage starts, in model order; exactly pp - 1 of them. "
                "Omit for a balanced split (stage sizes differ by at most one layer, the extra ones "
                "on the earliest stages). 'auto' (Hugging Face LLaMA-family models only): the cuts that "
                "make the most loaded stage's estimated training FLOPs smallest, counting each decoder "
                "layer, the embeddings on the first stage and the final norm, LM head and loss on the last."
            )
        ),
    ] = None
    seq_len: Annotated[
        int,
        Field(
            ge=1,
            strict=True,
            description=(
                "Tokens per sequence that the compute estimate assumes (>= 1): attention grows with its "
                "square, the MLP and LM head linearly. Used only to weigh the parts against each other, by "
                "`cut_points: auto` and the 'est. compute' column of `rewrite show`; the batches you run "
                "may be any length."
            ),
        ),
    ] = 2048


class ParallelPlan(_Strict):
    """A parallel plan: the mesh, which linears to shard, and the pipeline.

    Example:
        >>> plan = ParallelPlan.model_validate({"mesh": {"tp": 2},
        ...     "tensor_parallel": {"model.layers.*.mlp.up_proj": "colwise"}})
        >>> plan.tensor_parallel["model.layers.*.mlp.up_proj"]
        'column'
    """

    model_config = ConfigDict(extra="forbid", frozen=True, title="rewrite parallel plan")

    description: Annotated[str | None, Field(description="Free text: what the plan is for.")] = None
    mesh: Annotated[Mesh, Field(description="World size = pp * tp.")] = Mesh()
    tensor_parallel: Annotated[
        dict[Pattern, Style],
        Field(
            description=(
                "Module-path pattern -> style. `*` matches within one path segment. "
                "With mesh.tp = 1 the rules are still checked against the model but change nothing."
            )
        ),
    ] = {}
    pipeline: Annotated[Pipeline, Field(description="Microbatches, schedule and stage cut points.")] = Pipeline()
    _source: str = PrivateAttr(default="plan")  # file the plan was read from, for messages

    @property
    def source(self) -> str:
        """Where the plan came from: its file path, or 'plan'."""
        return self._source

    @model_validator(mode="after")
    def _cut_points_fit_mesh(self) -> ParallelPlan:
        problems = _cut_point_problems(self.pipeline.cut_points, self.mesh.pp * self.pipeline.virtual_stages)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _table_runs_on_paper(self) -> ParallelPlan:
        problems = schedule_problems(self.pipeline.schedule, self.pipeline.table, self.mesh.pp, self.pipeline.microbatches)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def to_yaml(self) -> str:
        """The plan as YAML text that `load_plan` reads back to an equal plan."""
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


def _cut_point_problems(cuts: Any, pp: Any) -> list[str]:
    """Cut points against the mesh; also run on raw data when other fields failed."""
    if not isinstance(cuts, list) or not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        return []
    problems = []
    if len(cuts) != pp - 1:
        problems.append(
            f"pipeline.cut_points: {len(cuts)} cut point(s) {short(cuts)} for mesh.pp={pp}; "
            f"need exactly pp - 1 = {pp - 1} (or omit cut_points for a balanced split)"
        )
    counts = Counter(c for c in cuts if isinstance(c, str))  # a Counter: a list of any length stays linear
    dupes = sorted(c for c, n in counts.items() if n > 1)
    if dupes:
        problems.append(
            f"pipeline.cut_points: {short(dupes)} listed more than once; each stage needs its own start"
        )
    return problems


def _problems(exc: ValidationError, nodes: Any) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        if len(loc) > 2 and loc[:2] == ("pipeline", "cut_points") and loc[2] in _CUT_POINT_KINDS:
            loc = loc[:2] + loc[3:]
        if loc and loc[-1] == "[key]":
            loc = loc[:-1]  # the key of a mapping failed: report it at the key itself
        line = line_of(nodes, loc) if nodes is not None else None
        where = (f"line {line}: " if line else "") + (dotted(loc) + ": " if loc else "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {short(loc[-1])}" + _suggest_key(exc, loc)
        elif err["type"] not in ("value_error", "missing") and "input" in err:
            msg += f" (found {short(err['input'])})"
        problems.append((line or 10**9, where + msg))
    return [p for _, p in sorted(problems, key=lambda item: item[0])]


def _suggest_key(exc: ValidationError, loc: tuple) -> str:
    fields: dict[str, Any] = {
        (): ParallelPlan.model_fields,
        ("mesh",): Mesh.model_fields,
        ("pipeline",): Pipeline.model_fields,
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
        problems = _problems(exc, nodes)
        if not any(not e["loc"] for e in exc.errors()):
            # Field errors stop Pydantic before the cross-field check: run it on the raw data.
            mesh, pipe = data.get("mesh") or {}, data.get("pipeline") or {}
            if isinstance(mesh, dict) and isinstance(pipe, dict):
                problems += _cut_point_problems(pipe.get("cut_points"), mesh.get("pp", 1))
        raise PlanError(name, problems) from None
    plan._source = name
    return plan
