"""Tables run on paper: each action's start and end under given durations and transfers, and the bubble.

What `table_problems` checks a table with (unit costs), what `rewrite show --schedule`
prints, and what the step-time model (`rewrite.estimate.step_time`) times a plan by.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable, Mapping, Sequence

from .actions import Action, Table, needs

__all__ = ["simulate", "simulate_summary", "simulate_shared", "Summary", "bubble", "bubble_of", "layout"]


def layout(table: Table, stage_rank: Sequence[int] | None) -> tuple[tuple[int, ...], bool]:
    """The stage placement (default: inferred from the table, looped) and whether cells must name stages."""
    if stage_rank is None:
        highest = max((a.stage for row in table for a in row), default=len(table) - 1)
        stage_rank = tuple(s % max(len(table), 1) for s in range(max(highest + 1, len(table))))
    stage_rank = tuple(stage_rank)
    return stage_rank, any(stage_rank.count(r) > 1 for r in set(stage_rank))


def simulate(table: Table, stage_rank: Sequence[int] | None = None,
             cost: Mapping[str, float] | Mapping[tuple[str, int], float] | Callable[[Action], float] | None = None,
             delay: Mapping[tuple[int, int], float] | Callable[[Action, Action], float] | None = None,
             ) -> tuple[dict[Action, tuple[float, float]], list[str]]:
    """Run the table on paper: each action's (start, end).

    Ranks run their rows in order; an action starts when its rank is free and what it
    waits for (`actions.needs`) has ended, plus the transfer between them when they run
    on different ranks.

    Args:
        table, stage_rank: the table and the pp rank of each stage (default: inferred, looped).
        cost: each action's duration: per kind (default F 1, B 2, W 1, and I the B less
            the W), per (kind, stage) (the step-time model's), or a function of the action.
        delay: the transfer an action waits for after what it needs ended on another rank:
            `delay(need, action)`, or per (pp rank of the need, pp rank of the action); default
            none (transfers are free).

    Returns:
        The times, and one problem per stuck rank naming its first cell that cannot run
        (empty when the table runs to the end).
    """
    run, starts, ends = _timed(table, stage_rank, cost, delay)
    return dict(zip(run.actions, zip(starts, ends))), list(run.stuck)


Summary = namedtuple("Summary", "last span busy stuck")
Summary.__doc__ = """A simulated table in brief: each rank's last action's (start, end) (None for an empty row), the
span (the latest end), the busy time (every action's end less its start, summed in the order they run),
and the stuck ranks' problems."""


def simulate_summary(table: Table, stage_rank: Sequence[int] | None = None, cost=None, delay=None) -> Summary:
    """`simulate`'s times in brief (`Summary`), for a caller that reads only each rank's end, the span and the
    bubble: no action is hashed into a mapping. `bubble_of(summary, ranks)` is `bubble`'s figure."""
    return _summary(*_timed(table, stage_rank, cost, delay))


def _summary(run: _Run, starts: list[float], ends: list[float]) -> Summary:
    last = [None if i < 0 else (starts[i], ends[i]) for i in run.last]
    return Summary(last, max(ends, default=0.0), sum(e - b for b, e in zip(starts, ends)), list(run.stuck))


def simulate_shared(table: Table, stage_rank: Sequence[int] | None, cost: Mapping[tuple[str, int], float],
                    delay: Mapping[tuple[int, int], float] | None, *, share: float, cores: int, per_row: int = 1
                    ) -> Summary:
    """`simulate_summary` for ranks sharing `cores` cores, one thread each (CPU ranks): `cost` per (kind, stage)
    as measured with every rank busy at `share` of a core. A row's action runs at min(1, cores / (n x per_row))
    of a core while n rows run (each row stands for `per_row` ranks alike: its dp, cp and tp peers), the cores
    time-sliced evenly: alone it takes its cost x share, and a row waiting for another frees its cores to the
    rest. Transfers (`delay` per pair of pp ranks) take their time whatever the cores do."""
    stage_rank, _ = layout(table, stage_rank)
    run = _order(table, stage_rank)
    if run.stuck:
        return simulate_summary(table, stage_rank, cost, delay)
    work = [cost[key] * share for key in run.keys]  # core-seconds
    lags = _lags(run, delay)
    rows = [[] for _ in table]  # each row's positions in the run order, in the order it runs them
    for i, r in enumerate(run.ranks):
        rows[r].append(i)
    starts, ends = [0.0] * len(work), [-1.0] * len(work)  # -1: not ended yet
    on, left, ready = [0] * len(rows), [0.0] * len(rows), [math.inf] * len(rows)  # per row: its action, work, start

    def arm(r: int) -> None:  # the row's action, if it can start: when (it waits for nothing still running)
        if on[r] < len(rows[r]) and ready[r] == math.inf:
            i = rows[r][on[r]]
            j = run.provider[i]
            if j < 0 or ends[j] >= 0:
                ready[r] = starts[i] = max(now, ends[j] + lags[i] if j >= 0 else now)
                left[r] = work[i]

    now = 0.0
    for r in range(len(rows)):
        arm(r)
    while True:
        running = [r for r in range(len(rows)) if ready[r] <= now]
        rate = min(1.0, cores / (len(running) * per_row)) if running else 1.0
        finish = min((left[r] / rate for r in running), default=math.inf)  # the next end, or the next start
        arrive = min((ready[r] for r in range(len(rows)) if now < ready[r] < math.inf), default=math.inf)
        if finish == arrive == math.inf:
            break
        step = min(finish, arrive - now)
        now = arrive if arrive - now <= finish else now + step  # a start lands on its time exactly
        for r in running:
            left[r] -= rate * step
            if left[r] <= 1e-12 * (1.0 + work[rows[r][on[r]]]):  # its work done
                ends[rows[r][on[r]]], on[r], ready[r] = now, on[r] + 1, math.inf
        for r in range(len(rows)):
            arm(r)
    return _summary(run, starts, ends)


def bubble_of(summary: Summary, ranks: int) -> float:
    """`bubble` of a table of `ranks` rows from its `Summary`."""
    return 1 - summary.busy / (ranks * summary.span) if summary.span else 0.0


def _timed(table: Table, stage_rank, cost, delay) -> tuple[_Run, list[float], list[float]]:
    """The run order of `table` and each action's start and end in it (`simulate`'s arguments)."""
    stage_rank, _ = layout(table, stage_rank)
    run = _order(table, stage_rank)
    if callable(cost):
        durations = list(map(cost, run.actions))
    elif cost and isinstance(next(iter(cost)), tuple):
        durations = [cost[key] for key in run.keys]
    else:
        kinds = {"F": 1.0, "B": 2.0, "W": 1.0, **(cost or {})}
        kinds.setdefault("I", kinds["B"] - kinds["W"])
        durations = [kinds[a.kind] for a in run.actions]
    free, ends, starts = [0.0] * len(table), [], []
    for r, j, lag, d in zip(run.ranks, run.provider, _lags(run, delay), durations):
        ready = 0.0 if j < 0 else ends[j] + lag
        start = free[r] if free[r] >= ready else ready  # max(free, ready), as the rows run
        free[r] = start + d
        starts.append(start)
        ends.append(start + d)
    return run, starts, ends


def _lags(run: _Run, delay) -> list[float]:
    """Each action's wait for its transfer after what it needs ended (`simulate`'s `delay`)."""
    if callable(delay):
        return [delay(need, a) if need is not None else 0.0 for need, a in zip(run.crossing, run.actions)]
    return [0.0 if delay is None or pair is None else delay[pair] for pair in run.pairs]


# A table's actions in the order they can run, what each waits for, and where it gets stuck.
_Run = namedtuple("_Run", "actions ranks provider crossing stuck keys pairs last")

_RUNS: dict[tuple, tuple] = {}  # (id(table), stage_rank) -> (table, its _Run): a search times the same tables often


def _order(table: Table, stage_rank: tuple[int, ...]) -> _Run:
    """Each rank runs its row while what the next action waits for has ended, rank after rank, until all
    have run or none can. Independent of durations, so found once per table and placement: `provider` is,
    per action, the position (in this order) of the action whose end it waits for (-1: none), and
    `crossing` the `needs` it waits for from another rank (None: none, or on its own rank); `keys` each
    action's (kind, stage), `pairs` the (from, to) pp ranks of its crossing, `last` each rank's last
    action's position (-1: none)."""
    held = _RUNS.get((id(table), stage_rank))
    if held is not None and held[0] is table:
        return held[1]
    _, at = layout(table, stage_rank)
    pp = len(table)
    # Per rank, per action: (action, what it waits for, what its end provides), as `needs` keys.
    steps = [[(a, needs(a.kind, a.mb, a.stage, len(stage_rank)), ("B" if a.kind == "I" else a.kind, a.mb, a.stage))
              for a in row] for row in table]
    actions, ranks, provider, crossing = [], [], [], []
    ended: dict[tuple, int] = {}  # an I ends a backward as a B does
    position = [0] * pp
    stuck: list[str] = []
    while any(position[r] < len(table[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            row = steps[r]
            while position[r] < len(row):
                action, need, done = row[position[r]]
                if need is not None and need not in ended:
                    break
                provider.append(-1 if need is None else ended[need])
                crossing.append(Action(*need) if need is not None and stage_rank[need[2]] != r else None)
                ended[done] = len(actions)
                actions.append(action)
                ranks.append(r)
                position[r], moved = position[r] + 1, True
        if not moved:
            stuck = [
                f"rank {r}, cell {position[r]} ({action.cell(at)}) waits forever for {need[0]}{need[1]} of stage {need[2]}"
                for r in range(pp) if position[r] < len(table[r]) for action, need, _ in [steps[r][position[r]]]
            ]
            break
    keys = [(a.kind, a.stage) for a in actions]  # what a duration per (kind, stage) is looked up by
    pairs = [None if need is None else (stage_rank[need.stage], stage_rank[a.stage])  # a transfer's ranks
             for need, a in zip(crossing, actions)]
    last = [-1] * pp  # each rank's last action's position: its row runs in order
    for i, r in enumerate(ranks):
        last[r] = i
    run = _Run(actions, ranks, provider, crossing, tuple(stuck), keys, pairs, last)
    if len(_RUNS) > 1024:
        _RUNS.clear()
    _RUNS[id(table), stage_rank] = (table, run)
    return run


def bubble(table: Table, times: dict[Action, tuple[float, float]]) -> float:
    """The share of the step the ranks idle in a simulated table: 1 - busy / (ranks x span)."""
    span = max((end for _, end in times.values()), default=0.0)
    busy = sum(end - start for start, end in times.values())
    return 1 - busy / (len(table) * span) if span else 0.0

