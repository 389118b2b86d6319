"""A lower bound of `step_time.predict_step`'s step that needs no schedule table: what lets the plan
search skip candidates without building and simulating their tables.

With each (kind, stage)'s duration as the simulation takes it (`DpTime.costs`) and transfers left out,
for a table of any shape on a given placement:
    - a rank starts once the first microbatch's forward has run through the stages before its first
      (fill), then runs all its actions one after another (busy), then exposes at least the least of
      its data-parallel time and runs AdamW (`DpTime.tail` with an unlimited window);
    - a rank's last backward (whole backwards: its last action; split ones: its last I, after all
      its F and I) is followed by the I's or B's of the earlier stages for that microbatch, one after
      another on other ranks, the last on rank 0, which holds stage 0 (then, split, its W there).
The bound is the largest of these over ranks; `search` checks that no candidate's prediction is lower.
"""

from __future__ import annotations

__all__ = ["step_lower_bound"]


def step_lower_bound(stage_rank: tuple[int, ...], split: bool, microbatches: int,
                     costs: dict[tuple[str, int], float], tails: list[float]) -> float:
    """The least step `predict_step` can give a table on `stage_rank` (pp rank of each stage) running
    `microbatches` with these per-action `costs`; `tails`: each pp rank's least exposed data-parallel
    time plus AdamW."""
    m, c, low = microbatches, costs, 0.0
    for r, tail in enumerate(tails):
        stages = [s for s, owner in enumerate(stage_rank) if owner == r]
        first = min(stages)
        fill = sum(c["F", s] for s in range(first))
        if split:
            forward_input = m * sum(c["F", s] + c["I", s] for s in stages)
            busy = forward_input + m * sum(c["W", s] for s in stages)
            drain = fill + forward_input + sum(c["I", s] for s in range(first)) + c["W", 0] if first else 0.0
        else:
            busy = m * sum(c["F", s] + c["B", s] for s in stages)
            drain = fill + busy + sum(c["B", s] for s in range(first))
        low = max(low, fill + busy + tail, drain + tails[0])
    return low * (1 - 1e-9)  # summed in another order than the simulation: kept below it by more than rounding
