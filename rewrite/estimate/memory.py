"""Memory per rank under a plan: parameters, gradients and optimizer state (`param_memory`) plus the
activations (`activations`) for a batch size, sequence length and microbatch count.

What `rewrite show` prints in its per-rank table; a meta-device model will do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..binding.resolve import ResolvedPlan
from ..plan.ranks import Coords
from .activations import activation_problem, rank_activations
from .param_memory import (
    REDUCES, SHARDINGS, Footprint, ParamSums, footprint, param_sums, param_unit, rank_footprints, rank_held,
    rank_parameters, reduce_as_run,
)

__all__ = [
    "Footprint", "ParamSums", "RankMemory", "REDUCES", "SHARDINGS", "GIB", "footprint", "param_sums", "rank_footprints", "rank_memory", "rank_parameters", "rank_held", "param_unit", "reduce_as_run",
    "with_run",
]


GIB = 1024**3


@dataclass(frozen=True)
class RankMemory:
    """One global rank's estimated memory in bytes (replica 0; the other replicas hold the same)."""

    rank: int
    pp_rank: int
    tp_rank: int
    stages: tuple[int, ...]
    params: int  # elements held between steps
    weights: int
    grads: int
    adamw: int
    gathered: int  # what a step adds: gathered parameters and whole gradients over dp x cp, else autocast's casts
    activations: int | None  # at the peak, the loss's buffers included (`RankActivations.top`); None: not estimated
    in_flight: int | None  # the most (microbatch, stage) pairs alive at once on the rank
    cp_rank: int = 0

    @property
    def total(self) -> int:
        """Weights + grads + AdamW + gathered + activations: the estimated peak of a step."""
        return self.weights + self.grads + self.adamw + self.gathered + (self.activations or 0)

    def fits(self, limit_bytes: float | None) -> bool | None:
        """Whether `total` is at most `limit_bytes`; None without a limit."""
        return None if limit_bytes is None else self.total <= limit_bytes


def with_run(resolved: ResolvedPlan, *, seq_len: int | None = None, microbatches: int | None = None) -> ResolvedPlan:
    """The resolved plan with pipeline.seq_len and pipeline.microbatches replaced (None keeps the plan's).

    Only what the activation estimate reads changes; stages and compute shares stay as resolved.

    Raises:
        ValueError: a value below 1, or other microbatches than a custom schedule's table runs.
    """
    pipe, update = resolved.plan.pipeline, {}
    for name, value in (("seq_len", seq_len), ("microbatches", microbatches)):
        if value is None:
            continue
        if value < 1:
            raise ValueError(f"`{name}` is {value}; use a whole number >= 1")
        update[name] = value
    if "microbatches" in update and pipe.schedule == "custom" and update["microbatches"] != pipe.microbatches:
        raise ValueError(
            f"`microbatches={microbatches}`: schedule custom runs the {pipe.microbatches} microbatches of its "
            "table; leave `microbatches` out or change pipeline.table"
        )
    if not update:
        return resolved
    plan = resolved.plan.model_copy(update={"pipeline": pipe.model_copy(update=update)})
    return dataclasses.replace(resolved, plan=plan)


def rank_memory(
    resolved: ResolvedPlan,
    model: nn.Module | None = None,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    microbatches: int | None = None,
    dtype: str | torch.dtype | None = None,
) -> list[RankMemory]:
    """Parameters, gradients, AdamW state and activations of each rank of replica 0, in rank order.

    Args:
        resolved: `rewrite.resolve(plan, model)`.
        model: the model it was resolved against (meta will do). Needed for mesh.dp > 1 and
            for the activations; without it, or for a torch.fx split, activations are None.
        batch_size: sequences per microbatch.
        seq_len, microbatches: override pipeline.seq_len and pipeline.microbatches.
        dtype: the compute dtype (default the parameters'): the activations are counted in it
            and, when narrower than the parameters (mixed precision), FSDP2's gathered copies
            or autocast's cast weights (`footprint`).

    Returns:
        One `RankMemory` per global rank of replica 0 (`plan.ranks.Shape.rank`), its cp ranks included
        (they hold the same); activations follow the plan's schedule (AFAB keeps every microbatch alive,
        1F1B at most pp - r on rank r).

    Example:
        >>> [m.total for m in rank_memory(rewrite.resolve("plans/llama-pp2.yaml", model), model)]
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` is {batch_size}; use a whole number of sequences >= 1")
    run = with_run(resolved, seq_len=seq_len, microbatches=microbatches)
    acts = None
    if model is not None and activation_problem(resolved, model) is None:
        acts = rank_activations(run, model, batch_size=batch_size, dtype=dtype)
    out, mesh = [], resolved.plan.mesh
    for pp_rank, foot in enumerate(rank_footprints(run, model, dtype=dtype)):
        act = acts[pp_rank] if acts is not None else None
        for c in range(mesh.cp):
            for t in range(resolved.tp):
                out.append(RankMemory(
                    rank=mesh.shape.rank(Coords(pp=pp_rank, cp=c, tp=t)), pp_rank=pp_rank, tp_rank=t,
                    stages=resolved.rank_stages(pp_rank), params=foot.params, weights=foot.weights, grads=foot.grads,
                    adamw=foot.adamw, gathered=foot.peak - foot.at_rest, activations=None if act is None else act.top,
                    in_flight=None if act is None else act.in_flight, cp_rank=c,
                ))
    return out
