"""The named pipeline schedules: pure functions `(pp, k, microbatches) -> table`, one row per pp rank
(the actions it runs, in order) over global stages 0 .. pp * k - 1 placed by `placement`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from .actions import Action, Table, needs, placement

__all__ = ["SCHEDULES", "SCHEDULE_NAMES", "STAGES_PER_RANK", "stages_needed"]


def afab(pp: int, k: int, microbatches: int) -> Table:
    """All forward, all backward (GPipe): every microbatch's activations stay alive until its backward.

        rank 0: F0 F1 B0 B1    (pp 2, 2 microbatches)
        rank 1: F0 F1 B0 B1
    """
    return tuple(tuple(Action(kind, i, s) for kind in "FB" for i in range(microbatches)) for s in range(pp))


def one_f_one_b(pp: int, k: int, microbatches: int) -> Table:
    """1F1B: `pp - s - 1` warm-up forwards on stage s, then a forward and a backward in turn.

    Stage s holds at most `pp - s` microbatches' activations, however many microbatches run.

        rank 0: F0 F1 B0 F2 B1 B2    (pp 2, 3 microbatches)
        rank 1: F0 B0 F1 B1 F2 B2
    """
    return tuple(_steady([Action("F", i, s) for i in range(microbatches)],
                         [Action("B", i, s) for i in range(microbatches)], pp - s - 1) for s in range(pp))


def _steady(forwards: list[Action], backwards: list[Action], warmup: int) -> tuple[Action, ...]:
    """`warmup` forwards (at most all), then a forward and a backward in turn, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    row = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        row += [forward, backward]
    return tuple(row + backwards[len(forwards) - warmup :])


def _groups(pp: int, microbatches: int) -> list[range]:
    # Groups of pp microbatches, as even as can be: pp to 2pp - 1 each (one group when fewer than pp).
    count = max(microbatches // pp, 1)
    bounds = [microbatches * g // count for g in range(count + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _warmup(pp: int, k: int, microbatches: int, rank: int) -> int:
    # Forwards before rank `rank`'s first backward under interleaved 1F1B.
    return 2 * (pp - rank - 1) + (k - 1) * max(map(len, _groups(pp, microbatches)))


def _looped_forwards(pp: int, k: int, microbatches: int, rank: int) -> list[Action]:
    """Rank `rank`'s forwards in interleaved order: per group of microbatches, stage chunk by chunk."""
    return [Action("F", i, c * pp + rank) for g in _groups(pp, microbatches) for c in range(k) for i in g]


def interleaved_1f1b(pp: int, k: int, microbatches: int) -> Table:
    """Interleaved 1F1B (Megatron-LM): rank r holds stages r, r + pp, ... (looped).

    Forwards go through the microbatches in groups of pp, stage chunk by chunk; backwards
    alike with the chunks reversed. Rank r runs `2 (pp - r - 1) + (k - 1) pp` warm-up
    forwards (at most all), then a forward and a backward in turn, then the remaining
    backwards. When pp does not divide the microbatches the warm-up counts the largest group
    (`_groups`) instead of pp: a short last group would deadlock. The bubble shrinks about k
    times against 1F1B's, for k times the transfers and more warm-up memory.

        rank 0: F0@0 F1@0 F0@2 F1@2 B0@2 B1@2 B0@0 B1@0    (pp 2, k 2, 2 microbatches)
        rank 1: F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 B0@1 B1@1
    """
    return tuple(
        _steady(_looped_forwards(pp, k, microbatches, r),
                [Action("B", i, c * pp + r) for g in _groups(pp, microbatches) for c in reversed(range(k)) for i in g],
                _warmup(pp, k, microbatches, r))
        for r in range(pp)
    )


def _greedy(stage_rank: tuple[int, ...], microbatches: int, limit: list[int], rank_forwards: list[list[Action]]) -> Table:
    """Run a list scheduler on paper (F, I and W one unit each, transfers free) and return what each rank ran.

    Whenever a rank is free it runs: a ready I (the oldest microbatch's, then the later
    stage's); else the first ready forward in its `rank_forwards[r]` order, if fewer than
    `limit[r]` of its (mb, stage) pairs are in flight (forward run, W not yet); else its
    oldest pending W. Each step every rank runs at most one action, ready by the step before.
    An I becomes ready when the backward it waits for has run (the last stage's: its own
    forward), a forward when the stage before ran it: each is found by that event, not by
    scanning, so long tables build quickly.
    """
    pp, num_stages = len(limit), len(stage_rank)
    done: set[tuple[str, int, int]] = set()  # ("F" | "B", mb, stage): forwards run, input gradients handed on
    rows: list[list[Action]] = [[] for _ in range(pp)]
    live, pending_w = [0] * pp, [deque() for _ in range(pp)]
    waiting_b: list[set[tuple[int, int]]] = [set() for _ in range(pp)]  # (mb, stage): forward run, I not yet
    ready_b: list[list[tuple[int, int]]] = [[] for _ in range(pp)]  # of those, the I's that can run: (mb, -stage) heaps
    # Each rank's forwards that can run (stage 0, or the stage before ran it), by their place in its order.
    where = {(f.mb, f.stage): (r, i) for r in range(pp) for i, f in enumerate(rank_forwards[r])}
    startable = [[i for i, f in enumerate(rank_forwards[r]) if f.stage == 0] for r in range(pp)]
    left = 3 * microbatches * num_stages
    while left:
        ran = []
        for r in range(pp):
            if ready_b[r]:
                mb, stage = heapq.heappop(ready_b[r])
                waiting_b[r].discard((mb, -stage))
                action = Action("I", mb, -stage)
                pending_w[r].append(Action("W", mb, -stage))
            elif live[r] < limit[r] and startable[r]:  # the first in the rank's order
                action = rank_forwards[r][heapq.heappop(startable[r])]
                waiting_b[r].add((action.mb, action.stage))
                live[r] += 1
            elif pending_w[r]:
                action = pending_w[r].popleft()
                live[r] -= 1
            else:
                continue
            rows[r].append(action)
            ran.append(action)
        if not ran:  # a bug in the limits, never a user's error: the named schedules are tested
            raise RuntimeError(f"schedule generator stuck with {left} actions left; rows so far: {rows}")
        for a in ran:
            if a.kind == "W":
                continue
            done.add(("B" if a.kind == "I" else "F", a.mb, a.stage))
            if a.kind == "F":  # this I, once its forward ran, may already have what it waits for
                if needs("I", a.mb, a.stage, num_stages) in done:
                    heapq.heappush(ready_b[stage_rank[a.stage]], (a.mb, -a.stage))
                if a.stage + 1 < num_stages:  # and the next stage's forward of this microbatch can start
                    nr, i = where[a.mb, a.stage + 1]
                    heapq.heappush(startable[nr], i)
            # The previous stage's I of this microbatch waited for this one.
            if a.kind == "I" and a.stage > 0 and (a.mb, a.stage - 1) in waiting_b[stage_rank[a.stage - 1]]:
                heapq.heappush(ready_b[stage_rank[a.stage - 1]], (a.mb, 1 - a.stage))
        left -= len(ran)
    return tuple(tuple(row) for row in rows)


def zero_bubble(pp: int, k: int, microbatches: int) -> Table:
    """Zero bubble (ZB-H1 for k = 1; interleaved zero bubble for k >= 2, looped placement).

    Every backward is split: I the input gradient, which the previous stage waits for,
    and W the weight gradients, which nobody waits for and so fill the idle slots. Made
    by `_greedy`'s list scheduler, forwards in 1F1B / interleaved order, at most that
    schedule's warm-up + 1 (mb, stage) pairs in flight (`pp - r` on rank r for k = 1): peak
    activations match 1F1B's (interleaved 1F1B's for k >= 2) while the bubble shrinks.

        rank 0: F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3    (pp 2, k 1, 4 microbatches)
        rank 1: F0 I0 W0 F1 I1 W1 F2 I2 W2 F3 I3 W3
    """
    limit = [pp - r if k == 1 else _warmup(pp, k, microbatches, r) + 1 for r in range(pp)]
    forwards = [_looped_forwards(pp, k, microbatches, r) for r in range(pp)]
    return _greedy(placement("zero-bubble", pp, k), microbatches, limit, forwards)


def zbv(pp: int, k: int, microbatches: int) -> Table:
    """ZB-V: two stages per rank in a V (rank r holds stages r and 2pp - 1 - r), backwards split into I and W.

    Rank 0 holds the first and the last stage, so a microbatch's forward goes down the
    ranks and back up, and its backward the same way reversed. The handcrafted ZB-V of
    Qi et al. (2024), the order torch's `ScheduleZBVZeroBubble` runs, in phases on rank r
    (down: its first stage r; up: its second, 2pp - 1 - r):

    - warm-up: 2(pp - r) - 1 forwards down; r times a forward up, a forward down; pp - r
      times a forward up with its I and W;
    - steady: a forward down (while any is left) with the oldest I and W down, then a
      forward up with its I and W, until every forward ran;
    - cool-down: r times an I down, an I up; pp - r times an I down with the oldest W
      down; then the W left, up first.

    Each W follows its I at once in the steady phase and fills the cool-down's waits, so
    the table keeps its shape when I, W and the stages cost unlike amounts (a last stage
    with the LM head and loss). With fewer than 2pp - 1 microbatches the phases are laid
    out for 2pp - 1 and the missing microbatches' cells left out. Every rank holds at
    most 2pp (mb, stage) pairs, each half a 1F1B stage: the peak of 1F1B's first rank.

        rank 0: F0@0 F1@0 F2@0 F0@3 I0@3 W0@3 F1@3 I1@3 W1@3 I0@0 W0@0 F2@3 I2@3 W2@3 I1@0 W1@0 I2@0 W2@0
        rank 1: F0@1 F0@2 F1@1 F1@2 I0@2 W0@2 F2@1 I0@1 W0@1 F2@2 I1@2 W1@2 I1@1 I2@2 I2@1 W1@1 W2@2 W2@1
                (pp 2, 3 microbatches)
    """
    n = max(2 * pp - 1, microbatches)
    rows = []
    for r in range(pp):
        down, up = r, 2 * pp - 1 - r
        made = {down: {"F": 0, "I": 0, "W": 0}, up: {"F": 0, "I": 0, "W": 0}}
        row: list[Action] = []

        def add(kind: str, stage: int) -> None:
            row.append(Action(kind, made[stage][kind], stage))
            made[stage][kind] += 1

        for _ in range(2 * (pp - r) - 1):
            add("F", down)
        for _ in range(r):
            add("F", up), add("F", down)
        for _ in range(pp - r):
            add("F", up), add("I", up), add("W", up)
        while made[up]["F"] < made[down]["F"] or made[down]["F"] < n:
            if made[down]["F"] < n:
                add("F", down)
            add("I", down), add("W", down)
            add("F", up), add("I", up), add("W", up)
        for _ in range(r):
            add("I", down), add("I", up)
        for _ in range(pp - r):
            add("I", down), add("W", down)
        for stage in (up, down):
            while made[stage]["W"] < made[stage]["I"]:
                add("W", stage)
        rows.append(tuple(a for a in row if a.mb < microbatches))
    return tuple(rows)


SCHEDULES: dict[str, Callable[[int, int, int], Table]] = {
    "afab": afab,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zero-bubble": zero_bubble,
    "zbv": zbv,
}

# The names `pipeline.schedule` takes: the named schedules and "custom" (the user's own table).
SCHEDULE_NAMES: tuple[str, ...] = (*SCHEDULES, "custom")

# Stages per rank (pipeline.virtual_stages) each schedule runs: (fewest, most), None for no limit.
STAGES_PER_RANK: dict[str, tuple[int, int | None]] = {
    "afab": (1, 1), "1f1b": (1, 1), "interleaved-1f1b": (2, None), "zero-bubble": (1, None), "zbv": (2, 2),
    "custom": (1, None),
}


def stages_needed(name: str) -> str:
    """What schedule `name` needs of virtual_stages, as a plan writes it: ': 1', ' >= 2', ': 2'; '' for any."""
    low, high = STAGES_PER_RANK[name]
    return f": {low}" if low == high else f" >= {low}" if low > 1 else ""
