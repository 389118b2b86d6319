"""The pipeline runner: one rank's row of a schedule table (`rewrite.schedules`), checked on paper,
then executed: each action's inputs received, computed, handed on; the loss scaled, the gradients
accumulated and finished, a timeline recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.distributed as dist

from ..doing import doing
from ..errors import InputError
from ..lent import lend
from ..mesh import calm_gloo_threads
from ..schedules import placement, plan_table, schedule_rules, table_problems
from .inputs import check_step_inputs
from .loss import LossFn, causal_lm_loss, loss_for, sums_tokens
from ..tensor_parallel.loss import IGNORE_INDEX
from .stage import Stage
from .step_state import StepState

__all__ = ["run_schedule", "causal_lm_loss"]


def run_schedule(
    stage: Stage,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor] | None,
    loss_fn: LossFn | None = None,
) -> torch.Tensor:
    """One training step under the plan's `pipeline.schedule`; gradients accumulate in `.grad`.

    Named schedules run the microbatch counts their rules allow (`rewrite show PLAN --schedule`);
    a custom table runs exactly the plan's `pipeline.microbatches`.

    Args:
        stage: this rank's `Stage` from `apply_plan`.
        inputs: one per microbatch: token ids `[mb, seq]`, or a dict of `input_ids` and
            `position_ids` (packed documents). The same list on every rank: the first stage feeds
            it to the model, later stages read its length, shapes and positions.
        targets: one tensor per microbatch, aligned with the model output; needed on
            the last stage (may be None elsewhere).
        loss_fn: `loss_fn(output, target)`; default: cross-entropy over the last dimension,
            token-weighted: the sum over every microbatch's trained tokens (targets other than
            -100) over their number in the whole global batch (every microbatch, replica and cp
            shard), so the step's loss and gradients are the same under every plan. A loss_fn
            declared with `rewrite.returns_token_sums` is divided alike; any other: each
            microbatch's value over the number of microbatches, averaged over the replicas.
            Under `loss_parallel` a loss_fn gets full logits unless declared with
            `rewrite.takes_logit_shards`.

    Returns:
        The step loss (float32 scalar), the same on every rank.

    Raises:
        InputError (a ValueError): the same on every rank, before any transfer, if any rank's
            arguments are bad (ids outside the vocabulary, targets the default loss cannot take,
            a microbatch count the schedule cannot run, no trained token for a token-weighted
            loss, ...) or ranks were given different microbatches (count, shapes, dtypes).

    Example:
        >>> stage = apply_plan(model, {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b"}})
        >>> loss = run_schedule(stage, input_chunks, target_chunks)
        >>> optimizer.step(); optimizer.zero_grad()
    """
    if not sums_tokens(loss_fn) and stage.mesh.cp > 1:  # the same on every rank: refused before any collective
        raise InputError(
            f"run_schedule: a loss_fn under mesh.cp={stage.mesh.cp}: each rank holds part of every sequence, so "
            "the loss must add up over the ranks' tokens: declare a loss that returns the sum over its tokens "
            "with @rewrite.returns_token_sums, or pass loss_fn=None (the default cross-entropy)"
        )
    with doing("the step's input checks (an all-reduce over every rank)"):
        # The global batch's trained tokens, which a token-weighted loss divides by (else None).
        tokens = check_step_inputs(stage, inputs, targets, default_loss=loss_fn is None, count_tokens=sums_tokens(loss_fn))
    if sums_tokens(loss_fn) and tokens == 0:  # every rank holds the same count: refused alike
        raise InputError(
            f"run_schedule: the global batch trains no token (every target is {IGNORE_INDEX} on every replica), so a "
            "token-weighted loss has nothing to divide by; leave such a batch out, or check how its labels are masked"
        )
    pipeline, pp, m = stage.resolved.plan.pipeline, stage.mesh.pp, len(inputs)
    k = pipeline.virtual_stages  # the same on every rank: the microbatch count was agreed on above
    if pipeline.schedule == "custom" and m != pipeline.microbatches:
        raise InputError(
            f"run_schedule: the plan's custom table runs {pipeline.microbatches} microbatches, "
            f"got {m}; split the batch into {pipeline.microbatches}"
        )
    if pipeline.schedule != "custom" and (problems := schedule_rules(pipeline.schedule, pp, k, m)):
        raise InputError(f"run_schedule: {m} microbatches: " + "; ".join(problems))
    rows = None if pipeline.table is None else tuple(pipeline.table)
    calm_gloo_threads()  # any started since the last step (mesh.py)
    return _run(stage, _table(pipeline.schedule, rows, pp, k, m), inputs, targets, loss_fn, tokens)


@lru_cache(maxsize=64)
def _table(schedule: str, rows: tuple[str, ...] | None, pp: int, k: int, m: int):
    """The table a step runs, built and checked once per shape (a pure function of its arguments)."""
    table = plan_table(schedule, None if rows is None else list(rows), pp, k, m)
    problems = table_problems(table, pp, m, placement(schedule, pp, k))
    if problems:  # every rank holds the same table, so every rank refuses it alike
        raise InputError("the schedule cannot run: " + "; ".join(problems))
    return table


def _run(stage: Stage, table, inputs, targets, loss_fn: LossFn | None, tokens: int | None) -> torch.Tensor:
    step = StepState(stage, table, inputs, targets, loss_for(stage.logit_shard, loss_fn), tokens)
    row, finishers = table[stage.pp_rank], stage.grad_finish
    # The backwards that may reduce as they go: the row's last (no W after it), or every one.
    reducing = set()
    if not any(a.kind == "W" for a in row):
        backwards = [i for i, a in enumerate(row) if a.kind in ("B", "I")]
        reducing = set(backwards if stage.resolved.plan.data_parallel.reduce == "microbatch" else backwards[-1:])
    for finisher in finishers:
        finisher.begin()
    try:
        for i, action in enumerate(row):
            if i in reducing:
                for finisher in finishers:
                    finisher.next_backward_reduces()
            with doing(f"{action.kind}{action.mb} of stage {action.stage}"):
                step.run(action)
    finally:
        for finisher in finishers:
            finisher.end()
    step.finish()
    for finisher in finishers:
        with doing(finisher.doing):
            finisher.finish()
    # The step's loss on every rank: the shares of the last stage's first tp rank of every replica and cp rank.
    losses, mesh = [step.losses[i] for i in sorted(step.losses)], stage.mesh
    total = torch.zeros((), device=stage.device, dtype=torch.float32)
    if mesh.rank == mesh.rank_at(pp=stage.stage_rank[-1], tp=0) and losses:  # one contribution per replica, cp rank
        total += torch.stack([l.detach() for l in losses]).sum().to(device=stage.device, dtype=torch.float32)
    with doing("the step loss's all-reduce over every rank"):
        dist.all_reduce(total)  # one collective on the whole world, every replica at once
    lend(total)  # callers keep the loss: hand them a copy
    return total.clone()
