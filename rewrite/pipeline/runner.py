"""The pipeline runner. AFAB: every microbatch's forward, then every backward.

The runner knows nothing of LLaMA or plans: it moves tensors between stages,
scales the loss, accumulates gradients and records a timeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn import functional as F

from . import p2p
from .inputs import check_step_inputs
from .stage import Stage, TimelineEvent

__all__ = ["run_afab", "causal_lm_loss"]


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the vocabulary, targets already aligned, -100 ignored.

    Computed in float32 whatever the logits' dtype.
    """
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=-100)


def run_afab(
    stage: Stage,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor] | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One training step, all-forward-all-backward; gradients accumulate in `.grad`.

    Args:
        stage: this rank's `Stage` from `apply_plan`.
        inputs: one tensor per microbatch. Pass the same list on every rank: the first
            stage feeds it to the model, later stages read only its length and shapes.
        targets: one tensor per microbatch, aligned with the model output; needed on
            the last stage (may be None elsewhere).
        loss_fn: `loss_fn(output, target)`; default: cross-entropy over the last
            dimension with ignore_index=-100. Each microbatch's loss is divided by
            the number of microbatches, so the gradients are those of the batch mean.

    Returns:
        The step loss (float32 scalar), the same on every rank.

    Raises:
        ValueError: the same on every rank, before any transfer, if any rank's arguments are
            bad (token ids outside the vocabulary, targets the default loss cannot take, ...)
            or ranks were given different microbatches (count, shapes, dtypes).

    Example:
        >>> loss = run_afab(stage, input_chunks, target_chunks)
        >>> optimizer.step(); optimizer.zero_grad()
    """
    check_step_inputs(stage, inputs, targets, default_loss=loss_fn is None)
    loss_fn = loss_fn or causal_lm_loss
    m, mesh, device, dtype = len(inputs), stage.mesh, stage.device, stage.dtype
    shapes = [stage.boundary_shapes(tuple(x.shape)) for x in inputs]
    stage.timeline = []
    sends: list = []  # in-flight works and the tensors they read
    stage_inputs, stage_outputs, losses = [], [], []

    def post_recv(i: int):
        if stage.is_first or i >= m:
            return None
        shape = shapes[i]["input"]
        if shape is None:  # traced stage: the sender announces the shape
            shape, wire_dtype = p2p.recv_header(mesh.prev_rank, device)
            return p2p.recv(mesh.prev_rank, shape, wire_dtype, device)
        return p2p.recv(mesh.prev_rank, shape, dtype, device)

    pending = post_recv(0)
    for i in range(m):  # all forwards
        if stage.is_first:
            x = inputs[i].to(device)
            if x.is_floating_point():
                x = x.to(dtype)
        else:
            x, works = pending
            for work in works:
                work.wait()
            pending = post_recv(i + 1)  # overlap the next transfer with this compute
            x.requires_grad_(x.is_floating_point())
        start = time.time()
        y = stage(x)
        if stage.is_last:
            losses.append(loss_fn(y, targets[i].to(y.device)) / m)
        else:
            out = y.detach()
            if shapes[i]["output"] is None:
                sends += p2p.send_header(out, mesh.next_rank)
            sends += [*p2p.send(out, mesh.next_rank), out]
        stage.timeline.append(TimelineEvent(mesh.rank, stage.stage_idx, i, "forward", start, time.time()))
        stage_inputs.append(x)
        stage_outputs.append(None if stage.is_last else y)

    stash = _stash_tied_grads(stage)
    for i in range(m):  # all backwards
        if stage.is_last:
            start = time.time()
            losses[i].backward()
        else:
            y = stage_outputs[i]
            grad, works = p2p.recv(mesh.next_rank, tuple(y.shape), y.dtype, y.device)
            for work in works:
                work.wait()
            start = time.time()
            torch.autograd.backward(y, grad)
        x = stage_inputs[i]
        if not stage.is_first and x.is_floating_point():
            grad_x = x.grad if x.grad is not None else torch.zeros_like(x)  # (mb, seq, hidden)
            sends += [*p2p.send(grad_x, mesh.prev_rank), grad_x]
        stage.timeline.append(TimelineEvent(mesh.rank, stage.stage_idx, i, "backward", start, time.time()))
        stage_inputs[i] = stage_outputs[i] = None  # free this microbatch's activations
    for work in sends:
        if not isinstance(work, torch.Tensor):
            work.wait()
    _sum_tied_grads(stage, stash)
    return _broadcast_loss(stage, losses, device)


def _stash_tied_grads(stage: Stage) -> list:
    """Set aside gradients accumulated before this step, so only this step's are summed."""
    stash = [p.grad for p in stage.tied]
    for p in stage.tied:
        p.grad = None
    return stash


def _sum_tied_grads(stage: Stage, stash: list) -> None:
    for param, before in zip(stage.tied, stash):
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=stage.mesh.tied_group)
        param.grad = grad if before is None else before.add_(grad)


def _broadcast_loss(stage: Stage, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.stack([l.detach() for l in losses]).sum() if losses else torch.zeros((), device=device)
    total = total.to(device=device, dtype=torch.float32)
    dist.broadcast(total, src=stage.mesh.global_rank(stage.num_stages - 1, 0))
    return total
