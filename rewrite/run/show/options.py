"""The `rewrite show` table of tensor-parallel options: parameters and estimated activations per
rank as planned and with vocab + loss_parallel, sequence_parallel and activation checkpointing
each flipped (`rewrite.estimate.activations` estimates, `rewrite.estimate.memory` parameters).
"""

from __future__ import annotations

from torch import nn

from ...estimate.activations import activation_problem, rank_activations
from ...estimate.memory import rank_footprints, with_run
from ...binding.resolve import ResolvedPlan, resolve
from ...plan.loading import load_plan
from ...plan.schema import PlanError
from ...plan.patterns import match_pattern
from .columns import format_bytes, format_table
from .memory import UNCOUNTED

__all__ = ["option_variants", "option_rows", "format_options"]


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


def _busiest(resolved: ResolvedPlan, model: nn.Module, batch_size: int = 1) -> tuple[int, int, int]:
    """(pp rank, parameter bytes, activation bytes) of the pp rank with the most of both together."""
    weights = [f.weights for f in rank_footprints(resolved, model)]
    acts = [a.peak for a in rank_activations(resolved, model, batch_size=batch_size)]
    r = max(range(resolved.pp), key=lambda i: (weights[i] + acts[i], -i))
    return r, weights[r], acts[r]


def option_rows(resolved: ResolvedPlan, model: nn.Module, batch_size: int = 1) -> tuple[list[list[str]], list[str]]:
    """The tensor-parallel options table of `rewrite show`, and a line per variant left out.

    One row for the plan, then one per option flipped (`activations.option_variants`):
    the busiest rank's global rank (replica 0, tp rank 0; its tp ranks hold the same),
    its parameter bytes (weights, after tp and dp sharding), its estimated activation
    bytes (`activations.rank_activations`), and both as a multiple of the plan's.
    """
    variants, skipped = option_variants(resolved, model)
    base = _busiest(resolved, model, batch_size)
    rows = []
    for label, variant in [("as planned", resolved), *variants]:
        r, params, acts = _busiest(variant, model, batch_size)
        rows.append([label, str(r * variant.tp), format_bytes(params), format_bytes(acts),
                     f"{params / base[1]:.2f}x" if base[1] else "-", f"{acts / base[2]:.2f}x" if base[2] else "-"])
    return rows, [f"  not shown: {label}: {why}" for label, why in skipped]


def format_options(resolved: ResolvedPlan, model: nn.Module, *, batch_size: int = 1, seq_len: int | None = None,
                   microbatches: int | None = None) -> str:
    """The table `rewrite show` prints after `render_text`: parameters and estimated activations per rank,
    as planned and with each tensor-parallel option flipped (`option_rows`), for the same run as its memory
    table (`batch_size` sequences per microbatch; seq_len, microbatches: override the plan's).

    Empty when nothing is to compare: mesh.tp = 1 and the plan sets none of loss_parallel,
    sequence_parallel, activation_checkpointing; or activations not estimated (`activation_problem`).

    Example:
        >>> print(format_options(rewrite.resolve("plans/llama-tp2-sp.yaml", model), model))
    """
    plan = resolved.plan
    wanted = resolved.tp > 1 or plan.loss_parallel or plan.sequence_parallel or plan.activation_checkpointing
    if not wanted or activation_problem(resolved, model) is not None:
        return ""
    resolved = with_run(resolved, seq_len=seq_len, microbatches=microbatches)  # the variants inherit the run
    rows, notes = option_rows(resolved, model, batch_size)
    pipe = resolved.plan.pipeline
    return "\n".join([
        "Tensor-parallel options (per rank, estimated): the busiest rank's parameters (weights) and the activations "
        "it keeps for the backward",
        format_table(["plan", "rank", "parameters", "activations", "params vs planned", "acts vs planned"], rows),
        *notes,
        f"  rank: global rank, replica 0, tp rank 0 (its tp ranks hold the same); activations for "
        f"{batch_size} sequence{'s' if batch_size != 1 else ''} of {pipe.seq_len} tokens"
        f"{'' if seq_len else ' (pipeline.seq_len)'} per microbatch, {pipe.microbatches} microbatch"
        f"{'es' if pipe.microbatches != 1 else ''} under {pipe.schedule}, as in the memory table; {UNCOUNTED}",
    ])
