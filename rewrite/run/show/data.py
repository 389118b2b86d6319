"""What `rewrite show` shows, before layout: collapsed tensor-parallel rows, stages, memory per rank.

`show_data` returns it as a dict of lists and numbers (bytes), ready for `json.dumps`: the one
place that works it out. `rewrite.run.show.report.render_text` lays the dict out as text. Layers
that differ only in their index become one entry named with the index ranges: `model.layers.0-31.mlp.up_proj`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ...estimate.activations import activation_problem
from ...estimate.hardware import load_hardware
from ...estimate.memory import GIB, SHARDINGS, RankMemory, rank_footprints, rank_memory, with_run
from ...estimate.step_time import predict_step
from ...binding.resolve import ResolvedPlan
from ...schedules import splits_backward
from .names import collapse_names, ranged_name, split_index

__all__ = ["tp_entries", "stage_entries", "show_data", "predicted"]

def _whole_shape(model: nn.Module | None, fqn: str, leaf: str) -> list[int] | None:
    if model is None:
        return None
    try:
        param = getattr(model.get_submodule(fqn), leaf, None)
    except AttributeError:  # a bare parameter a rule splits (attention sinks): its shape as the 'weight'
        param = dict(model.named_parameters()).get(fqn) if leaf == "weight" else None
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
        template, index = split_index(s.fqn)
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
        out.append({"module": ranged_name(template, entry["layers"]), **entry})
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
            "ranks": resolved.plan.mesh.shape.grid()[0, pp_rank].flatten().tolist(),  # (cp, tp) of replica 0
            "est_compute": s.est_compute,
            "modules": collapse_names(s.modules),
            "layers": list(layers),
            "params_per_rank": s.param_count,
            "param_bytes_per_rank": s.param_bytes,
        })
    return out


def _memory_entry(m: RankMemory, limit: float | None) -> dict:
    return {
        "rank": m.rank, "pp_rank": m.pp_rank, "cp_rank": m.cp_rank, "tp_rank": m.tp_rank, "stages": list(m.stages),
        "params": m.params,
        "weights": m.weights, "grads": m.grads, "adamw": m.adamw, "gathered": m.gathered,
        "activations": m.activations, "microbatches_alive": m.in_flight, "total": m.total, "fits": m.fits(limit),
    }


def _fullest(resolved: ResolvedPlan, model: nn.Module | None, dtype) -> dict | None:
    # Under each sharding mode, the fullest rank (the highest peak): bytes between steps and at the peak; only where
    # ranks share the parameters (dp replicas x cp ranks).
    if resolved.plan.mesh.dp * resolved.plan.mesh.cp == 1:
        return None
    feet = {m: max(rank_footprints(resolved, model, sharding=m, dtype=dtype), key=lambda f: f.peak) for m in SHARDINGS}
    return {m: {"at_rest": f.at_rest, "peak": f.peak} for m, f in feet.items()}


def show_data(
    resolved: ResolvedPlan,
    model: nn.Module | None = None,
    *,
    model_label: str | None = None,
    batch_size: int = 1,
    seq_len: int | None = None,
    microbatches: int | None = None,
    memory_limit: float | None = None,
    limit_source: str | None = None,
    warnings: Sequence[str] | None = None,
    hardware=None,
    gpus_per_node: int | None = None,
    dtype: str | None = None,
) -> dict:
    """What `rewrite show` prints, as data: `--json` prints this dict, `report.render_text` lays it out.

    Args:
        resolved: `rewrite.resolve(plan, model)`; a meta-device model is enough.
        model: the model it was resolved against: whole shapes, activations, dp padding.
        model_label: how the model was named (a preset or a path).
        batch_size: sequences per microbatch; seq_len, microbatches: override the plan's.
        memory_limit: GiB per rank; each rank's `fits` says whether its total is within it.
        limit_source: where that limit comes from, when a profile's (`Hardware.usable_text`).
        warnings: lines to pass on (e.g. from a stage-balance check).
        hardware: a profile, its name or file: adds `predicted` (`estimate.step_time`), with
            gpus_per_node devices per node (default the profile's).
        dtype: the compute dtype over the model's parameters (`apply_plan`'s compute_dtype);
            default the parameters'.

    Returns:
        {"plan", "description", "model", "mesh", "experts", "experts_over_tp", "pipeline", "data_parallel",
        "tensor_parallel", "kv_replicas", "sharded_modules", "recomputed", "recomputed_modules", "selective",
        "selective_modules", "stages", "memory", "whole_model", "warnings"}; `recomputed`: the modules checkpointed
        'full', `selective`: those checkpointed 'selective'; `experts`: the modules split over mesh.ep > 1, each {"module",
        "experts", "per_rank"}; `experts_over_tp`: those with each expert split over tp, each {"module",
        "experts", "features": {tensor: {"dim", "parts"}}}; memory sizes are bytes, replica 0's ranks (the other replicas hold
        the same); with `hardware` also "predicted": {"hardware", "step_s", "tokens_per_s" (per
        device), "mfu", "bubble", "pipeline_s", "dp_s", "optimizer_s", "sync_s"}, or {"hardware", "problem"}
        where the step is not timed. `kv_replicas`: tp ranks holding each kv head (tp / kv past the kv heads, else 1).
        `memory.activations_not_estimated` says why activations are None. `pipeline` holds the run's
        microbatches and seq_len, and under `planned` the plan's own microbatches and cut_points as
        written ("auto", a list, or None); `est_compute_seq_len` is the sequence length the stages' est_compute is for (None: no estimate). `memory.fullest`:
        under each data-parallel sharding, the fullest rank's bytes between steps and at its peak
        (None for mesh.dp = 1).

    Raises:
        ValueError: mesh.dp > 1 and no model; a run setting below 1.

    Example:
        >>> data = show_data(rewrite.resolve("plans/llama-tp2-pp2.yaml", model), model, memory_limit=40)
        >>> [r["total"] for r in data["memory"]["ranks"]]
    """
    plan = resolved.plan
    memory = _memory_section(resolved, model, batch_size=batch_size, seq_len=seq_len, microbatches=microbatches,
                             memory_limit=memory_limit, dtype=dtype)  # first: it refuses bad run settings
    memory["limit_source"] = limit_source
    out = {
        "plan": plan.source,
        "description": plan.description,
        "model": {"name": resolved.model_name, "label": model_label},
        "mesh": {"dp": plan.mesh.dp, "pp": plan.mesh.pp, "cp": plan.mesh.cp, "tp": plan.mesh.tp, "ep": plan.mesh.ep,
                 "world_size": resolved.world_size},
        "experts": [{"module": e.fqn, "experts": e.num_experts, "per_rank": e.local} for e in resolved.experts
                    if e.ep > 1],
        "experts_over_tp": [{"module": e.fqn, "experts": e.num_experts,
                             "features": {leaf: {"dim": dim, "parts": parts} for leaf, dim, parts in e.features}}
                            for e in resolved.experts if e.tp > 1],
        "pipeline": _pipeline_entry(resolved, batch_size=batch_size, seq_len=seq_len, microbatches=microbatches),
        "data_parallel": {"sharding": plan.data_parallel.sharding, "reduce": plan.data_parallel.reduce},
        "tensor_parallel": tp_entries(resolved, model),
        "kv_replicas": resolved.kv_replicas,
        "sharded_modules": len(resolved.shards),
        "recomputed": collapse_names([n for n in resolved.recomputed if n not in resolved.selective]),
        "recomputed_modules": len(resolved.recomputed) - len(resolved.selective),
        "selective": collapse_names(resolved.selective),
        "selective_modules": len(resolved.selective),
        "stages": stage_entries(resolved),
        "memory": memory,
        "whole_model": {"params": resolved.total_params, "bytes": resolved.total_bytes},
        "lora": _lora_entry(resolved, model),
        "compile": _compile_entry(resolved),
        "warnings": list(warnings or []),
    }
    if hardware is not None:
        out["predicted"] = predicted(resolved, model, hardware, batch_size=batch_size, seq_len=seq_len,
                                     microbatches=microbatches, gpus_per_node=gpus_per_node, dtype=dtype)
    return out


def _compile_entry(resolved: ResolvedPlan) -> dict | None:
    """What `compile` compiles, or None when the plan runs eagerly."""
    from ...compiled import block_paths

    options = resolved.plan.compile
    return None if options is None else {**options.model_dump(), "blocks": collapse_names(block_paths(resolved))}


def _lora_entry(resolved: ResolvedPlan, model: nn.Module | None) -> dict | None:
    """A LoRA plan's adapters: rank, scale, dropout, the adapted layers and (with the model) their parameters."""
    lora = resolved.plan.lora
    if lora is None:
        return None
    linears = [model.get_submodule(t) for t in resolved.lora_targets] if model is not None else []
    return {"rank": lora.rank, "scaling": lora.scaling, "dropout": lora.dropout,
            "targets": collapse_names(resolved.lora_targets), "layers": len(resolved.lora_targets),
            "params": sum(lora.rank * (m.in_features + m.out_features) for m in linears) if linears else None}


def _pipeline_entry(resolved: ResolvedPlan, *, batch_size: int, seq_len: int | None, microbatches: int | None) -> dict:
    """`show_data`'s "pipeline": the run's schedule, microbatches and sequence length, and the plan's own."""
    pipe = resolved.plan.pipeline
    return {
        "schedule": pipe.schedule, "microbatches": microbatches or pipe.microbatches,
        "virtual_stages": pipe.virtual_stages, "seq_len": seq_len or pipe.seq_len, "batch_size": batch_size,
        "cut_points": list(resolved.cut_points), "kind": resolved.kind,
        "planned": {"microbatches": pipe.microbatches, "cut_points": pipe.cut_points},
        "splits_backward": splits_backward(pipe.schedule, pipe.table),
        "est_compute_seq_len": resolved.costs.seq_len if resolved.costs else None,
    }


def _memory_section(resolved: ResolvedPlan, model: nn.Module | None, *, batch_size: int, seq_len: int | None,
                    microbatches: int | None, memory_limit: float | None, dtype: str | None) -> dict:
    """`show_data`'s "memory": every rank of replica 0, the limit and the fullest rank per sharding."""
    limit = None if memory_limit is None else memory_limit * GIB
    ranks = rank_memory(resolved, model, batch_size=batch_size, seq_len=seq_len, microbatches=microbatches,
                        dtype=dtype)
    first = next(iter(model.parameters()), None) if model is not None else None
    master = None if first is None else str(first.dtype).removeprefix("torch.")
    return {
        "dtype": master,
        "compute_dtype": dtype or master,
        "optimizer": "AdamW, 2 moments in float32",
        "limit_bytes": limit,
        "not_fitting": sum(1 for m in ranks if m.fits(limit) is False),
        "ranks": [_memory_entry(m, limit) for m in ranks],
        "fullest": _fullest(with_run(resolved, seq_len=seq_len, microbatches=microbatches), model, dtype),
        "activations_not_estimated": (
            "no model given" if model is None else activation_problem(resolved, model)
        ) if not ranks or ranks[0].activations is None else None,
    }


def predicted(resolved: ResolvedPlan, model: nn.Module | None, hardware, **run) -> dict:
    """`show_data`'s "predicted": the step-time model's figures on `hardware`, or why there are none."""
    hw = load_hardware(hardware)
    if model is None:
        return {"hardware": hw.name, "problem": "no model given"}
    try:
        return {"hardware": hw.name, **predict_step(resolved, model, hw, **run).as_dict()}
    except ValueError as exc:
        if activation_problem(resolved, model) is None:
            raise
        return {"hardware": hw.name, "problem": str(exc)}
