"""What `rewrite show` shows, before layout: collapsed tensor-parallel rows, stages, memory per rank.

`show_data` returns it as a dict of lists and numbers (bytes), ready for `json.dumps`;
`memory_table` and `memory_notes` give the memory section's cells and lines, and
`rewrite.run.show.report` lays everything out as text. Layers that differ only in their
index become one entry named with the index ranges: `model.layers.0-31.mlp.up_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from torch import nn

from ...estimate.memory import GIB, SHARDINGS, RankMemory, rank_footprints, rank_memory
from ...plan.resolve import ResolvedPlan
from .columns import format_bytes

__all__ = [
    "index_ranges", "collapse_names", "tp_entries", "stage_entries", "show_data", "memory_table", "memory_notes", "span",
]

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")  # a whole dotted segment that is a number


def index_ranges(indices: Iterable[int], *, sep: str = ", ") -> str:
    """Sorted numbers as compact ranges.

    Example:
        >>> index_ranges([11, 0, 1, 2, 3, 8, 9, 10])
        '0-3, 8-11'
        >>> index_ranges([9, 10, 5])
        '5, 9-10'
    """
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return sep.join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def _split(fqn: str) -> tuple[str, int | None]:
    # The path with its first numeric segment (the layer index) replaced by "\0", and that index.
    match = _INDEX.search(fqn)
    if match is None:
        return fqn, None
    return fqn[: match.start()] + "\0" + fqn[match.end() :], int(match.group(0))


def _name(template: str, indices: Sequence[int]) -> str:
    if "\0" not in template:
        return template
    ranges = index_ranges(indices)
    return template.replace("\0", ranges if "," not in ranges else "{" + ranges + "}")


def collapse_names(names: Iterable[str]) -> list[str]:
    """Paths that differ only in one index as one path with the index ranges, in order of first appearance.

    Non-contiguous indices are braced: `model.layers.{0-3, 8-11}.mlp`.

    Example:
        >>> collapse_names(["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"])
        ['model.embed_tokens', 'model.layers.0-1', 'model.norm']
    """
    groups: dict[str, list[int]] = {}
    for name in names:
        template, index = _split(name)
        groups.setdefault(template, [])
        if index is not None:
            groups[template].append(index)
    return [_name(template, indices) for template, indices in groups.items()]


def _whole_shape(model: nn.Module | None, fqn: str, leaf: str) -> list[int] | None:
    if model is None:
        return None
    try:
        param = getattr(model.get_submodule(fqn), leaf, None)
    except AttributeError:
        return None
    return list(param.shape) if param is not None else None


def tp_entries(resolved: ResolvedPlan, model: nn.Module | None = None) -> list[dict]:
    """The tensor-parallel table, modules that differ only in a layer index collapsed into one entry.

    Each entry: module (with index ranges), layers (the indices; [] for an unnumbered module),
    style, rule, and weight / bias shapes whole and on each tp rank (None: no such parameter;
    whole shapes need `model`). Entries keep the order of their first module, layer by layer.

    Example:
        >>> tp_entries(rewrite.resolve("plans/llama-tp2.yaml", model), model)[0]["module"]
        'model.layers.0-3.self_attn.q_proj'
    """
    def order(fqn: str) -> tuple[float, ...]:
        return tuple(float(p) for p in fqn.split(".") if p.isdigit()) or (float("inf"),)

    groups: dict[tuple, dict] = {}
    for s in sorted(resolved.shards, key=lambda s: order(s.fqn)):
        template, index = _split(s.fqn)
        weight, bias = _whole_shape(model, s.fqn, "weight"), _whole_shape(model, s.fqn, "bias")
        per_weight = list(s.weight_shape) if s.weight_shape is not None else weight
        per_bias = list(s.bias_shape) if s.bias_shape is not None else bias
        key = (template, s.style, s.pattern, str(weight), str(per_weight), str(bias), str(per_bias))
        entry = groups.setdefault(key, {
            "template": template, "layers": [], "style": s.style, "rule": s.pattern, "weight": weight,
            "weight_per_rank": per_weight, "bias": bias, "bias_per_rank": per_bias,
        })
        if index is not None:
            entry["layers"].append(index)
    out = []
    for entry in groups.values():
        template = entry.pop("template")
        entry["layers"].sort()
        out.append({"module": _name(template, entry["layers"]), **entry})
    return out


def stage_entries(resolved: ResolvedPlan) -> list[dict]:
    """One entry per pipeline stage: index, pp rank, global ranks (replica 0), compute share, modules.

    `modules` collapses the decoder layers (`model.layers.0-7`); `layers` lists their indices
    ([] for a torch.fx split).
    """
    out = []
    for s in resolved.stages:
        pp_rank = resolved.stage_rank[s.stage_idx]
        layers = resolved.layer_indices[s.stage_idx] if resolved.layer_indices else ()
        out.append({
            "stage": s.stage_idx,
            "pp_rank": pp_rank,
            "ranks": [resolved.plan.mesh.global_rank(pp_rank, t) for t in range(resolved.tp)],
            "est_compute": s.est_compute,
            "modules": collapse_names(s.modules),
            "layers": list(layers),
            "params_per_rank": s.param_count,
            "param_bytes_per_rank": s.param_bytes,
        })
    return out


def _memory_entry(m: RankMemory, limit: float | None) -> dict:
    return {
        "rank": m.rank, "pp_rank": m.pp_rank, "tp_rank": m.tp_rank, "stages": list(m.stages), "params": m.params,
        "weights": m.weights, "grads": m.grads, "adamw": m.adamw, "gathered": m.gathered,
        "activations": m.activations, "microbatches_alive": m.in_flight, "total": m.total, "fits": m.fits(limit),
    }


def show_data(
    resolved: ResolvedPlan,
    model: nn.Module | None = None,
    *,
    model_label: str | None = None,
    batch_size: int = 1,
    seq_len: int | None = None,
    microbatches: int | None = None,
    memory_limit: float | None = None,
    warnings: Sequence[str] | None = None,
) -> dict:
    """What `rewrite show` prints, as data: `rewrite show --json` prints this dict.

    Args:
        resolved: `rewrite.resolve(plan, model)`; a meta-device model is enough.
        model: the model it was resolved against: whole shapes, activations, dp padding.
        model_label: how the model was named (a preset or a path).
        batch_size: sequences per microbatch; seq_len, microbatches: override the plan's.
        memory_limit: GiB per rank; each rank's `fits` says whether its total is within it.
        warnings: lines to pass on (e.g. from a stage-balance check).

    Returns:
        {"plan", "model", "mesh", "pipeline", "tensor_parallel", "stages", "memory",
        "whole_model", "warnings"}; memory sizes are bytes, replica 0's ranks (the other
        replicas hold the same).

    Example:
        >>> data = show_data(rewrite.resolve("plans/llama-tp2-pp2.yaml", model), model, memory_limit=40)
        >>> [r["total"] for r in data["memory"]["ranks"]]
    """
    plan, pipe = resolved.plan, resolved.plan.pipeline
    limit = None if memory_limit is None else memory_limit * GIB
    ranks = rank_memory(resolved, model, batch_size=batch_size, seq_len=seq_len, microbatches=microbatches)
    first = next(iter(model.parameters()), None) if model is not None else None
    return {
        "plan": plan.source,
        "description": plan.description,
        "model": {"name": resolved.model_name, "label": model_label},
        "mesh": {"dp": plan.mesh.dp, "pp": plan.mesh.pp, "tp": plan.mesh.tp, "world_size": resolved.world_size},
        "pipeline": {
            "schedule": pipe.schedule, "microbatches": microbatches or pipe.microbatches,
            "virtual_stages": pipe.virtual_stages, "seq_len": seq_len or pipe.seq_len, "batch_size": batch_size,
            "cut_points": list(resolved.cut_points), "kind": resolved.kind,
        },
        "data_parallel": {"sharding": plan.data_parallel.sharding},
        "tensor_parallel": tp_entries(resolved, model),
        "recomputed": collapse_names(resolved.recomputed),
        "stages": stage_entries(resolved),
        "memory": {
            "dtype": None if first is None else str(first.dtype).removeprefix("torch."),
            "optimizer": "AdamW, 2 moments in float32",
            "limit_bytes": limit,
            "not_fitting": sum(1 for m in ranks if m.fits(limit) is False),
            "ranks": [_memory_entry(m, limit) for m in ranks],
        },
        "whole_model": {"params": resolved.total_params, "bytes": resolved.total_bytes},
        "warnings": list(warnings or []),
    }


def span(lo: int, hi: int, word: str = "rank") -> str:
    """`rank 3`, or `ranks 4-7`."""
    return f"{word} {lo}" if lo == hi else f"{word}s {lo}-{hi}"


def _gib(limit: float) -> str:
    return f"{limit:g} GiB"


def memory_table(ranks: Sequence[RankMemory], *, memory_limit: float | None = None) -> tuple[list[str], list[list[str]]]:
    """The cells of the per-rank memory table of `rewrite show`: (header, rows), from `rank_memory`.

    Columns: rank, stages, tp_rank, params (elements), weights, grads, AdamW, gathered (only
    when a rank gathers: mesh.dp > 1), activations (`-`: not estimated), total, and fits (only
    with `memory_limit`, GiB): `yes`, or `no (42.4 GiB > 40 GiB)`.
    """
    dp = any(m.gathered for m in ranks)
    header = ["rank", "stages", "tp_rank", "params", "weights", "grads", "AdamW", *(["gathered"] if dp else []),
              "activations", "total", *(["fits"] if memory_limit is not None else [])]
    rows = []
    for m in ranks:
        row = [str(m.rank), ",".join(map(str, m.stages)), str(m.tp_rank), f"{m.params:,}",
               *(format_bytes(n) for n in (m.weights, m.grads, m.adamw)), *([format_bytes(m.gathered)] if dp else []),
               "-" if m.activations is None else format_bytes(m.activations), format_bytes(m.total)]
        if memory_limit is not None:
            row.append("yes" if m.fits(memory_limit * GIB) else f"no ({format_bytes(m.total)} > {_gib(memory_limit)})")
        rows.append(row)
    return header, rows


def memory_notes(
    resolved: ResolvedPlan, model: nn.Module | None, ranks: Sequence[RankMemory], *, batch_size: int = 1,
    seq_len: int | None = None, microbatches: int | None = None, memory_limit: float | None = None,
) -> list[str]:
    """The lines under the memory table: other replicas, the activations' settings, what total adds up,
    and with `memory_limit` how many ranks do not fit."""
    mesh, pipe, out = resolved.plan.mesh, resolved.plan.pipeline, []
    per = resolved.pp * resolved.tp
    if mesh.dp == 2:
        out.append(f"  {span(per, 2 * per - 1)} (replica 1) hold the same as {span(0, per - 1)}, rank for rank")
    elif mesh.dp > 2:
        out.append(f"  {span(1, mesh.dp - 1, 'replica')} ({span(per, mesh.dp * per - 1)}) hold the same as "
                   "replica 0, rank for rank")
    s, m = seq_len or pipe.seq_len, microbatches or pipe.microbatches
    if ranks and ranks[0].activations is not None:
        alive = ", ".join(f"rank {r.rank}: {r.in_flight}" for r in ranks if r.tp_rank == 0)
        out.append(
            f"  activations: {batch_size} sequence{'s' if batch_size != 1 else ''} of {s} tokens per microbatch, "
            f"{m} microbatch{'es' if m != 1 else ''} under {pipe.schedule} (microbatch-stages alive at most: {alive}); "
            "SDPA attention, transient buffers not counted (rewrite.estimate.activations)"
        )
    else:
        out.append("  activations: not estimated (a Hugging Face LLaMA-family model split by the module walker "
                   "is needed, and the model itself)")
    if mesh.dp == 1:
        out.append("  total = weights + grads + AdamW + activations")
    else:
        out.append(
            "  total = weights + grads + AdamW + gathered + activations; gathered: what a step adds, parameters "
            "gathered (full: the largest layer or the root's embeddings/norm/head; grad_op, or full under a split "
            "schedule: all of the rank's, from forward to the step's end; replicate: a second whole copy) and the "
            "gradients accumulated whole until the step's one reduce, less the sharded grads they replace"
        )
        feet = {m: max(rank_footprints(resolved, model, sharding=m), key=lambda f: f.peak) for m in SHARDINGS}
        rest = ", ".join(f"{m} {format_bytes(f.at_rest)}" for m, f in feet.items())
        peak = ", ".join(f"{m} {format_bytes(f.peak)}" for m, f in feet.items())
        out.append(f"  the fullest rank under each sharding, params + grads + AdamW: {rest}; peak in step: {peak}")
    if memory_limit is not None:
        over = [r for r in ranks if not r.fits(memory_limit * GIB)]
        each = " of each replica" if mesh.dp > 1 else ""
        if over:
            out.append(f"  {len(over)} of {len(ranks)} ranks{each} do not fit in {_gib(memory_limit)} (ranks "
                       f"{index_ranges(r.rank for r in over)}; the largest total {format_bytes(max(r.total for r in over))})")
        else:
            out.append(f"  all {len(ranks)} ranks{each} fit in {_gib(memory_limit)}")
    return out
