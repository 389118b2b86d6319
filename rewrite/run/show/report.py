"""Plain-text tables of a resolved plan: what `rewrite show` prints.

Three tables: module path -> style -> per-rank shapes; stages -> ranks, share of compute,
modules; parameters and memory per rank (summed over the stages it holds, divided over dp
as `rewrite.estimate.memory` works out); and the schedule. Aligned columns, no dependency.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ...estimate.memory import rank_footprints, rank_memory
from ...plan.resolve import ResolvedPlan
from ...schedules import splits_backward
from .columns import WIDTH, format_bytes, format_table, wrap_list, wrap_prose
from .data import collapse_names, memory_notes, memory_table, span, stage_entries, tp_entries

__all__ = ["format_plan", "shard_rows", "stage_rows", "rank_rows"]

def _shape(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def _shapes(whole: Sequence[int] | None, per_rank: Sequence[int] | None) -> str:
    # `[4096, 4096] -> [2048, 4096]`: whole, then on each tp rank; one shape when they agree or whole is unknown.
    if whole is None or per_rank is None or list(whole) == list(per_rank):
        return _shape(per_rank if per_rank is not None else whole)
    return f"{_shape(whole)} -> {_shape(per_rank)}"


def shard_rows(resolved: ResolvedPlan, model: nn.Module | None = None) -> list[list[str]]:
    """The tensor-parallel table: modules that differ only in a layer index as one row
    (`model.layers.0-31.mlp.up_proj`), with style, weight and bias (whole -> per tp rank), rule."""
    return [
        [e["module"], e["style"], _shapes(e["weight"], e["weight_per_rank"]), _shapes(e["bias"], e["bias_per_rank"]), e["rule"]]
        for e in tp_entries(resolved, model)
    ]


def stage_rows(resolved: ResolvedPlan, *, width: int | None = None) -> list[list[str]]:
    """One row per pipeline stage: index, global ranks (replica 0's), share of the estimated compute, modules.

    Decoder layers are collapsed (`model.layers.0-7`); with `width`, the modules wrap onto
    lines of at most that many characters. The share is `-` where there is no estimate (torch.fx stages).
    """
    rows = []
    for e in stage_entries(resolved):
        modules = ", ".join(e["modules"]) if width is None else wrap_list(e["modules"], width)
        share = "-" if e["est_compute"] is None else f"{e['est_compute']:.0%}"
        rows.append([str(e["stage"]), ",".join(map(str, e["ranks"])), share, modules])
    return rows


def _held(resolved: ResolvedPlan, pp_rank: int) -> str:
    return ",".join(str(s) for s in resolved.rank_stages(pp_rank))


def rank_rows(resolved: ResolvedPlan, model: nn.Module | None = None) -> list[list[str]]:
    """One row per global rank: the stages it holds, tp rank, parameters and their memory.

    A rank holding several stages (pipeline.virtual_stages) adds them up. The training
    column counts weights + gradients (the parameters' dtype) + AdamW's two moments in
    float32, between steps, under the plan's data-parallel sharding (mesh.dp > 1 needs
    `model`: see `rewrite.estimate.memory.rank_footprints`).
    """
    feet, rows = rank_footprints(resolved, model), []
    for d in range(resolved.plan.mesh.dp):
        for pp_rank, foot in enumerate(feet):
            for t in range(resolved.tp):
                rank = resolved.plan.mesh.global_rank(pp_rank, t, d)
                rows.append([str(rank), _held(resolved, pp_rank), str(t), f"{foot.params:,}",
                             format_bytes(foot.weights), format_bytes(foot.at_rest)])
    return rows


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
    replicas = ", ".join("..." if d is None else f"{d}: {span(d * per, d * per + per - 1)}" for d in shown)
    sharding, schedule = resolved.plan.data_parallel.sharding, resolved.plan.pipeline.schedule
    split = sharding == "full" and splits_backward(resolved.plan.pipeline.schedule, resolved.plan.pipeline.table)
    return [
        "ranks: rank = (dp_rank * pp + pp_rank) * tp + tp_rank (tp innermost: neighbours on one machine; "
        "dp outermost: replicas across machines)",
        f"replicas: {mesh.dp}, each a whole pipeline on its own microbatches ({replicas})",
        f"data parallel: sharding {sharding}: {_MODES[sharding]}"
        + (f"; schedule {schedule} splits backwards, so as under grad_op the layers stay gathered from "
           "forward to the step's end" if split else "")
        + "; gradients reduced once per step",
    ]


def _memory_lines(resolved: ResolvedPlan, model: nn.Module | None, **run) -> list[str]:
    first = next(iter(model.parameters()), None) if model is not None else None
    dtype = "the parameters' dtype" if first is None else str(first.dtype).removeprefix("torch.")
    limit = run.pop("memory_limit")
    ranks = rank_memory(resolved, model, **run)
    return [
        f"Memory per rank: params held between steps; weights, grads and activations in {dtype}, "
        "AdamW's 2 moments in float32",
        format_table(*memory_table(ranks, memory_limit=limit)),
        *memory_notes(resolved, model, ranks, memory_limit=limit, **run),
    ]


def format_plan(
    resolved: ResolvedPlan,
    *,
    model_label: str | None = None,
    model: nn.Module | None = None,
    batch_size: int = 1,
    seq_len: int | None = None,
    microbatches: int | None = None,
    memory_limit: float | None = None,
    warnings: Sequence[str] | None = None,
) -> str:
    """The tables of `rewrite show`, with a heading, the rank layout and the sharding mode.

    Args:
        resolved: `rewrite.resolve(plan, model)`; a meta-device model is enough.
        model_label: how to name the model in the heading (e.g. the preset or path).
        model: the model it was resolved against; needed when mesh.dp > 1 (FSDP2 pads
            each parameter's dim 0 to a multiple of dp, which takes the shapes), for the
            whole shapes of the tensor-parallel table and for the activations.
        batch_size: sequences per microbatch, for the activations.
        seq_len, microbatches: the activations' sequence length and microbatches, default
            pipeline.seq_len and pipeline.microbatches.
        memory_limit: GiB per rank: a `fits` column, and a line naming the ranks over it.
        warnings: lines printed under `Warnings:` at the end (e.g. a stage-balance check's).

    Returns:
        Multi-line text, no trailing newline, prose wrapped at `WIDTH` columns.

    Raises:
        ValueError: mesh.dp > 1 and no model; a run setting below 1.

    Example:
        >>> print(format_plan(rewrite.resolve("plans/llama-tp2.yaml", model), model=model, memory_limit=80))
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
        rows = shard_rows(resolved, model)
        out.append(
            f"Tensor parallel: {len(resolved.shards)} modules in {len(rows)} rows (layers alike in one); weight and "
            f"bias shapes whole -> on each of the {tp} tp rank{'s' if tp != 1 else ''}"
            + (" (tp=1: nothing is split)" if tp == 1 else "")
        )
        header = ["module", "style", "weight", "bias", "rule"]
        if all(r[3] == "-" for r in rows):  # no biases: no column for them
            header, rows = header[:3] + header[4:], [r[:3] + r[4:] for r in rows]
        out.append(format_table(header, rows))
    else:
        out.append("Tensor parallel: no module is sharded")
    if resolved.recomputed:
        out.append(
            f"Activation checkpointing: {len(resolved.recomputed)} modules keep only their inputs and run their "
            f"forward again in the backward ({', '.join(collapse_names(resolved.recomputed))})"
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
    header = ["stage", ranks, "est. compute", "modules"]
    lead = max(len(ranks), len(",".join(str(r) for r in range(tp)))) + len("stage") + len("est. compute") + 2 + 3 * 2
    out.append(format_table(header, stage_rows(resolved, width=max(40, WIDTH - lead))))
    out.append("")
    out += _memory_lines(resolved, model, batch_size=batch_size, seq_len=seq_len, microbatches=microbatches,
                         memory_limit=memory_limit)
    out.append(f"  whole model: {resolved.total_params:,} parameters, {format_bytes(resolved.total_bytes)}")
    if warnings:
        out += ["", "Warnings:", *(f"  - {w}" for w in warnings)]
    return wrap_prose("\n".join(out))
