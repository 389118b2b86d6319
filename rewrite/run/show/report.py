"""Plain-text tables of a resolved plan: what `rewrite show` prints, laid out from `show_data`'s dict.

Three tables: module path -> style -> per-rank shapes; stages -> ranks, share of compute,
modules; parameters and memory per rank (`memory.py`). Aligned columns, no dependency.
`render_text(data)` reads only the dict; `format_plan(resolved, ...)` is both steps in one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ...plan.ranks import DIMS, Shape
from ...binding.resolve import ResolvedPlan
from ...plan.wording import plural
from .columns import WIDTH, format_bytes, format_table, span, wrap_list, wrap_prose
from .data import show_data
from .names import collapse_names
from .memory import memory_lines

__all__ = ["render_text", "format_plan", "shard_rows", "stage_rows", "prediction_line"]


def _shape(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def _shapes(whole: Sequence[int] | None, per_rank: Sequence[int] | None) -> str:
    # `[4096, 4096] -> [2048, 4096]`: whole, then on each tp rank; one shape when they agree or whole is unknown.
    if whole is None or per_rank is None or list(whole) == list(per_rank):
        return _shape(per_rank if per_rank is not None else whole)
    return f"{_shape(whole)} -> {_shape(per_rank)}"


def shard_rows(entries: Sequence[dict]) -> list[list[str]]:
    """The tensor-parallel table from `show_data(...)["tensor_parallel"]` (or `data.tp_entries`): one row
    per entry (`model.layers.0-31.mlp.up_proj`), with style, weight and bias (whole -> per tp rank), rule."""
    return [
        [e["module"], e["style"], _shapes(e["weight"], e["weight_per_rank"]), _shapes(e["bias"], e["bias_per_rank"]), e["rule"]]
        for e in entries
    ]


def stage_rows(entries: Sequence[dict], *, width: int | None = None) -> list[list[str]]:
    """One row per pipeline stage of `show_data(...)["stages"]` (or `data.stage_entries`): index, global
    ranks (replica 0's), share of the estimated compute, modules.

    Decoder layers are collapsed (`model.layers.0-7`); with `width`, the modules wrap onto
    lines of at most that many characters. The share is `-` where there is no estimate (torch.fx stages).
    """
    rows = []
    for e in entries:
        modules = ", ".join(e["modules"]) if width is None else wrap_list(e["modules"], width)
        share = "-" if e["est_compute"] is None else f"{e['est_compute']:.0%}"
        rows.append([str(e["stage"]), ",".join(map(str, e["ranks"])), share, modules])
    return rows


_MODES = {
    "full": "each rank holds 1/dp of every parameter, gradient and AdamW moment (ZeRO-3; dim 0 padded "
    "to a multiple of dp), a layer gathered for each use and let go after it",
    "grad_op": "each rank holds 1/dp of every parameter, gradient and AdamW moment (dim 0 padded to a "
    "multiple of dp), a layer gathered from its first forward to the step's end",
    "replicate": "whole parameters, gradients and AdamW moments on every replica",
}


def _layout_lines(data: dict) -> list[str]:
    """The rank layout; under cp the sequence's split; with ranks sharing the parameters (dp x cp > 1) the
    replicas and the sharding mode."""
    mesh, pipe = data["mesh"], data["pipeline"]
    dp, cp = mesh["dp"], mesh.get("cp", 1)
    per = mesh["pp"] * cp * mesh["tp"]
    if dp == 1 and cp == 1:
        return ["ranks: rank = pp_rank * tp + tp_rank (tp innermost: a stage's tp ranks are neighbours, on one machine)"]
    out = []
    if cp == 1:
        out.append("ranks: rank = (dp_rank * pp + pp_rank) * tp + tp_rank (tp innermost: neighbours on one machine; "
                   "dp outermost: replicas across machines)")
    else:
        s = pipe["seq_len"]
        out += [
            "ranks: rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank (tp innermost, then a stage's cp "
            "ranks: neighbours on one machine; dp outermost: replicas across machines)",
            f"context parallel: each of a stage's {cp} cp ranks holds {s // cp} of a sequence's {s} tokens (two chunks "
            f"of {s // (2 * cp)}, balanced for the causal mask); each layer all-gathers the whole sequence's keys and "
            "values over them; they hold the same parameters",
        ]
    if dp > 1:
        shown = list(range(dp)) if dp <= 4 else [0, 1, None, dp - 1]
        replicas = ", ".join("..." if d is None else f"{d}: {span(d * per, d * per + per - 1)}" for d in shown)
        out.append(f"replicas: {dp}, each a whole pipeline on its own microbatches ({replicas})")
    out += _expert_lines(data)
    sharding, schedule = data["data_parallel"]["sharding"], pipe["schedule"]
    split = sharding == "full" and pipe["splits_backward"]
    over = f" over the {dp * cp} ranks holding the same parameters (dp x cp; dp below counts them)" if cp > 1 else ""
    return out + [
        f"data parallel: sharding {sharding}{over}: {_MODES[sharding]}"
        + (f"; schedule {schedule} splits backwards, so as under grad_op the layers stay gathered from "
           "forward to the step's end" if split else "")
        + ("; gradients reduced as each microbatch's backward ends (data_parallel.reduce: microbatch)"
           if data["data_parallel"]["reduce"] == "microbatch" else "; gradients reduced once per step"),
    ]


def _expert_lines(data: dict) -> list[str]:
    """Under ep: which replicas split the experts, and how many each rank holds; experts split over tp: how."""
    ep, experts, over_tp = data["mesh"].get("ep", 1), data.get("experts") or [], data.get("experts_over_tp") or []
    if over_tp:
        cut = "; ".join(f"{leaf} along dim {f['dim']}" + (f" ({f['parts']} packed parts)" if f["parts"] > 1 else "")
                        for leaf, f in over_tp[0]["features"].items())
        return [f"experts split over tp: every tp rank holds 1/{data['mesh']['tp']} of each of the "
                f"{over_tp[0]['experts']} experts of {', '.join(collapse_names([e['module'] for e in over_tp]))} "
                f"({cut}); partial outputs summed over tp"]
    if ep == 1 or not experts:
        return []
    tp = data["mesh"]["tp"]
    groups = data["mesh"]["dp"] * tp // ep
    counts = sorted({(e["experts"], e["per_rank"]) for e in experts})
    held = "; ".join(f"{total} experts, {each} per rank" for total, each in counts)
    if tp == 1:
        who, block = f"replicas [g * {ep}, (g + 1) * {ep})", f"replica d holds block d % {ep}"
    else:
        who = f"ranks [g * {ep}, (g + 1) * {ep}) of a stage's dp x tp, numbered dp_rank * {tp} + tp_rank,"
        block = f"rank i holds block i % {ep}; each tp rank sends its 1/{tp} of the tokens, outputs all-gathered over tp"
    return [f"expert parallel: ep={ep}: {who} split the experts of "
            f"{', '.join(collapse_names([e['module'] for e in experts]))} ({held}), {plural(groups, 'group')}; {block}, "
            f"whole (not sharded over dp); tokens reach their experts by all-to-all"]


def _tensor_parallel_lines(data: dict) -> list[str]:
    if not data["tensor_parallel"]:
        return ["Tensor parallel: no module is sharded"]
    tp, rows = data["mesh"]["tp"], shard_rows(data["tensor_parallel"])
    header = ["module", "style", "weight", "bias", "rule"]
    if all(r[3] == "-" for r in rows):  # no biases: no column for them
        header, rows = header[:3] + header[4:], [r[:3] + r[4:] for r in rows]
    return [
        f"Tensor parallel: {data['sharded_modules']} modules in {len(rows)} rows (layers alike in one); weight and "
        f"bias shapes whole -> on each of the {plural(tp, 'tp rank')}"
        + (" (tp=1: nothing is split)" if tp == 1 else ""),
        *_kv_lines(tp, data["kv_replicas"]),
        format_table(header, rows),
    ]


def _kv_lines(tp: int, r: int) -> list[str]:
    # Past the kv heads (tp = kv * r), each rank holds one whole kv head, shared with r - 1 neighbours.
    if r == 1:
        return []
    return [f"  kv heads replicated {r}x: each of the {tp // r} kv heads on {r} of the {tp} tp ranks (tp "
            f"{span(0, r - 1)} hold kv head 0, {span(r, 2 * r - 1)} kv head 1, ...): k_proj and v_proj keep one "
            f"whole head a rank, their gradients summed over the {r}"]


def _pipeline_lines(data: dict) -> list[str]:
    mesh, pipe = data["mesh"], data["pipeline"]
    cuts = f", cut at {', '.join(pipe['cut_points'])}" if pipe["cut_points"] else ""
    how = " (auto)" if pipe["planned"]["cut_points"] == "auto" else ""
    est = (
        f"; est. compute: training FLOPs per stage for {pipe['est_compute_seq_len']}-token sequences "
        "(pipeline.seq_len)"
        if pipe["est_compute_seq_len"] is not None
        else ""
    )
    n, k, pp, tp = len(data["stages"]), pipe["virtual_stages"], mesh["pp"], mesh["tp"]
    shape = "V" if pipe["schedule"] == "zbv" else "looped"
    per_rank = f" on {plural(pp, 'rank')} ({k} per rank, {shape})" if k > 1 else ""
    ranks = "ranks (replica 0)" if mesh["dp"] > 1 else "ranks"
    tp = tp * mesh.get("cp", 1)  # a stage's ranks: its cp ranks' tp ranks
    header = ["stage", ranks, "est. compute", "modules"]
    lead = max(len(ranks), len(",".join(str(r) for r in range(tp)))) + len("stage") + len("est. compute") + 2 + 3 * 2
    return [
        f"Pipeline: {plural(n, 'stage')}{per_rank}{cuts}{how}{est}",
        format_table(header, stage_rows(data["stages"], width=max(40, WIDTH - lead))),
    ]


def render_text(data: dict) -> str:
    """The tables of `rewrite show`, with a heading, the rank layout and the sharding mode, from `show_data`'s dict.

    Reads nothing but `data` (a dict `json.loads(json.dumps(data))` gives back works as well).

    Returns:
        Multi-line text, no trailing newline, prose wrapped at `WIDTH` columns.

    Example:
        >>> print(render_text(show_data(rewrite.resolve("plans/llama-tp2.yaml", model), model, memory_limit=80)))
    """
    mesh, pipe, model = data["mesh"], data["pipeline"], data["model"]
    name = model["name"] + (f" ({model['label']})" if model["label"] else "")
    m = pipe["planned"]["microbatches"]
    out = [
        f"{data['plan']} on {name}",
        f"mesh: {Shape(**{k: mesh.get(k, 1) for k in (*DIMS, 'ep')}).text()} = {mesh['world_size']} ranks; "
        f"{plural(m, 'microbatch')} per step{' per replica' if mesh['dp'] > 1 else ''}, "
        f"schedule {pipe['schedule']}; {'module walker (hf)' if pipe['kind'] == 'hf' else 'torch.fx stages'}",
        *_layout_lines(data),
        "",
        *_tensor_parallel_lines(data),
    ]
    if data["recomputed"]:
        out.append(
            f"Activation checkpointing: {data['recomputed_modules']} modules keep only their inputs and run their "
            f"forward again in the backward ({', '.join(data['recomputed'])})"
        )
    if data["selective"]:
        out.append(
            f"Selective activation checkpointing: {data['selective_modules']} modules keep their inputs, their "
            f"attention kernels' and every other product's outputs, and run the rest again in the backward "
            f"({', '.join(data['selective'])})"
        )
    if (lora := data.get("lora")) is not None:
        count = f", {lora['params']:,} parameters trained" if lora["params"] is not None else ""
        out.append(f"LoRA: adapters of rank {lora['rank']} (scale {lora['scaling']:g}"
                   + (f", dropout {lora['dropout']:g}" if lora["dropout"] else "")
                   + f") on {lora['layers']} linear layers{count}, every other weight frozen: gradients and AdamW "
                   f"state for the adapters only ({', '.join(lora['targets'])})")
    if (compiled := data.get("compile")) is not None:
        out.append(f"Compiled: each of {', '.join(compiled['blocks'])} on its own under torch.compile "
                   f"({compiled['backend']}, mode {compiled['mode']}); memory as eager, step times with the profile's "
                   "compiled terms where it has them")
    out += ["", *_pipeline_lines(data), "", *memory_lines(data)]
    whole = data["whole_model"]
    out.append(f"  whole model: {whole['params']:,} parameters, {format_bytes(whole['bytes'])}")
    if "predicted" in data:
        out += ["", prediction_line(data)]
    if data["warnings"]:
        out += ["", "Warnings:", *(f"  - {w}" for w in data["warnings"])]
    return wrap_prose("\n".join(out))


def prediction_line(data: dict) -> str:
    """`Predicted step on h100-sxm: 0.42 s ...` from `show_data(..., hardware=...)["predicted"]`."""
    p, pipe = data["predicted"], data["pipeline"]
    if "problem" in p:
        return f"Predicted step on {p['hardware']}: not predicted: {p['problem']}"
    seqs = data["mesh"]["dp"] * pipe["microbatches"] * pipe["batch_size"]
    return (
        f"Predicted step on {p['hardware']} ({plural(seqs, 'sequence')} of {pipe['seq_len']} tokens): "
        f"{p['step_s']:.3g} s, {p['tokens_per_s']:,.0f} tokens/s per device, MFU {p['mfu']:.0%}; the schedule "
        f"{p['pipeline_s']:.3g} s with a {p['bubble']:.0%} bubble, data parallelism {p['dp_s']:.2g} s exposed, "
        f"AdamW {p['optimizer_s']:.2g} s, the world's all-reduces {p['sync_s']:.2g} s (estimated from FLOPs and the profile's bandwidths: rewrite.estimate.step_time)"
    )


def format_plan(resolved: ResolvedPlan, *, model: nn.Module | None = None, **run) -> str:
    """`render_text(show_data(resolved, model, **run))`: the text of `rewrite show` for a resolved plan.

    Args:
        resolved: `rewrite.resolve(plan, model)`; a meta-device model is enough.
        model: the model it was resolved against; needed when mesh.dp > 1 (FSDP2 pads
            each parameter's dim 0 to a multiple of dp, which takes the shapes), for the
            whole shapes of the tensor-parallel table and for the activations.
        run: `show_data`'s other keywords: model_label (named in the heading), batch_size,
            seq_len, microbatches (the activations'), memory_limit (GiB per rank: a `fits`
            column and a line naming the ranks over it), warnings (printed under `Warnings:`).

    Raises:
        ValueError: mesh.dp > 1 and no model; a run setting below 1.

    Example:
        >>> print(format_plan(rewrite.resolve("plans/llama-tp2.yaml", model), model=model, memory_limit=80))
    """
    return render_text(show_data(resolved, model, **run))
