"""The plan's `pipeline` section, and what `schema.py` shares with it: the strict base model, counts, patterns."""

from __future__ import annotations

import difflib
import re
from collections import Counter
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from ..schedules import SCHEDULE_NAMES, custom_table, placement, schedule_rules, stages_needed, table_problems
from ..schedules.table import ROWS
from ..values import is_count
from .files import short
from .wording import either

__all__ = [
    "Pipeline", "StrictModel", "Count", "Pattern", "CutPoints", "CUT_POINT_KINDS", "cut_point_problems",
    "unknown_schedule", "schedule_problems",
]

# A segment is a name or index; `*` inside a segment matches any characters but '.'.
_PATTERN = re.compile(r"^[A-Za-z0-9_*]+(\.[A-Za-z0-9_*]+)*$")


class StrictModel(BaseModel):
    """Unknown keys are errors, and a validated plan does not change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


Count = Annotated[int, Field(ge=1, strict=True)]  # strict: a bool or a float is no count

def _pattern(value: Any) -> Any:
    if isinstance(value, str) and not _PATTERN.match(value):
        raise ValueError(f"{short(value)} is not a module-path pattern: dotted names or indices, `*` matching "
                         "within one segment (e.g. 'model.layers.*.mlp.up_proj')")
    return value


Pattern = Annotated[str, BeforeValidator(_pattern)]


def _auto(value: Any) -> Any:
    if value != "auto":
        one_cut = f"; for one cut write a list, cut_points: [{short(value)}]" if isinstance(value, str) else ""
        raise ValueError(f"{short(value)} is neither a list of module paths nor 'auto'{one_cut}; "
                         "or write 'auto' to balance estimated compute")
    return value


def _cut_points_kind(value: Any) -> str:
    # Route every non-list to the 'auto' branch: one message, not one per branch of the union.
    return "none" if value is None else "paths" if isinstance(value, (list, tuple)) else "auto"


# The union's branch names; they appear in Pydantic's error locations and are left out of ours.
CUT_POINT_KINDS = ("paths", "auto", "none")
CutPoints = Annotated[
    Union[
        Annotated[list[Pattern], Tag("paths")],
        Annotated[Literal["auto"], BeforeValidator(_auto), Tag("auto")],
        Annotated[None, Tag("none")],
    ],
    Discriminator(_cut_points_kind),
]


# Names other tools and papers use, for the suggestion only: a plan spells the schedule one way.
_KNOWN_AS = {
    "gpipe": "afab", "1f1b-interleaved": "interleaved-1f1b", "interleaved": "interleaved-1f1b",
    "zb": "zero-bubble", "zb-h1": "zero-bubble", "zb-h2": "zero-bubble", "zero_bubble": "zero-bubble",
    "zerobubble": "zero-bubble", "zb-v": "zbv", "zb_v": "zbv",
}


def unknown_schedule(value: Any, fitting: str = "") -> str:
    """The message for a schedule name that is none of SCHEDULE_NAMES: the names, which of them
    fit (`fitting`, when the caller knows the plan's virtual_stages) and the closest one."""
    name = str(value).lower()
    close = [_KNOWN_AS[name]] if name in _KNOWN_AS else difflib.get_close_matches(name, SCHEDULE_NAMES, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown schedule {short(value)}: the schedules are {', '.join(SCHEDULE_NAMES[:-1])}, and 'custom' "
            f"with your own pipeline.table{fitting}; set pipeline.schedule to one of them{hint}")


def _schedule(value: Any) -> Any:
    if isinstance(value, str) and value not in SCHEDULE_NAMES:
        raise ValueError(unknown_schedule(value))
    return value  # a non-string: the Literal check reports the type


class Pipeline(StrictModel):
    """How a batch flows through the stages."""

    microbatches: Annotated[Count, Field(description="Microbatches per training step (>= 1); may be fewer than pp.")] = 1
    schedule: Annotated[Literal[SCHEDULE_NAMES], BeforeValidator(_schedule), Field(description=(
        "Order of the forwards (F) and backwards (B) on each rank. 'afab': all forward, then all "
        "backward; every microbatch's activations alive at once (virtual_stages 1). '1f1b': after "
        "pp - r - 1 warm-up forwards, rank r alternates forward and backward; at most pp - r "
        "microbatches alive (virtual_stages 1). 'interleaved-1f1b': 1F1B over virtual_stages >= 2 "
        "looped stages per rank (rank r holds r, r + pp, ...); the bubble shrinks about "
        "virtual_stages times, for more transfers and warm-up memory. 'zero-bubble': each backward "
        "split into B (input gradient) and W (weight gradients), the W's filling the idle slots; "
        "1F1B's memory; virtual_stages 1 (ZB-H1) or more (looped). 'zbv': zero bubble on a V, "
        "virtual_stages exactly 2: rank r holds stages r and 2pp - 1 - r, so rank 0 runs the first "
        "and the last; each rank holds at most 2 pp microbatch-stage activations, as much as 1F1B's rank 0. "
        "'custom': your own `table`, looped placement, any virtual_stages. Every named schedule "
        "runs any number of microbatches."))] = "afab"
    table: Annotated[list[str] | str | None, Field(description=(
        "With schedule 'custom': one string per rank listing its actions in order, e.g. "
        "'F0 F1 B0 B1' (F = forward, B = backward, W = weight gradient of that microbatch; "
        "a W makes its B the input gradient only); with virtual_stages > 1 each cell names its "
        "stage, 'F0@2'. Or the path of a CSV file beside the plan with one row per rank and one "
        "action per cell. Checked on paper when the plan is loaded."))] = None
    virtual_stages: Annotated[Count, Field(description=(
        "Stages each rank holds (>= 1): the model is cut into pp * virtual_stages stages. "
        "1 for 'afab' and '1f1b'; 2 or more for 'interleaved-1f1b'; exactly 2 for 'zbv'; any for "
        "'zero-bubble' and 'custom'. Rank r holds stages r, r + pp, ... (looped), or r and "
        "2pp - 1 - r for 'zbv' (V-shaped)."))] = 1
    cut_points: Annotated[CutPoints, Field(description=(
        "Module paths where a new stage starts, in model order; exactly pp x virtual_stages - 1 "
        "of them. Omit for a balanced split (stage sizes differ by at most one layer, the extra "
        "ones on the earliest stages). 'auto' (Hugging Face LLaMA-family models only): the cuts that "
        "make the most loaded stage's estimated training FLOPs smallest, counting each decoder "
        "layer, the embeddings on the first stage and the final norm, LM head and loss on the last."))] = None
    seq_len: Annotated[Count, Field(description=(
        "Tokens per sequence that the compute estimate assumes (>= 1): attention grows with its "
        "square, the MLP and LM head linearly. Used only to weigh the parts against each other, by "
        "`cut_points: auto` and the 'est. compute' column of `rewrite show`; the batches you run "
        "may be any length."))] = 2048


def cut_point_problems(cuts: Any, pp: Any, k: Any = 1) -> list[str]:
    """Cut points against the mesh and virtual stages; also run on raw data when other fields failed."""
    if not isinstance(cuts, list) or not is_count(pp) or not is_count(k):
        return []
    problems = []
    if len(cuts) != pp * k - 1:
        given = f"mesh.pp={pp}" + (f" x virtual_stages={k}" if k != 1 else "")
        rule = "pp - 1" if k == 1 else "pp x virtual_stages - 1"
        problems.append(f"pipeline.cut_points: {len(cuts)} cut point(s) {short(cuts)} for {given}; "
                        f"need exactly {rule} = {pp * k - 1} (or omit cut_points for a balanced split)")
    counts = Counter(c for c in cuts if isinstance(c, str))  # a Counter: a list of any length stays linear
    dupes = sorted(c for c, n in counts.items() if n > 1)
    if dupes:
        problems.append(f"pipeline.cut_points: {short(dupes)} listed more than once; each stage needs its own start")
    return problems


def schedule_fit(data: dict) -> str:
    """'; with virtual_stages: 1 these fit: ...' for the raw plan `data`, or '' when its sizes are invalid."""
    pipe, mesh = data.get("pipeline"), data.get("mesh")
    k = pipe.get("virtual_stages", 1) if isinstance(pipe, dict) else 1
    pp = mesh.get("pp", 1) if isinstance(mesh, dict) else 1
    if not all(is_count(v) for v in (pp, k)):
        return ""
    fit = [name for name in SCHEDULE_NAMES if not schedule_rules(name, pp, k, 1)]
    unfit = [f"{name} needs virtual_stages{stages_needed(name)}" for name in SCHEDULE_NAMES if name not in fit]
    return f"; with virtual_stages: {k} these fit: {either(fit)}" + (f" ({', '.join(unfit)})" if unfit else "")


def schedule_problems(schedule: str, table: list[str] | str | None, pp: int, k: int, microbatches: int) -> list[str]:
    """What is wrong with the plan's schedule and table, each problem with its fix: `schedule_rules`,
    then a custom table read and checked on paper (looped placement)."""
    problems = schedule_rules(schedule, pp, k, microbatches)
    if problems:
        return problems
    if schedule != "custom":
        if table is not None:
            return [f"pipeline.table is read only with schedule: custom (found schedule {schedule!r}); "
                    "set schedule: custom, or remove the table"]
        return []
    if not isinstance(table, list):
        return ["pipeline.schedule 'custom' needs pipeline.table: one row of actions per rank, e.g. ['F0 B0', 'F0 B0']"]
    if len(table) != pp:
        return [f"pipeline.table: {ROWS.format(rows=len(table), pp=pp)}"]
    stage_rank = placement("custom", pp, k)
    parsed, problems = custom_table(table, stage_rank)
    problems = problems or table_problems(parsed, pp, microbatches, stage_rank)
    return [f"pipeline.table: {p}" for p in problems]
