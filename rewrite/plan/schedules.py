"""Pipeline schedules as data: per rank, the ordered actions it runs, checked on paper.

A table has one row per pp rank. A cell is `F<mb>` (the forward of microbatch mb),
`B<mb>` (its backward) or `W<mb>` (its weight gradients, split off B) on the rank's only
stage, or `F<mb>@<stage>` where a rank holds several (pipeline.virtual_stages). A named
schedule (`named_schedules`) is a pure function `(pp, k, microbatches) -> table`; a
user's table goes through the same check:

    >>> print(format_table(build_table("1f1b", 2, 3)))
    rank 0: F0 F1 B0 F2 B1 B2
    rank 1: F0 B0 F1 B1 F2 B2

The check: each rank lists every F and B of the stages it holds once, a B after its F,
a W (optional) after its B; then it simulates the table: a forward runs after the
previous stage's forward, a backward after the next stage's backward, and no rank may
wait forever. Transfers need no matching order: the runtime receives in the order the
sender sends, so a table that does not deadlock on paper runs.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from pathlib import Path

from .files import PlanError, short
from .limits import read_plan_bytes
from .named_schedules import SCHEDULES, Action, Table, needs, placement

__all__ = [
    "Action", "Table", "SCHEDULES", "build_table", "parse_row", "format_table", "table_problems", "simulate",
    "peak_in_flight", "plan_table", "placement", "schedule_rules", "schedule_problems", "read_table_file",
    "splits_backward",
]

_NAMES = (*SCHEDULES, "custom")
_CELL = re.compile(r"([FBW])(\d+)(?:@(\d+))?")
_ROWS = "the table has {rows} rows but the pipeline has pp={pp} ranks: give one row per rank"
_CELLS = (
    "cells are F<mb>, B<mb> or W<mb> (forward, backward, weight gradient), F<mb>@<stage> where a rank holds several stages"
)


def schedule_rules(name: str, pp: int, k: int, microbatches: int) -> list[str]:
    """Why schedule `name` cannot run `microbatches` microbatches with `k` stages on each of `pp` ranks.

    The named schedules run any number of microbatches >= 1 on any pp >= 1; what they
    need is their number of stages per rank: 'afab' and '1f1b' one, 'interleaved-1f1b'
    two or more, 'zbv' exactly two; 'zero-bubble' and 'custom' any.

    Example:
        >>> schedule_rules("zbv", 4, 2, 8)
        []
    """
    if name not in _NAMES:
        return [f"pipeline.schedule {short(name)} is unknown; use one of {', '.join(_NAMES)}"]
    if pp < 1 or k < 1 or microbatches < 1:
        return [
            f"pipeline.schedule {name!r} needs pp, virtual_stages and microbatches >= 1 "
            f"(found {pp}, {k}, {microbatches}); give each at least 1"
        ]
    if name in ("afab", "1f1b") and k != 1:
        return [
            f"pipeline.schedule {name!r} runs one stage per rank: it needs virtual_stages: 1 (found {k}); "
            f"set virtual_stages: 1, or use 'interleaved-1f1b' or 'zero-bubble' for {k} stages per rank"
        ]
    if name == "interleaved-1f1b" and k < 2:
        return [
            f"pipeline.schedule 'interleaved-1f1b' needs virtual_stages >= 2 (found {k}); "
            "set virtual_stages: 2, or use '1f1b'"
        ]
    if name == "zbv" and k != 2:
        return [
            f"pipeline.schedule 'zbv' needs virtual_stages: 2, exactly (found {k}): its V puts stages r and "
            f"2pp - 1 - r on rank r; set virtual_stages: 2, or use 'zero-bubble' for {k} stage(s) per rank"
        ]
    return []


def build_table(name: str, pp: int, microbatches: int, k: int = 1) -> Table:
    """The table of a named schedule (see `SCHEDULES`).

    Raises:
        ValueError: an unknown name, or `schedule_rules` refuses the sizes.

    Example:
        >>> build_table("zbv", 2, 4, k=2)[0][:3]
        (Action(kind='F', mb=0, stage=0), Action(kind='F', mb=1, stage=0), Action(kind='F', mb=2, stage=0))
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {short(name)}: use one of {', '.join(SCHEDULES)}, or 'custom' with a table")
    problems = schedule_rules(name, pp, k, microbatches)
    if problems:
        raise ValueError("; ".join(problems))
    return SCHEDULES[name](pp, k, microbatches)


def parse_row(text: str, rank: int, stages: Sequence[int] | None = None) -> tuple[tuple[Action, ...], list[str]]:
    """Actions of one rank from `"F0 F1 B0 B1"` (spaces or commas between cells), and what is wrong with them.

    Args:
        text: the row.
        rank: its pp rank, for messages.
        stages: the stages the rank holds (default: stage `rank` only). A cell without
            `@<stage>` means the only one; with several, each cell must name its stage.
    """
    stages = (rank,) if stages is None else tuple(stages)
    held = ", ".join(map(str, stages))
    actions, bad, problems = [], [], []
    for pos, cell in enumerate(c for c in re.split(r"[\s,]+", text.strip()) if c):
        match = _CELL.fullmatch(cell)
        if not match:
            bad.append(short(cell))
        elif match[3] is None and len(stages) != 1:
            problems.append(
                f"rank {rank}, cell {pos} ({cell}): names no stage, and rank {rank} holds stages {held}; "
                f"write {cell}@<stage>, e.g. {cell}@{stages[0]}"
            )
        elif match[3] is not None and int(match[3]) not in stages:
            problems.append(
                f"rank {rank}, cell {pos} ({cell}): stage {match[3]} is not on rank {rank}, which holds stage(s) {held}"
            )
        else:
            actions.append(Action(match[1], int(match[2]), stages[0] if match[3] is None else int(match[3])))
    if bad:
        problems.insert(0, f"rank {rank}: cannot read {', '.join(bad[:3])}; {_CELLS}, e.g. F0 B0 or F0@2 B0@2")
    return tuple(actions), problems


def _layout(table: Table, stage_rank: Sequence[int] | None) -> tuple[tuple[int, ...], bool]:
    """The stage placement (default: inferred from the table, looped) and whether cells must name stages."""
    if stage_rank is None:
        highest = max((a.stage for row in table for a in row), default=len(table) - 1)
        stage_rank = tuple(s % max(len(table), 1) for s in range(max(highest + 1, len(table))))
    stage_rank = tuple(stage_rank)
    return stage_rank, any(stage_rank.count(r) > 1 for r in set(stage_rank))


def format_table(table: Table, stage_rank: Sequence[int] | None = None) -> str:
    """One line per rank: `rank 0: F0 F1 B0 B1`, or `rank 0: F0@0 F0@2 ...` when a rank holds several stages."""
    at = _layout(table, stage_rank)[1]
    return "\n".join(f"rank {r}: " + " ".join(a.cell(at) for a in row) for r, row in enumerate(table))


def simulate(
    table: Table, stage_rank: Sequence[int] | None = None, cost: dict[str, float] | None = None
) -> tuple[dict[Action, tuple[float, float]], list[str]]:
    """Run the table on paper: each action's (start, end).

    Ranks run their rows in order; an action starts when its rank is free and what it
    waits for (`named_schedules.needs`) has ended; transfers cost nothing, between ranks
    or on one. `cost` per kind defaults to F 1, B 2, W 1; a B whose W is listed does
    the input gradient only and costs B - W.

    Returns:
        The times, and one problem per stuck rank naming its first cell that cannot run
        (empty when the table runs to the end).
    """
    cost = {"F": 1.0, "B": 2.0, "W": 1.0, **(cost or {})}
    stage_rank, at = _layout(table, stage_rank)
    last, pp = len(stage_rank), len(table)
    split = {(a.mb, a.stage) for row in table for a in row if a.kind == "W"}
    times: dict[Action, tuple[float, float]] = {}
    free, position = [0.0] * pp, [0] * pp
    while any(position[r] < len(table[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while position[r] < len(table[r]):
                action = table[r][position[r]]
                need = needs(action, last)
                if need != action and need not in times:
                    break
                took = cost[action.kind] - (cost["W"] if action.kind == "B" and (action.mb, action.stage) in split else 0)
                start = max(free[r], times[need][1] if need != action else 0.0)
                times[action] = (start, start + took)
                free[r], position[r], moved = start + took, position[r] + 1, True
        if not moved:
            stuck = [(r, position[r], table[r][position[r]]) for r in range(pp) if position[r] < len(table[r])]
            return times, [
                f"rank {r}, cell {pos} ({a.cell(at)}) waits forever for {needs(a, last)} of stage {needs(a, last).stage}"
                for r, pos, a in stuck
            ]
    return times, []


def _row_problems(row: tuple[Action, ...], rank: int, microbatches: int, held: list[int], at: bool) -> list[str]:
    problems, seen = [], set()
    for pos, action in enumerate(row):
        where, mb, s = f"rank {rank}, cell {pos} ({action.cell(at)})", action.mb, action.stage
        if action.kind not in ("F", "B", "W"):
            problems.append(f"{where}: unknown kind {action.kind!r}; {_CELLS}")
        elif not 0 <= mb < microbatches:
            problems.append(f"{where}: microbatch {mb} is not in 0..{microbatches - 1}")
        elif s not in held:
            problems.append(f"{where}: stage {s} is not on rank {rank}, which holds stage(s) {', '.join(map(str, held))}")
        elif action in seen:
            problems.append(f"{where}: listed twice")
        elif action.kind == "B" and Action("F", mb, s) not in seen:
            problems.append(f"{where}: the backward comes before its forward {Action('F', mb, s).cell(at)}")
        elif action.kind == "W" and Action("B", mb, s) not in seen:
            problems.append(f"{where}: the weight gradient comes before its backward {Action('B', mb, s).cell(at)}")
        seen.add(action)
    for kind in "FB":
        missing = [Action(kind, i, s).cell(at) for s in held for i in range(microbatches) if Action(kind, i, s) not in seen]
        if missing:
            problems.append(f"rank {rank}: {' '.join(missing)} missing; each microbatch needs one F and one B per stage")
    return problems


def table_problems(table: Table, pp: int, microbatches: int, stage_rank: Sequence[int] | None = None) -> list[str]:
    """Why `table` cannot run `microbatches` microbatches on `pp` ranks (empty: it can).

    Args:
        stage_rank: the pp rank of each stage (`placement`); default one stage per rank.
    """
    if len(table) != pp:
        return [_ROWS.format(rows=len(table), pp=pp)]
    stage_rank, at = _layout(table, tuple(range(pp)) if stage_rank is None else stage_rank)
    held = [[s for s, r in enumerate(stage_rank) if r == rank] for rank in range(pp)]
    problems = [p for r, row in enumerate(table) for p in _row_problems(row, r, microbatches, held[r], at)]
    if problems:
        return problems
    _, stuck = simulate(table, stage_rank)
    return ["the table deadlocks: " + "; ".join(stuck)] if stuck else []


def peak_in_flight(row: tuple[Action, ...]) -> int:
    """Most (mb, stage) pairs whose forward ran and whose last backward action (its W if
    listed, else its B) did not, at once: the activations a rank holds."""
    split = {(a.mb, a.stage) for a in row if a.kind == "W"}
    live = peak = 0
    for action in row:
        if action.kind == "F":
            live += 1
        elif action.kind == "W" or (action.mb, action.stage) not in split:
            live -= 1
        peak = max(peak, live)
    return peak


def _custom_table(rows: list[str], stage_rank: tuple[int, ...]) -> tuple[Table, list[str]]:
    table, problems = [], []
    for r, text in enumerate(rows):
        actions, bad = parse_row(text, r, [s for s, rank in enumerate(stage_rank) if rank == r])
        problems += bad
        table.append(actions)
    return tuple(table), problems


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
        return [f"pipeline.table: {_ROWS.format(rows=len(table), pp=pp)}"]
    stage_rank = placement("custom", pp, k)
    parsed, problems = _custom_table(table, stage_rank)
    problems = problems or table_problems(parsed, pp, microbatches, stage_rank)
    return [f"pipeline.table: {p}" for p in problems]


def plan_table(schedule: str, table: list[str] | None, pp: int, k: int, microbatches: int) -> Table:
    """The table a plan's pipeline runs for `microbatches` microbatches (a custom table has its own count)."""
    if schedule == "custom":
        return _custom_table(table or [], placement("custom", pp, k))[0]
    return build_table(schedule, pp, microbatches, k)


def splits_backward(pipeline) -> bool:
    """Whether the plan's schedule splits backwards into B and W (zero-bubble, zbv, a custom table with W)."""
    if pipeline.schedule in ("zero-bubble", "zbv"):
        return True
    return pipeline.schedule == "custom" and any("W" in row for row in pipeline.table or [])


def read_table_file(data: dict, base: Path, source: str) -> dict:
    """`data` with a `pipeline.table` naming a CSV file (relative to `base`) replaced by its rows."""
    pipeline = data.get("pipeline")
    if not isinstance(pipeline, dict) or not isinstance(pipeline.get("table"), str):
        return data
    path = base / pipeline["table"]
    try:
        text = read_plan_bytes(path).decode("utf-8")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise PlanError(source, [f"pipeline.table: cannot read the table file {str(path)!r}: {getattr(exc, 'strerror', None) or exc}"]) from None
    rows = [" ".join(c.strip() for c in row if c.strip()) for row in csv.reader(io.StringIO(text))]
    rows = [r for r in rows if r and not r.startswith("#")]
    return {**data, "pipeline": {**pipeline, "table": rows}}
