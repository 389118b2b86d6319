"""One call per training step on a model nobody rewrote by hand: `train_step_pipeline_afab`, built from
`apply_plan` and `run_schedule` (no hooks registered)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .pipeline.runner import run_schedule
from .plan.schema import MeshSpec, ParallelPlan, Pipeline
from .rewriter import apply_plan

__all__ = ["train_step_pipeline_afab"]


_STAGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def train_step_pipeline_afab(model, inputs, targets, device, dtype) -> torch.Tensor:
    """One AFAB pipeline step of a full `LlamaForCausalLM` present on every rank.

    The first call splits the model in place into a balanced pipeline with one
    stage per rank (`apply_plan` with `mesh.pp = world size`) and moves this rank's
    stage to `device` and `dtype`; later calls reuse that stage.

    Args:
        model: the same full model on every rank (same weights); the process group
            is already initialised.
        inputs: token ids, one `[mb, seq]` tensor per microbatch, the same list on every rank.
        targets: one `[mb, seq]` tensor of target ids per microbatch (aligned with the logits).
        device: where this rank's stage, inputs, hidden states and gradients live.
        dtype: the stage's parameter dtype and the dtype of hidden states and gradients.

    Returns:
        The step loss: the cross-entropy's mean over every trained token of the batch (targets
        other than -100), the same on every rank.

    Example:
        >>> loss = train_step_pipeline_afab(model, ids_chunks, target_chunks, "cpu", torch.float32)
    """
    stage = _STAGES.get(model)
    if stage is None:
        world = dist.get_world_size() if dist.is_initialized() else None
        plan = ParallelPlan(
            mesh=MeshSpec(pp=world or 1),
            pipeline=Pipeline(schedule="afab", microbatches=max(1, len(inputs) if isinstance(inputs, Sequence) else 1)),
        )
        stage = _STAGES[model] = apply_plan(model, plan)
    stage.module.to(device=device, dtype=dtype)
    return run_schedule(stage, inputs, targets)
