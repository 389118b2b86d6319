"""The schedule table `rewrite show --schedule` prints: each rank's actions and the predicted bubble."""

from __future__ import annotations

from ...plan.schema import ParallelPlan
from ...plan.wording import plural
from ...schedules import KINDS, Table, bubble, peak_in_flight, placement, plan_table, simulate
from .columns import format_table

__all__ = ["format_schedule"]


def _costs(table: Table) -> str:
    kinds = {a.kind for row in table for a in row}
    if "I" not in kinds:
        return "F costs 1, B 2"
    if "B" not in kinds:
        return "F costs 1, I 1 + W 1: the backward split into input and weight gradients"
    return "F costs 1, a whole B 2, a split one I 1 + W 1"


def format_schedule(plan: ParallelPlan, *, microbatches: int | None = None) -> str:
    """The plan's schedule table, one row per rank, with what it predicts on paper.

    Each row lists the rank's cells in order (`F3 I2 W2`; `F3@2` for stage 2 when ranks
    hold several stages), the most (mb, stage) pairs whose activations it holds at once,
    and its idle share. The bubble is the share of the step ranks idle when a forward
    costs 1, a backward 2 (or, split, I 1 and W 1) and transfers nothing: a lower bound
    on what a real run loses.

    Example:
        >>> print(format_schedule(load_plan({"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b"}})))
    """
    pipe, pp, k = plan.pipeline, plan.mesh.pp, plan.pipeline.virtual_stages
    m = pipe.microbatches if pipe.schedule == "custom" or microbatches is None else microbatches
    stage_rank = placement(pipe.schedule, pp, k)
    table = plan_table(pipe.schedule, pipe.table, pp, k, m)
    times, _ = simulate(table, stage_rank)
    span = max((end for _, end in times.values()), default=0.0)
    rows = []
    for rank, row in enumerate(table):
        busy = sum(times[a][1] - times[a][0] for a in row if a in times)
        idle = 1 - busy / span if span else 0.0
        rows.append([str(rank), " ".join(a.cell(k > 1) for a in row), str(peak_in_flight(row)), f"{idle:.0%}"])
    idle_share = bubble(table, times)
    kinds = {a.kind for row in table for a in row}
    n = pp * k
    ranks = f", {k} on each of {plural(pp, 'rank')}" if k > 1 else ""
    words = ", ".join(f"{kind} = {KINDS[kind]}" for kind in KINDS if kind in kinds) + " of a microbatch"
    return "\n".join([
        f"Schedule {pipe.schedule}: {plural(m, 'microbatch')} on {plural(n, 'stage')}{ranks} "
        f"({words}{'; F3@2: on stage 2' if k > 1 else ''})",
        format_table(["rank", "actions, in order", "alive at most", "idle"], rows),
        f"  predicted bubble: {idle_share:.0%} of the step ({_costs(table)}; transfers free)",
    ])
