"""Plain-text tables of a resolved plan: what `rewrite show` prints.

Three tables: module path -> style -> per-rank shapes; stages -> ranks, share of compute,
modules; parameters and memory per rank (summed over the stages it holds, divided over dp
as `rewrite.plan.memory` works out); and the schedule. Aligned columns, no dependency.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from torch import nn

from .memory import MEMORY_HEADER, format_bytes, memory_rows, rank_footprints, rank_memory
from .resolve import ResolvedPlan
from .schedules import Table, peak_in_flight, placement, plan_table, simulate, splits_backward
from .schema import ParallelPlan
from .show_json import collapse_names, memory_notes, memory_table, span, stage_entries, tp_entries

__all__ = [
    "format_table", "format_bytes", "format_plan", "format_schedule", "shard_rows", "stage_rows", "rank_rows",
    "memory_rows", "memory_table", "MEMORY_HEADER", "WIDTH", "wrap_list", "wrap_prose",
]

WIDTH = 100  # columns that prose and the stage table's module lists wrap at


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, indent: str = "  ") -> str:
    """Left-aligned columns, two spaces apart, with a dashed rule under the header.

    A cell holding newlines continues on the lines below, the other columns left blank.

    Example:
        >>> print(format_table(["a", "bb"], [[1, 2]]))
          a  bb
          -  --
          1  2
    """
    lines = [[str(c) for c in header]]
    for row in rows:
        cells = [str(c).split("\n") for c in row]
        lines += [[c[i] if i < len(c) else "" for c in cells] for i in range(max(len(c) for c in cells))]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    lines.insert(1, ["-" * w for w in widths])
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def wrap_list(items: Sequence[str], width: int, *, sep: str = ",") -> str:
    """`a, b, c` broken after a comma (`sep`) into lines of at most `width` characters (a longer item stays whole).

    Example:
        >>> wrap_list(["model.embed_tokens", "model.layers.0-7", "model.norm"], 40)
        'model.embed_tokens, model.layers.0-7,\nmodel.norm'
    """
    lines = [""]
    for i, item in enumerate(items):
        piece = item + (sep if i < len(items) - 1 else "")
        if lines[-1] and len(lines[-1]) + 1 + len(piece) > width:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}" if lines[-1] else piece
    return "\n".join(lines)


def wrap_prose(text: str, width: int = WIDTH) -> str:
    """Lines of prose longer than `width` wrapped, continuing 2 spaces deeper; table rows (a double space
    between words) are left as they are."""
    out = []
    for line in text.split("\n"):
        body = line.lstrip(" ")
        if len(line) <= width or "  " in body:
            out.append(line)
            continue
        lead = line[: len(line) - len(body)]
        out += textwrap.wrap(body, width, initial_indent=lead, subsequent_indent=lead + "  ",
                             break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


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


def _global_rank(resolved: ResolvedPlan, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> int:
    # rewrite.mesh: tp innermost (neighbours on one machine), dp outermost (across machines).
    return (dp_rank * resolved.pp + pp_rank) * resolved.tp + tp_rank


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
