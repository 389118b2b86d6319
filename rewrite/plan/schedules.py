"""Pipeline schedules as data: per rank, the ordered actions it runs, checked on paper.

A table has one row per rank; rank r runs stage r. An action is `F<mb>` (the forward
of microbatch mb) or `B<mb>` (its backward). A named schedule is a pure function
`(pp, microbatches) -> table`; a user's table goes through the same check:

    >>> print(format_table(build_table("1f1b", 2, 3)))
    rank 0: F0 F1 B0 F2 B1 B2
    rank 1: F0 B0 F1 B1 F2 B2

The check simulates the table: every action runs once, a forward after the stage
before it sent that microbatch, a backward after its own forward and after the stage
after it sent the gradient; transfers between two stages go in the order both sides
list them; and no rank waits forever.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import PlanError
from .limits import read_plan_bytes

__all__ = [
    "Action",
    "SCHEDULES",
    "build_table",
    "parse_row",
    "format_table",
    "table_problems",
    "simulate",
    "peak_in_flight",
    "plan_table",
    "placement",
    "schedule_problems",
    "read_table_file",
]


@dataclass(frozen=True)
class Action:
    """One cell of a table: the forward ("F") or backward ("B") of microbatch `mb` on `stage`."""

    kind: str
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


Table = tuple[tuple[Action, ...], ...]  # one row per rank


def afab(pp: int, microbatches: int) -> Table:
    """All forward, all backward (GPipe): every microbatch's activations stay alive until its backward."""
    return tuple(
        tuple(Action("F", i, s) for i in range(microbatches)) + tuple(Action("B", i, s) for i in range(microbatches))
        for s in range(pp)
    )


def one_f_one_b(pp: int, microbatches: int) -> Table:
    """1F1B: `pp - s - 1` warm-up forwards on stage s, then a forward and a backward in turn.

    Stage s holds at most `pp - s` microbatches' activations, however many microbatches run.
    """
    rows = []
    for s in range(pp):
        warmup = min(pp - s - 1, microbatches)
        row = [Action("F", i, s) for i in range(warmup)]
        for i in range(microbatches - warmup):
            row += [Action("F", warmup + i, s), Action("B", i, s)]
        row += [Action("B", i, s) for i in range(microbatches - warmup, microbatches)]
        rows.append(tuple(row))
    return tuple(rows)


def placement(schedule: str, pp: int, k: int = 1) -> tuple[int, ...]:
    """The pp rank holding each of the `pp * k` stages.

    Looped (rank r holds stages r, r + pp, ...) for every schedule but 'zbv', whose V
    places stages r and 2pp - 1 - r on rank r.

        >>> placement("interleaved-1f1b", 2, 2), placement("zbv", 2, 2)
        ((0, 1, 0, 1), (0, 1, 1, 0))
    """
    if schedule == "zbv":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(pp * k))
    return tuple(s % pp for s in range(pp * k))


SCHEDULES = {"afab": afab, "1f1b": one_f_one_b}

_CELL = re.compile(r"([FB])(\d+)")


def build_table(name: str, pp: int, microbatches: int) -> Table:
    """The table of a named schedule (see `SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}, or 'custom' with a table")
    return SCHEDULES[name](pp, microbatches)


def parse_row(text: str, stage: int) -> tuple[tuple[Action, ...], list[str]]:
    """Actions of one rank from `"F0 F1 B0 B1"` (spaces or commas between cells), and the cells it cannot read."""
    actions, bad = [], []
    for cell in re.split(r"[\s,]+", text.strip()):
        if not cell:
            continue
        match = _CELL.fullmatch(cell)
        if match:
            actions.append(Action(match[1], int(match[2]), stage))
        else:
            bad.append(cell)
    return tuple(actions), bad


def format_table(table: Table) -> str:
    """One line per rank: `rank 0: F0 F1 B0 B1`."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, row)) for r, row in enumerate(table))


def _needs(action: Action, pp: int) -> Action | None:
    """The action on a neighbouring stage whose transfer this one waits for."""
    if action.kind == "F":
        return Action("F", action.mb, action.stage - 1) if action.stage > 0 else None
    return Action("B", action.mb, action.stage + 1) if action.stage < pp - 1 else None


def _row_problems(row: tuple[Action, ...], rank: int, microbatches: int) -> list[str]:
    problems, seen = [], set()
    for pos, action in enumerate(row):
        if not 0 <= action.mb < microbatches:
            problems.append(f"rank {rank}, cell {pos} ({action}): microbatch {action.mb} is not in 0..{microbatches - 1}")
        elif action in seen:
            problems.append(f"rank {rank}, cell {pos} ({action}): listed twice")
        elif action.kind == "B" and Action("F", action.mb, action.stage) not in seen:
            problems.append(f"rank {rank}, cell {pos} ({action}): the backward comes before its forward F{action.mb}")
        seen.add(action)
    for kind in "FB":
        missing = [f"{kind}{i}" for i in range(microbatches) if Action(kind, i, rank) not in seen]
        if missing:
            problems.append(f"rank {rank}: {' '.join(missing)} missing; each microbatch needs one F and one B per stage")
    return problems


def _order_problems(table: Table) -> list[str]:
    """Transfers between neighbours are matched in order: both sides must list them alike."""
    problems = []
    for s in range(len(table) - 1):
        for kind, sender, receiver in (("F", s, s + 1), ("B", s + 1, s)):
            sent = [a.mb for a in table[sender] if a.kind == kind]
            got = [a.mb for a in table[receiver] if a.kind == kind]
            if sent != got:
                problems.append(
                    f"ranks {sender} -> {receiver}: rank {sender} sends {kind} of microbatches {sent} but rank "
                    f"{receiver} receives them as {got}; list them in the same order on both"
                )
    return problems


def simulate(table: Table, cost: dict[str, float] | None = None) -> tuple[dict[Action, tuple[float, float]], list[str]]:
    """Run the table on paper: each action's (start, end) with `cost` per kind (default F 1, B 2).

    Ranks run their rows in order; an action starts when its rank is free and the action
    it waits for has ended. Returns the times and, if no rank can go on, one problem per
    stuck rank naming its first cell that cannot run.
    """
    cost = cost or {"F": 1.0, "B": 2.0}
    pp, times, free = len(table), {}, [0.0] * len(table)
    position = [0] * pp
    while any(position[r] < len(table[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while position[r] < len(table[r]):
                action = table[r][position[r]]
                need = _needs(action, pp)
                if need is not None and need not in times:
                    break
                start = max(free[r], times[need][1] if need is not None else 0.0)
                times[action] = (start, start + cost[action.kind])
                free[r], position[r], moved = start + cost[action.kind], position[r] + 1, True
        if not moved:
            return times, [
                f"rank {r}, cell {position[r]} ({table[r][position[r]]}) waits forever for "
                f"{_needs(table[r][position[r]], pp)} of stage {_needs(table[r][position[r]], pp).stage}"
                for r in range(pp)
                if position[r] < len(table[r])
            ]
    return times, []


def table_problems(table: Table, pp: int, microbatches: int) -> list[str]:
    """Why `table` cannot run `microbatches` microbatches on `pp` stages (empty: it can)."""
    if len(table) != pp:
        return [f"the table has {len(table)} rows but the pipeline has pp={pp} ranks: give one row per rank"]
    problems = [p for r, row in enumerate(table) for p in _row_problems(row, r, microbatches)]
    if problems:
        return problems
    problems = _order_problems(table)
    if problems:
        return problems
    _, stuck = simulate(table)
    return ["the table deadlocks: " + "; ".join(stuck)] if stuck else []


def peak_in_flight(row: tuple[Action, ...]) -> int:
    """Most microbatches whose forward ran and backward did not, at once: activations held."""
    live = peak = 0
    for action in row:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def _custom_table(rows: list[str]) -> tuple[Table, list[str]]:
    table, problems = [], []
    for r, text in enumerate(rows):
        actions, bad = parse_row(text, r)
        if bad:
            problems.append(f"rank {r}: cannot read {', '.join(map(repr, bad[:3]))}; cells are F<mb> or B<mb>, e.g. F0 B0")
        table.append(actions)
    return tuple(table), problems


def schedule_problems(schedule: str, table: list[str] | str | None, pp: int, microbatches: int) -> list[str]:
    """What is wrong with the plan's schedule and table, each problem with its fix."""
    if schedule != "custom":
        if table is not None:
            return [f"pipeline.table is read only with schedule: custom (found schedule {schedule!r}); "
                    "set schedule: custom, or remove the table"]
        return []
    if not isinstance(table, list):
        return ["pipeline.schedule 'custom' needs pipeline.table: one row of actions per rank, e.g. ['F0 B0', 'F0 B0']"]
    parsed, problems = _custom_table(table)
    problems = problems or table_problems(parsed, pp, microbatches)
    return [f"pipeline.table: {p}" for p in problems]


def plan_table(schedule: str, table: list[str] | None, pp: int, microbatches: int) -> Table:
    """The table a plan's pipeline runs for `microbatches` microbatches (a custom table has its own count)."""
    return _custom_table(table)[0] if schedule == "custom" else build_table(schedule, pp, microbatches)


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
