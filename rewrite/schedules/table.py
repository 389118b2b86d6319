"""Pipeline schedules as data: per rank, the ordered actions it runs, checked on paper.

A table has one row per pp rank. A cell is `F<mb>` (the forward of microbatch mb),
`B<mb>` (its whole backward), `I<mb>` (its input-only backward) or `W<mb>` (the weight
gradients its I left) on the rank's only stage, or `F<mb>@<stage>` where a rank holds
several (pipeline.virtual_stages). A named schedule (`named`) is a pure function
`(pp, k, microbatches) -> table`; a user's table goes through the same check:

    >>> print(format_table(build_table("1f1b", 2, 3)))
    rank 0: F0 F1 B0 F2 B1 B2
    rank 1: F0 B0 F1 B1 F2 B2

The check: each rank lists every F of the stages it holds once and one backward for
each, a B or an I, after its F; an I's W after the I. Then it simulates the table: a
forward runs after the previous stage's forward, a backward after the next stage's
backward, and no rank may wait forever. Transfers need no matching order: the runtime
receives in the order the sender sends, so a table that does not deadlock on paper runs.
"""

from __future__ import annotations

import csv
import functools
import io
import re
import reprlib
from collections.abc import Sequence

from .actions import Action, Table, placement
from .named import SCHEDULE_NAMES, SCHEDULES, STAGES_PER_RANK, stages_needed
from .simulate import layout, simulate

__all__ = [
    "build_table", "parse_row", "rows_from_csv", "format_table", "table_problems", "peak_in_flight",
    "plan_table", "schedule_rules", "splits_backward", "ROWS",
]

_CELL = re.compile(r"([FBIW])(\d+)(?:@(\d+))?")
ROWS = "the table has {rows} rows but the pipeline has pp={pp} ranks: give one row per rank"
_CELLS = (
    "cells are F<mb>, B<mb>, I<mb> or W<mb> (forward, backward, input-only backward, weight gradients of an I), "
    "F<mb>@<stage> where a rank holds several stages"
)
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80  # values from the user's file, quoted at most this long
_short = _SHORT.repr


def schedule_rules(name: str, pp: int, k: int, microbatches: int) -> list[str]:
    """Why schedule `name` cannot run `microbatches` microbatches with `k` stages on each of `pp` ranks.

    The named schedules run any number of microbatches >= 1 on any pp >= 1; what they
    need is their number of stages per rank: 'afab' and '1f1b' one, 'interleaved-1f1b'
    two or more, 'zbv' exactly two; 'zero-bubble' and 'custom' any.

    Example:
        >>> schedule_rules("zbv", 4, 2, 8)
        []
    """
    if name not in SCHEDULE_NAMES:
        return [f"pipeline.schedule {_short(name)} is unknown; use one of {', '.join(SCHEDULE_NAMES)}"]
    if pp < 1 or k < 1 or microbatches < 1:
        return [f"pipeline.schedule {name!r} needs pp, virtual_stages and microbatches >= 1 "
                f"(found {pp}, {k}, {microbatches}); give each at least 1"]
    low, high = STAGES_PER_RANK[name]
    if low <= k and (high is None or k <= high):
        return []
    if name in ("afab", "1f1b"):
        return [f"pipeline.schedule {name!r} runs one stage per rank: it needs virtual_stages{stages_needed(name)} "
                f"(found {k}); set virtual_stages: 1, or use 'interleaved-1f1b' or 'zero-bubble' for {k} stages per rank"]
    if name == "zbv":
        return [f"pipeline.schedule 'zbv' needs virtual_stages{stages_needed(name)}, exactly (found {k}): its V puts "
                f"stages r and 2pp - 1 - r on rank r; set virtual_stages: 2, or use 'zero-bubble' for {k} stage(s) per rank"]
    return [f"pipeline.schedule {name!r} needs virtual_stages{stages_needed(name)} (found {k}); "
            f"set virtual_stages: {low}, or use '1f1b'"]


@functools.lru_cache(maxsize=512)  # pure, and its tables are tuples: a plan search builds the same ones often
def build_table(name: str, pp: int, microbatches: int, k: int = 1) -> Table:
    """The table of a named schedule (see `SCHEDULES`).

    Raises:
        ValueError: an unknown name, or `schedule_rules` refuses the sizes.

    Example:
        >>> build_table("zbv", 2, 4, k=2)[0][:3]
        (Action(kind='F', mb=0, stage=0), Action(kind='F', mb=1, stage=0), Action(kind='F', mb=2, stage=0))
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {_short(name)}: use one of {', '.join(SCHEDULES)}, or 'custom' with a table")
    problems = schedule_rules(name, pp, k, microbatches)
    if problems:
        raise ValueError("; ".join(problems))
    return SCHEDULES[name](pp, k, microbatches)


def parse_row(text: str, rank: int, stages: Sequence[int] | None = None) -> tuple[tuple[Action, ...], list[str]]:
    """Actions of one rank from `"F0 F1 B0 B1"` (spaces or commas between cells), and what is wrong with them.

    A `B` whose microbatch and stage also have a `W` in the row is read as `I` (the older
    spelling of a split backward).

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
            bad.append(_short(cell))
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
    split = {(a.mb, a.stage) for a in actions if a.kind == "W"}
    actions = [Action("I", a.mb, a.stage) if a.kind == "B" and (a.mb, a.stage) in split else a for a in actions]
    return tuple(actions), problems


def rows_from_csv(text: str) -> list[str]:
    """A table's rows from CSV text: one row per rank, one action per cell; empty rows and `#` lines skipped."""
    rows = [" ".join(c.strip() for c in row if c.strip()) for row in csv.reader(io.StringIO(text))]
    return [r for r in rows if r and not r.startswith("#")]


def format_table(table: Table, stage_rank: Sequence[int] | None = None) -> str:
    """One line per rank: `rank 0: F0 F1 B0 B1`, or `rank 0: F0@0 F0@2 ...` when a rank holds several stages."""
    at = layout(table, stage_rank)[1]
    return "\n".join(f"rank {r}: " + " ".join(a.cell(at) for a in row) for r, row in enumerate(table))


def _row_problems(row: tuple[Action, ...], rank: int, microbatches: int, held: list[int], at: bool) -> list[str]:
    problems, seen = [], set()
    for pos, action in enumerate(row):
        where, mb, s = f"rank {rank}, cell {pos} ({action.cell(at)})", action.mb, action.stage
        backward = next((a for a in (Action("B", mb, s), Action("I", mb, s)) if a in seen), None)
        if action.kind not in ("F", "B", "I", "W"):
            problems.append(f"{where}: unknown kind {action.kind!r}; {_CELLS}")
        elif not 0 <= mb < microbatches:
            problems.append(f"{where}: microbatch {mb} is not in 0..{microbatches - 1}")
        elif s not in held:
            problems.append(f"{where}: stage {s} is not on rank {rank}, which holds stage(s) {', '.join(map(str, held))}")
        elif action in seen:
            problems.append(f"{where}: listed twice")
        elif action.kind in "BI" and backward is not None:
            problems.append(f"{where}: microbatch {mb} already has its backward {backward.cell(at)} on stage {s}")
        elif action.kind in "BI" and Action("F", mb, s) not in seen:
            problems.append(f"{where}: the backward comes before its forward {Action('F', mb, s).cell(at)}")
        elif action.kind == "W" and backward is not None and backward.kind == "B":
            problems.append(f"{where}: {backward.cell(at)} before it is a whole backward and leaves no weight "
                            f"gradients; write I{mb} for an input-only backward, or drop the W")
        elif action.kind == "W" and backward is None:
            problems.append(f"{where}: the weight gradient comes before its backward {Action('I', mb, s).cell(at)}")
        seen.add(action)
    for kind in "FB":
        missing = [
            Action(kind, i, s).cell(at) for s in held for i in range(microbatches)
            if Action(kind, i, s) not in seen and not (kind == "B" and Action("I", i, s) in seen)
        ]
        if missing:
            problems.append(
                f"rank {rank}: {' '.join(missing)} missing; each microbatch needs one F and one B (or an I and its W) "
                "per stage"
            )
    lone = [Action("I", i, s).cell(at) for s in held for i in range(microbatches)
            if Action("I", i, s) in seen and Action("W", i, s) not in seen]
    if lone:
        problems.append(f"rank {rank}: {' '.join(lone)} without a W; add the W after each, or write B for a whole backward")
    return problems


def table_problems(table: Table, pp: int, microbatches: int, stage_rank: Sequence[int] | None = None) -> list[str]:
    """Why `table` cannot run `microbatches` microbatches on `pp` ranks (empty: it can).

    Args:
        stage_rank: the pp rank of each stage (`placement`); default one stage per rank.
    """
    if len(table) != pp:
        return [ROWS.format(rows=len(table), pp=pp)]
    stage_rank, at = layout(table, tuple(range(pp)) if stage_rank is None else stage_rank)
    held = [[s for s, r in enumerate(stage_rank) if r == rank] for rank in range(pp)]
    problems = [p for r, row in enumerate(table) for p in _row_problems(row, r, microbatches, held[r], at)]
    if problems:
        return problems
    _, stuck = simulate(table, stage_rank)
    return ["the table deadlocks: " + "; ".join(stuck)] if stuck else []


def peak_in_flight(row: tuple[Action, ...]) -> int:
    """Most (mb, stage) pairs whose forward ran and whose B (or the W after its I) did not, at once:
    the activations a rank holds."""
    return max((sum(n for _, n in counts) for counts in alive_counts(row)), default=0)


_ALIVE: dict[int, tuple] = {}  # id(row) -> (row, its counts): rows of cached tables recur in a plan search


def alive_counts(row: tuple[Action, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The (stage, pairs alive) counts at each moment the row stops running forwards: where peaks can be."""
    held = _ALIVE.get(id(row))
    if held is not None and held[0] is row:
        return held[1]
    live: dict[int, int] = {}
    found = set()
    for i, action in enumerate(row):
        if action.kind == "F":
            live[action.stage] = live.get(action.stage, 0) + 1
            if i + 1 == len(row) or row[i + 1].kind != "F":
                found.add(tuple(sorted(live.items())))
        elif action.kind in ("B", "W"):  # the pair's activations go: its B, or the W after its I
            live[action.stage] -= 1
    counts = tuple(found)
    if len(_ALIVE) > 4096:
        _ALIVE.clear()
    _ALIVE[id(row)] = (row, counts)
    return counts


def custom_table(rows: Sequence[str], stage_rank: Sequence[int]) -> tuple[Table, list[str]]:
    """A user's table from one row of text per rank (stages placed by `stage_rank`), and what cannot be read."""
    table, problems = [], []
    for r, text in enumerate(rows):
        actions, bad = parse_row(text, r, [s for s, rank in enumerate(stage_rank) if rank == r])
        problems += bad
        table.append(actions)
    return tuple(table), problems


def plan_table(schedule: str, rows: Sequence[str] | None, pp: int, k: int, microbatches: int) -> Table:
    """The table a plan's pipeline runs for `microbatches` microbatches (a custom table has its own count)."""
    if schedule == "custom":
        return custom_table(rows or [], placement("custom", pp, k))[0]
    return build_table(schedule, pp, microbatches, k)


def splits_backward(schedule: str, rows: Sequence[str] | None = None) -> bool:
    """Whether the schedule splits backwards into I and W (zero-bubble, zbv, a custom table with W cells)."""
    if schedule in ("zero-bubble", "zbv"):
        return True
    return schedule == "custom" and any("W" in row for row in rows or [])


def last_backward_reaches_all(stages_here: int, split_backward: bool) -> bool:
    """Whether a rank's last backward of a step reaches every parameter the rank holds: one stage on the rank,
    backwards whole (not split into I and W). Where it does, `replicate` runs on torch's DDP, which reduces in it."""
    return stages_here == 1 and not split_backward
