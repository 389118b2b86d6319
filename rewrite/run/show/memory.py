"""The memory section of `rewrite show` as text: the per-rank table and the lines under it, laid out
from `show_data`'s dict (the estimates themselves are `rewrite.estimate.memory`'s)."""

from __future__ import annotations

from ...estimate.memory import GIB
from ...plan.wording import index_ranges
from .columns import format_bytes, format_table, span

__all__ = ["UNCOUNTED", "memory_table", "memory_notes", "memory_lines"]

# What the activation estimate leaves out; the options table says the same.
UNCOUNTED = ("SDPA attention, the plain loss's float32 gradients at its peak counted, other transient buffers not "
             "(rewrite.estimate.activations)")


def _gib(limit_bytes: float) -> str:
    return f"{limit_bytes / GIB:g} GiB"


def memory_table(memory: dict) -> tuple[list[str], list[list[str]]]:
    """The cells of the per-rank memory table of `rewrite show`: (header, rows), from `show_data(...)["memory"]`.

    Columns: rank, stages, tp_rank, params (elements), weights, grads, AdamW, gathered (only
    when a rank adds any: parameters shared over dp x cp, or weights cast to a narrower compute
    dtype), activations (`-`: not estimated), total, and fits (only with a memory limit): `yes`,
    or `no (42.4 GiB > 40 GiB)`.

    Example:
        >>> data = show_data(rewrite.resolve("plans/llama-pp2.yaml", model), model)
        >>> print(format_table(*memory_table(data["memory"])))
    """
    ranks, limit = memory["ranks"], memory["limit_bytes"]
    dp = any(m["gathered"] for m in ranks)
    cp = any(m.get("cp_rank", 0) for m in ranks)  # a cp_rank column under context parallelism
    header = ["rank", "stages", *(["cp_rank"] if cp else []), "tp_rank", "params", "weights", "grads", "AdamW",
              *(["gathered"] if dp else []), "activations", "total", *(["fits"] if limit is not None else [])]
    rows = []
    for m in ranks:
        row = [str(m["rank"]), ",".join(map(str, m["stages"])), *([str(m["cp_rank"])] if cp else []),
               str(m["tp_rank"]), f"{m['params']:,}",
               *(format_bytes(m[k]) for k in ("weights", "grads", "adamw")),
               *([format_bytes(m["gathered"])] if dp else []),
               "-" if m["activations"] is None else format_bytes(m["activations"]), format_bytes(m["total"])]
        if limit is not None:
            row.append("yes" if m["fits"] else f"no (> {_gib(limit)})")  # the total is the column before
        rows.append(row)
    return header, rows


def memory_notes(data: dict) -> list[str]:
    """The lines under the memory table: other replicas, the activations' settings, what total adds up,
    under dp the fullest rank under each sharding, and with a memory limit how many ranks do not fit."""
    mesh, pipe, memory, out = data["mesh"], data["pipeline"], data["memory"], []
    ranks, per, dp = memory["ranks"], mesh["pp"] * mesh.get("cp", 1) * mesh["tp"], mesh["dp"]
    shared = dp * mesh.get("cp", 1) > 1  # ranks holding the same parameters: FSDP2 / replicate over them
    if dp == 2:
        out.append(f"  {span(per, 2 * per - 1)} (replica 1) hold the same as {span(0, per - 1)}, rank for rank")
    elif dp > 2:
        out.append(f"  {span(1, dp - 1, 'replica')} ({span(per, dp * per - 1)}) hold the same as "
                   "replica 0, rank for rank")
    b, s, m = pipe["batch_size"], pipe["seq_len"], pipe["microbatches"]
    if ranks and ranks[0]["activations"] is not None:
        alive = ", ".join(f"rank {r['rank']}: {r['microbatches_alive']}" for r in ranks
                          if r["tp_rank"] == 0 and r.get("cp_rank", 0) == 0)
        held = f" ({s // mesh['cp']} on each cp rank)" if mesh.get("cp", 1) > 1 else ""
        out.append(
            f"  activations: {b} sequence{'s' if b != 1 else ''} of {s} tokens{held} per microbatch, "
            f"{m} microbatch{'es' if m != 1 else ''} under {pipe['schedule']} (microbatch-stages alive at most: "
            f"{alive}); {UNCOUNTED}"
        )
    else:
        out.append(f"  activations: not estimated ({memory['activations_not_estimated']})")
    if not any(r["gathered"] for r in ranks):  # no gathered column (`memory_table`): nothing to add
        out.append("  total = weights + grads + AdamW + activations")
    elif not shared:  # mixed precision on whole parameters: autocast's casts are the column
        out.append(f"  total = weights + grads + AdamW + gathered + activations; gathered: autocast's copies of the "
                   f"weights in {memory.get('compute_dtype')}, kept through the step")
    else:
        out.append(
            "  total = weights + grads + AdamW + gathered + activations; gathered: what a step adds, parameters "
            "gathered (full: the largest layer or the root's embeddings/norm/head; grad_op, or full under a split "
            "schedule: all of the rank's, from forward to the step's end; replicate: a second whole copy) and the "
            "gradients accumulated whole until the step's one reduce, less the sharded grads they replace"
        )
        feet = memory["fullest"]
        rest = ", ".join(f"{mode} {format_bytes(f['at_rest'])}" for mode, f in feet.items())
        peak = ", ".join(f"{mode} {format_bytes(f['peak'])}" for mode, f in feet.items())
        out.append(f"  the fullest rank under each sharding, params + grads + AdamW: {rest}; peak in step: {peak}")
    if memory["limit_bytes"] is not None:
        over = [r for r in ranks if not r["fits"]]
        each, limit = " of each replica" if dp > 1 else "", memory.get("limit_source") or _gib(memory["limit_bytes"])
        if over:
            out.append(f"  {len(over)} of {len(ranks)} ranks{each} do not fit in {limit} (ranks "
                       f"{index_ranges((r['rank'] for r in over), min_run=2)}; the largest total "
                       f"{format_bytes(max(r['total'] for r in over))})")
        else:
            out.append(f"  all {len(ranks)} ranks{each} fit in {limit}")
    return out


def memory_lines(data: dict) -> list[str]:
    """The memory section: a heading naming the dtypes, the table (`memory_table`), the notes (`memory_notes`)."""
    dtype = data["memory"]["dtype"] or "the parameters' dtype"
    compute = data["memory"].get("compute_dtype") or dtype
    held = (f"weights, grads and activations in {dtype}" if compute == dtype else
            f"weights and grads in {dtype}, activations and gathered or cast weights in {compute}")
    return [
        f"Memory per rank: params held between steps; {held}, AdamW's 2 moments in float32",
        format_table(*memory_table(data["memory"])),
        *memory_notes(data),
    ]
