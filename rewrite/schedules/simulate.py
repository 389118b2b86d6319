"""Tables run on paper: each action's start and end under given durations and transfers, and the bubble.

What `table_problems` checks a table with (unit costs), what `rewrite show --schedule`
prints, and what the step-time model (`rewrite.estimate.step_time`) times a plan by.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .actions import Action, Table, needs

__all__ = ["simulate", "bubble", "layout"]


def layout(table: Table, stage_rank: Sequence[int] | None) -> tuple[tuple[int, ...], bool]:
    """The stage placement (default: inferred from the table, looped) and whether cells must name stages."""
    if stage_rank is None:
        highest = max((a.stage for row in table for a in row), default=len(table) - 1)
        stage_rank = tuple(s % max(len(table), 1) for s in range(max(highest + 1, len(table))))
    stage_rank = tuple(stage_rank)
    return stage_rank, any(stage_rank.count(r) > 1 for r in set(stage_rank))


def simulate(
    table: Table,
    stage_rank: Sequence[int] | None = None,
    cost: dict[str, float] | Callable[[Action], float] | None = None,
    delay: Callable[[Action, Action], float] | None = None,
) -> tuple[dict[Action, tuple[float, float]], list[str]]:
    """Run the table on paper: each action's (start, end).

    Ranks run their rows in order; an action starts when its rank is free and what it
    waits for (`actions.needs`) has ended, plus the transfer between them when they run
    on different ranks.

    Args:
        table, stage_rank: the table and the pp rank of each stage (default: inferred, looped).
        cost: each action's duration: per kind (default F 1, B 2, W 1, and I the B less
            the W), or a function of the action (per stage and kind: the step-time model).
        delay: the transfer an action waits for after what it needs ended on another rank,
            `delay(need, action)`; default none (transfers are free).

    Returns:
        The times, and one problem per stuck rank naming its first cell that cannot run
        (empty when the table runs to the end).
    """
    if callable(cost):
        duration = cost
    else:
        kinds = {"F": 1.0, "B": 2.0, "W": 1.0, **(cost or {})}
        kinds.setdefault("I", kinds["B"] - kinds["W"])
        duration = lambda a: kinds[a.kind]  # noqa: E731
    stage_rank, at = layout(table, stage_rank)
    last, pp = len(stage_rank), len(table)
    steps = _steps(table, last)
    times: dict[Action, tuple[float, float]] = {}
    ended: dict[tuple, float] = {}  # by `done_key`: an I ends a backward as a B does
    free, position = [0.0] * pp, [0] * pp
    while any(position[r] < len(table[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            row = steps[r]
            while position[r] < len(row):
                action, need, done = row[position[r]]
                ready = 0.0
                if need is not None:
                    if need not in ended:
                        break
                    ready = ended[need]
                    if delay is not None and stage_rank[need[2]] != r:
                        ready += delay(Action(*need), action)
                start = max(free[r], ready)
                end = start + duration(action)
                times[action] = (start, end)
                ended[done] = end
                free[r], position[r], moved = end, position[r] + 1, True
        if not moved:
            stuck = [(r, position[r], table[r][position[r]]) for r in range(pp) if position[r] < len(table[r])]
            return times, [
                f"rank {r}, cell {pos} ({a.cell(at)}) waits forever for {needs(a, last)} of stage {needs(a, last).stage}"
                for r, pos, a in stuck
            ]
    return times, []


def bubble(table: Table, times: dict[Action, tuple[float, float]]) -> float:
    """The share of the step the ranks idle in a simulated table: 1 - busy / (ranks x span)."""
    span = max((end for _, end in times.values()), default=0.0)
    busy = sum(end - start for start, end in times.values())
    return 1 - busy / (len(table) * span) if span else 0.0


_STEPS: dict[int, tuple] = {}  # id(table) -> (table, its steps): a search simulates the same cached tables


def _steps(table: Table, num_stages: int) -> list[list[tuple]]:
    """Per rank, per action: (action, what it waits for as a `(kind, mb, stage)` key or None, what its end
    provides). The keys are `actions.needs` and `done_key` written as tuples, which hash in C: the
    simulation of a long table stays quick."""
    held = _STEPS.get(id(table))
    if held is not None and held[0] is table and held[1] == num_stages:
        return held[2]
    last = num_stages - 1
    steps = []
    for row in table:
        out = []
        for a in row:
            kind, mb, s = a.kind, a.mb, a.stage
            if kind == "F":
                need = ("F", mb, s - 1) if s > 0 else None
            elif kind == "W":
                need = ("B", mb, s)
            else:  # B or I: the next stage's backward, or on the last stage its own forward
                need = ("B", mb, s + 1) if s < last else ("F", mb, s)
            out.append((a, need, ("B", mb, s) if kind == "I" else (kind, mb, s)))
        steps.append(out)
    if len(_STEPS) > 1024:
        _STEPS.clear()
    _STEPS[id(table)] = (table, num_stages, steps)
    return steps
