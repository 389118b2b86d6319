"""Estimated activation memory per rank: the bytes of a rank's microbatches alive at once for their backward.

The bytes one microbatch keeps per decoder layer and at the last stage are `layer_activations`' and
`head_activations`' (the first's docstring has the formula and its notation).

A rank's estimate: the bytes of its (microbatch, stage) pairs alive at once in the plan's
schedule table (AFAB: every microbatch; 1F1B: at most pp - i on pp rank i), plus the recompute
term. Left out: cos / sin and a causal mask (shared by the layers; SDPA's is_causal needs
none), token ids and the loss's per-token indices, transient buffers (the float32 logits a loss
builds in its forward, gradients, collectives' buffers, kernel workspaces), the input a
non-first stage receives when the dtype is not float32 (the runner holds it beside the norm's
float32 copy), allocator fragmentation, key/value repeated to a heads when a padding mask
keeps SDPA from grouping them, and checkpointed modules other than those `layer_activations` names (counted
as not checkpointed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..binding.resolve import ResolvedPlan
from ..schedules import peak_in_flight, plan_table
from ..schedules.table import Table, alive_counts
from .head_activations import end_bytes, loss_peak_bytes
from .layer_activations import Sizes, layer_bytes
from .plan_parts import activation_problem, layer_kinds, loss_sharded, shard_styles

__all__ = [
    "Sizes", "RankActivations", "layer_bytes", "end_bytes", "rank_activations", "activation_problem",
    "compute_dtype", "plan_sizes", "stage_activations", "place_activations", "place_peaks",
]


@dataclass(frozen=True)
class RankActivations:
    """One pp rank's estimate (every tp rank of it, every replica alike)."""

    pp_rank: int
    stage_bytes: dict[int, int]  # per stage it holds: bytes one microbatch keeps until its backward
    in_flight: int  # the most (microbatch, stage) pairs alive at once in the schedule
    recompute: int  # bytes the largest recomputed module holds again during its backward (0: none)
    peak: int  # the estimate: the most bytes alive at once, recompute included
    loss: int = 0  # bytes the loss holds at its peak beyond what it keeps (`loss_peak_bytes`; the last stage's rank)

    @property
    def top(self) -> int:
        """The peak with the loss's: its buffers come while the kept bytes are alive, before any recompute."""
        return self.peak + max(self.loss - self.recompute, 0)


def compute_dtype(model: nn.Module, given: str | torch.dtype | None = None) -> torch.dtype:
    """The dtype a run computes in: `given` (a torch dtype or its name), else the model's parameters'.

    Raises:
        ValueError: `given` names no torch floating dtype.
    """
    if given is None:
        return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    found = given if isinstance(given, torch.dtype) else getattr(torch, str(given).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"compute dtype {given!r}: use a floating dtype's name (float32, bfloat16, float16)")
    return found


def plan_sizes(resolved: ResolvedPlan, model: nn.Module, *, batch_size: int = 1,
               dtype: str | torch.dtype | None = None) -> Sizes:
    """The `Sizes` of a resolved plan's run: the model's config, the plan's seq_len, tp and switches, and
    B from the compute dtype (`dtype`; default the parameters' dtype)."""
    attention = model.get_submodule(f"{resolved.backbone.layer(0)}.self_attn")
    plan = resolved.plan
    return Sizes.of(
        model.config,
        seq_len=plan.pipeline.seq_len,
        batch_size=batch_size,
        tp=resolved.tp,
        dtype_bytes=compute_dtype(model, dtype).itemsize,
        sequence_parallel=plan.sequence_parallel,
        qk_norm=hasattr(attention, "q_norm"),
        kv_replicas=resolved.kv_replicas,
        cp=plan.mesh.cp,
        # ep over tp ranks holding the same tokens; under sequence parallelism each holds its part already
        routed_split=resolved.tp if plan.mesh.ep > 1 and resolved.experts and not plan.sequence_parallel else 1,
        **lora_sizes(resolved),
    )


def lora_sizes(resolved: ResolvedPlan) -> dict:
    """The `Sizes` fields of a LoRA plan: its rank, the projections carrying adapters, whether they drop."""
    lora = resolved.plan.lora
    if lora is None:
        return {}
    return {"lora_rank": lora.rank, "lora_dropout": lora.dropout > 0,
            "lora_leaves": frozenset(t.rpartition(".")[2] for t in resolved.lora_targets)}


def rank_activations(resolved: ResolvedPlan, model: nn.Module, *, batch_size: int = 1,
                     dtype: str | torch.dtype | None = None) -> list[RankActivations]:
    """The estimated activation bytes of each pp rank, in pp-rank order.

    Args:
        resolved: `rewrite.resolve(plan, model)` of a Hugging Face LLaMA-family model.
        model: the model it was resolved against (meta will do): its config, parameter
            dtype, and whether its attention has per-head norms.
        batch_size: sequences per microbatch, each `pipeline.seq_len` tokens.
        dtype: the compute dtype (default the parameters' dtype): B in the model above.

    Returns:
        One `RankActivations` per pp rank; see the module docstring for the model.

    Raises:
        ValueError: a model split by torch.fx (no layer structure to estimate), or a config
            without the sizes the estimate needs.

    Example:
        >>> acts = rank_activations(rewrite.resolve("plans/llama-tp2.yaml", model), model)
        >>> acts[0].in_flight  # AFAB, 4 microbatches
        4
    """
    problem = activation_problem(resolved, model)
    if problem:
        raise ValueError(problem)
    return place_activations(resolved, *stage_activations(resolved, model, batch_size=batch_size, dtype=dtype))


def stage_activations(resolved: ResolvedPlan, model: nn.Module, *, batch_size: int = 1,
                      dtype: str | torch.dtype | None = None, sizes: Sizes | None = None) -> tuple[list[int], list[int], list[int]]:
    """Per stage: the bytes one microbatch keeps until its backward, the bytes its largest recomputed
    module holds again during the backward, and the bytes its loss holds at its peak beyond what it keeps
    (`loss_peak_bytes`: the last stage). Independent of the schedule and the microbatch count: a
    search computes them once per batch size and checkpointing (`place_activations` adds the schedule).
    `sizes`: `plan_sizes` of this plan, batch size and dtype, when the caller has them."""
    bb = resolved.backbone
    z = sizes or plan_sizes(resolved, model, batch_size=batch_size, dtype=dtype)
    styles = shard_styles(resolved)
    last = resolved.num_stages - 1
    kept, rebuilt, loss, memo = [], [], [], {}
    for stage, kinds in enumerate(layer_kinds(resolved, styles)):
        k_sum, r_max = 0, 0
        for i, splits, parts in kinds:
            key = (tuple(splits.values()), i == 0, parts)
            if key not in memo:  # decoder layers alike in shape: one computation each
                memo[key] = layer_bytes(z, **splits, first=i == 0, recomputed=parts)
            k, r = memo[key]
            k_sum, r_max = k_sum + k, max(r_max, r)
        sharded = loss_sharded(resolved, styles)
        loss.append(loss_peak_bytes(z, has_head=bb.has_head, loss_parallel=sharded) if stage == last else 0)
        if stage == last:
            k_sum += end_bytes(z, has_head=bb.has_head, loss_parallel=sharded)
        else:
            k_sum += z.chunk * z.dtype_bytes * z.hidden  # the output, held for its backward
        k_sum += z.mask_bytes
        kept.append(k_sum)
        rebuilt.append(r_max)
    return kept, rebuilt, loss


def place_activations(resolved: ResolvedPlan, kept: list[int], rebuilt: list[int], loss: list[int]
                      ) -> list[RankActivations]:
    """Each pp rank's `RankActivations` from `stage_activations`, under the plan's schedule table and placement."""
    pipe = resolved.plan.pipeline
    table = plan_table(pipe.schedule, pipe.table, resolved.pp, pipe.virtual_stages, pipe.microbatches)
    return [RankActivations(r, held, peak_in_flight(row), recompute, _peak(row, held) + recompute, top)
            for r, row, held, recompute, top in _placed(table, resolved.stage_rank, kept, rebuilt, loss)]


def place_peaks(table: Table, stage_rank: tuple[int, ...], kept: list[int], rebuilt: list[int], loss: list[int]
                ) -> list[int]:
    """`place_activations`' peaks with the loss's (`RankActivations.top`: what a plan search compares with the
    device memory), for a schedule `table` running stages placed by `stage_rank` (pp rank of each stage)."""
    return [_peak(row, held) + max(recompute, top) for _, row, held, recompute, top in
            _placed(table, stage_rank, kept, rebuilt, loss)]


def _placed(table: Table, stage_rank: tuple[int, ...], kept: list[int], rebuilt: list[int], loss: list[int]):
    """Per pp rank: (rank, its table row, bytes per held stage, its largest recompute, its loss's peak)."""
    for pp_rank, row in enumerate(table):
        held = {s: kept[s] for s, r in enumerate(stage_rank) if r == pp_rank}
        yield (pp_rank, row, held, max((rebuilt[s] for s in held), default=0),
               max((loss[s] for s in held), default=0))


def _peak(row, stage_bytes: dict[int, int]) -> int:
    """Most bytes alive at once: a (mb, stage) pair from its F to its B (or the W after its I)."""
    return max((sum(n * stage_bytes[s] for s, n in counts) for counts in alive_counts(row)), default=0)
