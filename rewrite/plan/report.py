"""Plain-text tables of a resolved plan: what `rewrite show` prints.

Three tables: module path -> style -> per-rank shapes; stages -> ranks, share of compute,
modules; parameters and memory per rank (summed over the stages it holds, divided over dp
as `rewrite.plan.memory` works out); and the schedule. Aligned columns, no dependency.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .memory import MEMORY_HEADER, SHARDINGS, format_bytes, memory_rows, rank_footprints
from .resolve import ResolvedPlan
from .schedules import Table, peak_in_flight, placement, plan_table, simulate, splits_backward
from .schema import ParallelPlan

__all__ = [
    "format_table", "format_bytes", "format_plan", "format_schedule", "shard_rows", "stage_rows", "rank_rows",
    "memory_rows", "MEMORY_HEADER",
]


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, indent: str = "  ") -> str:
    """Left-aligned columns, two spaces apart, with a dashed rule under the header.

    Example:
        >>> print(format_table(["a", "bb"], [[1, 2]]))
          a  bb
          -  --
          1  2
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    rule = ["-" * w for w in widths]
    lines = [cells[0], rule, *cells[1:]]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _shape(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def _layer_order(fqn: str) -> tuple[float, ...]:
    # Layer by layer (the plan's rule order within a layer); unnumbered modules such as lm_head last.
    numbers = tuple(float(p) for p in fqn.split(".") if p.isdigit())
    return numbers or (float("inf"),)


def shard_rows(resolved: ResolvedPlan) -> list[list[str]]:
    """One row per rewritten module, layer by layer: path, style, the plan rule, weight and bias shape on each tp rank."""
    shards = sorted(resolved.shards, key=lambda s: _layer_order(s.fqn))
    return [[s.fqn, s.style, s.pattern, _shape(s.weight_shape), _shape(s.bias_shape)] for s in shards]


def _global_rank(resolved: ResolvedPlan, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> int:
    # rewrite.mesh: tp innermost (neighbours on one machine), dp outermost (across machines).
    return (dp_rank * resolved.pp + pp_rank) * resolved.tp + tp_rank


def _ranks_of(resolved: ResolvedPlan, stage_idx: int) -> list[int]:
    # The tp ranks of replica 0 holding the stage; the pp rank from its placement.
    pp_rank = resolved.stage_rank[stage_idx]
    return [_global_rank(resolved, pp_rank, t) for t in range(resolved.tp)]


def stage_rows(resolved: ResolvedPlan) -> list[list[str]]:
    """One row per pipeline stage: index, global ranks (replica 0's), share of the estimated compute, modules.

    The share is `-` where there is no estimate (torch.fx stages).
    """
    return [
        [
            str(s.stage_idx),
            ",".join(map(str, _ranks_of(resolved, s.stage_idx))),
            "-" if s.est_compute is None else f"{s.est_compute:.0%}",
            ", ".join(s.modules),
        ]
        for s in resolved.stages
    ]


def _held(resolved: ResolvedPlan, pp_rank: int) -> str:
    return ",".join(str(s) for s in resolved.rank_stages(pp_rank))


def rank_rows(resolved: ResolvedPlan, model: nn.Module | None = None) -> list[list[str]]:
    """One row per global rank: the stages it holds, tp rank, parameters and their memory.

    A rank holding several stages (pipeline.virtual_stages) adds them up. The training
    column counts weights + gradients (the parameters' dtype) + AdamW's two moments in
    float32, between steps, under the plan's data-parallel sharding (mesh.dp > 1 needs
    `model`: see `rewrite.plan.memory.rank_footprints`).
    """
    feet, rows = rank_footprints(resolved, model), []
    for d in range(resolved.plan.mesh.dp):
        for pp_rank, foot in enumerate(feet):
            for t in range(resolved.tp):
                rank = _global_rank(resolved, pp_rank, t, d)
                rows.append([str(rank), _held(resolved, pp_rank), str(t), f"{foot.params:,}",
                             format_bytes(foot.weights), format_bytes(foot.at_rest)])
    return rows


def _span(lo: int, hi: int, word: str = "rank") -> str:
    return f"{word} {lo}" if lo == hi else f"{word}s {lo}-{hi}"


_MODES = {
    "full": "each rank holds 1/dp of every parameter, gradient and AdamW moment (ZeRO-3; dim 0 padded "
    "to a multiple of dp), a layer gathered for each use and let go after it",
    "grad_op": "each rank holds 1/dp of every parameter, gradient and AdamW moment (dim 0 padded to a "
    "multiple of dp), a layer gathered from its first forward to the step's end",
    "replicate": "whole parameters, gradients and AdamW moments on every replica",
}


def _layout_lines(resolved: ResolvedPlan) -> list[str]:
    """The rank layout, and for dp > 1 the replicas and the sharding mode."""
    mesh, per = resolved.plan.mesh, resolved.pp * resolved.tp
    if mesh.dp == 1:
        return ["ranks: rank = pp_rank * tp + tp_rank (tp innermost: a stage's tp ranks are neighbours, on one machine)"]
    shown = list(range(mesh.dp)) if mesh.dp <= 4 else [0, 1, None, mesh.dp - 1]
    replicas = ", ".join("..." if d is None else f"{d}: {_span(d * per, d * per + per - 1)}" for d in shown)
    sharding, schedule = resolved.plan.data_parallel.sharding, resolved.plan.pipeline.schedule
    split = sharding == "full" and splits_backward(resolved.plan.pipeline)
    return [
        "ranks: rank = (dp_rank * pp + pp_rank) * tp + tp_rank (tp innermost: neighbours on one machine; "
        "dp outermost: replicas across machines)",
        f"replicas: {mesh.dp}, each a whole pipeline on its own microbatches ({replicas})",
        f"data parallel: sharding {sharding}: {_MODES[sharding]}"
        + (f"; schedule {schedule} splits backwards, so as under grad_op the layers stay gathered from "
           "forward to the step's end" if split else "")
        + "; gradients reduced once per step",
    ]


def _memory_lines(resolved: ResolvedPlan, model: nn.Module | None) -> list[str]:
    mesh = resolved.plan.mesh
    first = next(iter(model.parameters()), None) if model is not None else None
    dtype = "the parameters' dtype" if first is None else str(first.dtype).removeprefix("torch.")
    out = [
        f"Parameters and memory per rank: params held between steps; weights and grads in {dtype}, "
        "AdamW's 2 moments in float32",
        format_table(MEMORY_HEADER, memory_rows(resolved, model)),
    ]
    per = resolved.pp * resolved.tp
    if mesh.dp == 2:
        out.append(f"  {_span(per, 2 * per - 1)} (replica 1) hold the same as {_span(0, per - 1)}, rank for rank")
    elif mesh.dp > 2:
        out.append(f"  {_span(1, mesh.dp - 1, 'replica')} ({_span(per, mesh.dp * per - 1)}) hold the same as "
                   "replica 0, rank for rank")
    if mesh.dp == 1:
        out.append("  peak in step = weights + grads + AdamW (activations not counted)")
        return out
    out.append(
        "  peak in step = weights + AdamW held + parameters gathered (full: the largest layer or the root's "
        "embeddings/norm/head; grad_op, or full under a split schedule: all of the rank's, from forward to the "
        "step's end; replicate: a second whole copy) + the gradients accumulated whole until the step's one "
        "reduce; activations not counted"
    )
    feet = {m: max(rank_footprints(resolved, model, sharding=m), key=lambda f: f.peak) for m in SHARDINGS}
    rest = ", ".join(f"{m} {format_bytes(f.at_rest)}" for m, f in feet.items())
    peak = ", ".join(f"{m} {format_bytes(f.peak)}" for m, f in feet.items())
    out.append(f"  the fullest rank under each sharding, params + grads + AdamW: {rest}; peak in step: {peak}")
    return out


def format_plan(resolved: ResolvedPlan, *, model_label: str | None = None, model: nn.Module | None = None) -> str:
    """The three tables of `rewrite show`, with a heading, the rank layout and the sharding mode.

    Args:
        resolved: `rewrite.resolve(plan, model)`; a meta-device model is enough.
        model_label: how to name the model in the heading (e.g. the preset or path).
        model: the model it was resolved against; needed when mesh.dp > 1 (FSDP2 pads
            each parameter's dim 0 to a multiple of dp, which takes the shapes).

    Returns:
        Multi-line text, no trailing newline.

    Raises:
        ValueError: mesh.dp > 1 and no model.

    Example:
        >>> print(format_plan(rewrite.resolve("plans/llama-tp2.yaml", model), model=model))
    """
    plan, tp, pp = resolved.plan, resolved.tp, resolved.pp
    name = resolved.model_name + (f" ({model_label})" if model_label else "")
    pipe = plan.pipeline
    out = [
        f"{plan.source} on {name}",
        f"mesh: {plan.mesh.shape_text()} = {resolved.world_size} ranks; {pipe.microbatches} microbatch"
        f"{'es' if pipe.microbatches != 1 else ''} per step{' per replica' if plan.mesh.dp > 1 else ''}, "
        f"schedule {pipe.schedule}; {'module walker (hf)' if resolved.kind == 'hf' else 'torch.fx stages'}",
        *_layout_lines(resolved),
        "",
    ]
    if resolved.shards:
        out.append(
            f"Tensor parallel: {len(resolved.shards)} modules; shapes held by each of the {tp} tp rank"
            f"{'s' if tp != 1 else ''}" + (" (tp=1: nothing is split)" if tp == 1 else "")
        )
        out.append(format_table(["module", "style", "rule", "weight", "bias"], shard_rows(resolved)))
    else:
        out.append("Tensor parallel: no module is sharded")
    if resolved.recomputed:
        shown = ", ".join(resolved.recomputed[:4]) + (", ..." if len(resolved.recomputed) > 4 else "")
        out.append(
            f"Activation checkpointing: {len(resolved.recomputed)} modules keep only their inputs and run their "
            f"forward again in the backward ({shown})"
        )
    out.append("")
    cuts = f", cut at {', '.join(resolved.cut_points)}" if resolved.cut_points else ""
    how = " (auto)" if pipe.cut_points == "auto" else ""
    est = (
        f"; est. compute: training FLOPs per stage for {resolved.costs.seq_len}-token sequences "
        "(pipeline.seq_len)"
        if resolved.costs
        else ""
    )
    n, k = resolved.num_stages, pipe.virtual_stages
    per_rank = f" on {pp} rank{'s' if pp != 1 else ''} ({k} per rank, {'V' if pipe.schedule == 'zbv' else 'looped'})" if k > 1 else ""
    out.append(f"Pipeline: {n} stage{'s' if n != 1 else ''}{per_rank}{cuts}{how}{est}")
    ranks = "ranks (replica 0)" if plan.mesh.dp > 1 else "ranks"
    out.append(format_table(["stage", ranks, "est. compute", "modules"], stage_rows(resolved)))
    out.append("")
    out += _memory_lines(resolved, model)
    out.append(f"  whole model: {resolved.total_params:,} parameters, {format_bytes(resolved.total_bytes)}")
    return "\n".join(out)


def _costs(table: Table) -> str:
    split = {(a.mb, a.stage) for row in table for a in row if a.kind == "W"}
    backwards = {(a.mb, a.stage) for row in table for a in row if a.kind == "B"}
    if not split:
        return "F costs 1, B 2"
    if split == backwards:
        return "F costs 1, B 1 + W 1: the backward split into input and weight gradients"
    return "F costs 1, a whole B 2, a split one B 1 + W 1"


def format_schedule(plan: ParallelPlan, *, microbatches: int | None = None) -> str:
    """The plan's schedule table, one row per rank, with what it predicts on paper.

    Each row lists the rank's cells in order (`F3 B2 W2`; `F3@2` for stage 2 when ranks
    hold several stages), the most (mb, stage) pairs whose activations it holds at once,
    and its idle share. The bubble is the share of the step ranks idle when a forward
    costs 1, a backward 2 (or, split, B 1 and W 1) and transfers nothing: a lower bound
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
    busy_all = sum(end - start for start, end in times.values())
    bubble = 1 - busy_all / (pp * span) if span else 0.0
    has_w = any(a.kind == "W" for row in table for a in row)
    n = pp * k
    ranks = f", {k} on each of {pp} rank{'s' if pp != 1 else ''}" if k > 1 else ""
    words = f"F = forward, B = backward{', W = weight gradient' if has_w else ''} of a microbatch"
    return "\n".join([
        f"Schedule {pipe.schedule}: {m} microbatch{'es' if m != 1 else ''} on {n} stage{'s' if n != 1 else ''}{ranks} "
        f"({words}{'; F3@2: on stage 2' if k > 1 else ''})",
        format_table(["rank", "actions, in order", "alive at most", "idle"], rows),
        f"  predicted bubble: {bubble:.0%} of the step ({_costs(table)}; transfers free)",
    ])
