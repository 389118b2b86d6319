"""The `rewrite show` table of tensor-parallel options: the busiest rank's weights and activations as
planned and with vocab + loss_parallel, sequence_parallel and activation checkpointing each flipped,
read from the memory table's estimate (`rewrite.estimate.memory.rank_memory`) for the same run.
"""

from __future__ import annotations

from torch import nn

from ...estimate.activations import activation_problem
from ...estimate.memory import RankMemory, rank_memory
from ...binding.resolve import ResolvedPlan, resolve
from ...plan.loading import load_plan
from ...plan.schema import PlanError
from ...plan.patterns import match_pattern
from .columns import format_bytes, format_table
from .memory import UNCOUNTED

__all__ = ["option_variants", "busiest", "option_memory", "option_rows", "format_options"]


def option_variants(
    resolved: ResolvedPlan, model: nn.Module
) -> tuple[list[tuple[str, ResolvedPlan]], list[tuple[str, str]]]:
    """The plan with each tensor-parallel option flipped, bound to the same model.

    Flips, one at a time: vocab + loss_parallel (the embedding as 'vocab' and the head as
    'column' with loss_parallel, or both whole without it); sequence_parallel;
    activation_checkpointing (every decoder layer, or none).

    Returns:
        (label, resolved variant) for each that binds, and (label, why not) for each that
        does not (the first problem `resolve` finds, or "tp=1" where splitting changes nothing).

    Example:
        >>> shown, skipped = option_variants(rewrite.resolve("plans/llama-tp2.yaml", model), model)
        >>> [label for label, _ in shown]
        ['vocab + loss_parallel on', 'sequence_parallel on', 'activation_checkpointing on (model.layers.*)']
    """
    bb, plan = resolved.backbone, resolved.plan
    if bb is None:
        return [], []
    data = plan.model_dump(mode="json", exclude_none=True)
    changes: list[tuple[str, dict | None]] = []
    embed, head = bb.embed, bb.head
    if resolved.tp == 1:
        changes.append(("vocab + loss_parallel, sequence_parallel", None))
    else:
        if head is not None:
            rules = {p: s for p, s in data["tensor_parallel"].items() if not (match_pattern(p, embed) or match_pattern(p, head))}
            on = not plan.loss_parallel
            if on:
                rules.update({embed: "vocab", head: "column"})
            changes.append((f"vocab + loss_parallel {'on' if on else 'off'}", {"tensor_parallel": rules, "loss_parallel": on}))
        on = not plan.sequence_parallel
        changes.append((f"sequence_parallel {'on' if on else 'off'}", {"sequence_parallel": on}))
    layers = f"{bb.layers}.*"
    on = not plan.activation_checkpointing
    changes.append((
        f"activation_checkpointing on ({layers})" if on else "activation_checkpointing off",
        {"activation_checkpointing": {layers: "full"} if on else {}},
    ))
    shown, skipped = [], []
    for label, update in changes:
        if update is None:
            skipped.append((label, "tp=1: nothing is split"))
            continue
        try:
            shown.append((label, resolve(load_plan({**data, **update}), model)))
        except PlanError as exc:
            skipped.append((label, exc.problems[0] if exc.problems else str(exc)))
    return shown, skipped


def busiest(resolved: ResolvedPlan, model: nn.Module, **run) -> RankMemory:
    """The memory table's busiest rank: the highest total of `rank_memory(resolved, model, **run)`, the lowest
    such global rank (so tp rank 0, cp rank 0 of its pp rank: they hold the same)."""
    return max(rank_memory(resolved, model, **run), key=lambda m: (m.total, -m.rank))


def option_memory(resolved: ResolvedPlan, model: nn.Module, **run
                  ) -> tuple[list[tuple[str, RankMemory]], list[tuple[str, str]]]:
    """(label, busiest rank's `RankMemory`) as planned and for each `option_variants` variant, and those left out.

    `run`: `rank_memory`'s batch_size, seq_len, microbatches and dtype, the same for every variant, so each
    row is the busiest rank of the memory table `rewrite show` prints for that variant's plan.
    """
    variants, skipped = option_variants(resolved, model)
    return [(label, busiest(v, model, **run)) for label, v in [("as planned", resolved), *variants]], skipped


def option_rows(resolved: ResolvedPlan, model: nn.Module, **run) -> tuple[list[list[str]], list[str]]:
    """The tensor-parallel options table of `rewrite show`, and a line per variant left out.

    One row for the plan, then one per option flipped (`option_memory`): the busiest rank's
    global rank (replica 0, tp rank 0; its tp ranks hold the same), its weights and its
    activations as the memory table counts them, and both as a multiple of the plan's.
    """
    found, skipped = option_memory(resolved, model, **run)
    base = found[0][1]
    rows = []
    for label, m in found:
        acts, base_acts = m.activations or 0, base.activations or 0
        rows.append([label, str(m.rank), format_bytes(m.weights), format_bytes(acts),
                     f"{m.weights / base.weights:.2f}x" if base.weights else "-",
                     f"{acts / base_acts:.2f}x" if base_acts else "-"])
    return rows, [f"  not shown: {label}: {why}" for label, why in skipped]


def format_options(resolved: ResolvedPlan, model: nn.Module, *, batch_size: int = 1, seq_len: int | None = None,
                   microbatches: int | None = None, dtype: str | None = None) -> str:
    """The table `rewrite show` prints after `render_text`: parameters and estimated activations per rank,
    as planned and with each tensor-parallel option flipped (`option_rows`), read from the memory table's
    estimate (`rank_memory`) for the same run: `batch_size` sequences per microbatch; seq_len,
    microbatches: override the plan's; dtype: the compute dtype (default the parameters').

    Empty when nothing is to compare: mesh.tp = 1 and the plan sets none of loss_parallel,
    sequence_parallel, activation_checkpointing; or activations not estimated (`activation_problem`).

    Example:
        >>> print(format_options(rewrite.resolve("plans/llama-tp2-sp.yaml", model), model, dtype="bfloat16"))
    """
    plan = resolved.plan
    wanted = resolved.tp > 1 or plan.loss_parallel or plan.sequence_parallel or plan.activation_checkpointing
    if not wanted or activation_problem(resolved, model) is not None:
        return ""
    rows, notes = option_rows(resolved, model, batch_size=batch_size, seq_len=seq_len, microbatches=microbatches,
                              dtype=dtype)
    pipe = plan.pipeline
    s, m = seq_len or pipe.seq_len, microbatches or pipe.microbatches
    return "\n".join([
        "Tensor-parallel options (per rank, estimated): the busiest rank's parameters (weights) and the activations "
        "it keeps for the backward",
        format_table(["plan", "rank", "parameters", "activations", "params vs planned", "acts vs planned"], rows),
        *notes,
        f"  rank: global rank, replica 0, tp rank 0 (its tp ranks hold the same), the one with the highest total in "
        f"the memory table of the row's plan; parameters and activations: its weights and activations there; "
        f"activations for {batch_size} sequence{'s' if batch_size != 1 else ''} of {s} tokens"
        f"{'' if seq_len else ' (pipeline.seq_len)'} per microbatch, {m} microbatch{'es' if m != 1 else ''} under "
        f"{pipe.schedule}, as in the memory table; "
        f"{UNCOUNTED}",
    ])
