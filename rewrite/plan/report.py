"""Plain-text tables of a resolved plan: what `rewrite show` prints.

Three tables: module path -> style -> per-rank shapes; stages -> ranks, share of compute,
modules; parameters and memory per rank (summed over the stages it holds). And the schedule. Aligned columns, no dependency.
"""

from __future__ import annotations

from collections.abc import Sequence

from .resolve import ResolvedPlan
from .schedules import Table, peak_in_flight, placement, plan_table, simulate
from .schema import ParallelPlan

__all__ = ["format_table", "format_bytes", "format_plan", "format_schedule", "shard_rows", "stage_rows", "rank_rows"]


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


def format_bytes(n: int) -> str:
    """`1536` -> `'1.5 KiB'`."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


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


def _ranks_of(resolved: ResolvedPlan, stage_idx: int) -> list[int]:
    # Global rank = pp_rank * tp + tp_rank (rewrite.mesh); the pp rank holding the stage from its placement.
    pp_rank = resolved.stage_rank[stage_idx]
    return [pp_rank * resolved.tp + t for t in range(resolved.tp)]


def stage_rows(resolved: ResolvedPlan) -> list[list[str]]:
    """One row per pipeline stage: index, global ranks, share of the estimated compute, modules in order.

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


def rank_rows(resolved: ResolvedPlan) -> list[list[str]]:
    """One row per global rank: the stages it holds, tp rank, parameters and their memory.

    A rank holding several stages (pipeline.virtual_stages) adds them up. The training
    column counts weights + gradients (the parameters' dtype) + AdamW's two moments
    kept in float32: 2 * bytes + 8 * count.
    """
    rows = []
    for pp_rank in range(resolved.pp):
        stages = [resolved.stages[s] for s in resolved.rank_stages(pp_rank)]
        count, nbytes = sum(s.param_count for s in stages), sum(s.param_bytes for s in stages)
        held = ",".join(str(s.stage_idx) for s in stages)
        for t in range(resolved.tp):
            rank = pp_rank * resolved.tp + t
            rows.append([str(rank), held, str(t), f"{count:,}", format_bytes(nbytes), format_bytes(2 * nbytes + 8 * count)])
    return rows


def format_plan(resolved: ResolvedPlan, *, model_label: str | None = None) -> str:
    """The three tables of `rewrite show`, with a heading line.

    Args:
        resolved: `rewrite.resolve(plan, model)`; a meta-device model is enough.
        model_label: how to name the model in the heading (e.g. the preset or path).

    Returns:
        Multi-line text, no trailing newline.

    Example:
        >>> print(format_plan(rewrite.resolve("plans/llama-tp2.yaml", model)))
    """
    plan, tp, pp = resolved.plan, resolved.tp, resolved.pp
    model = resolved.model_name + (f" ({model_label})" if model_label else "")
    pipe = plan.pipeline
    out = [
        f"{plan.source} on {model}",
        f"mesh: pp={pp} x tp={tp} = {resolved.world_size} ranks; {pipe.microbatches} microbatch"
        f"{'es' if pipe.microbatches != 1 else ''} per step, schedule {pipe.schedule}; "
        f"{'module walker (hf)' if resolved.kind == 'hf' else 'torch.fx stages'}",
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
    out.append(format_table(["stage", "ranks", "est. compute", "modules"], stage_rows(resolved)))
    out.append("")
    out.append("Parameters and memory per rank (training = weights + grads + AdamW moments in fp32)")
    out.append(format_table(["rank", "stages", "tp_rank", "params", "weights", "training"], rank_rows(resolved)))
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
