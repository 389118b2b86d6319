"""Parameters two pipeline ranks share (tied embeddings): their gradients summed once per step.

The first stage's embedding and the last stage's LM head are one matrix in the model; carved
onto two ranks, each end accumulates its own share of the gradient, and the runner sums the
shares over `mesh.tied_group` after the step's backwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .stage import Stage

__all__ = ["stash_tied_grads", "sum_tied_grads"]


def stash_tied_grads(stage: Stage) -> list:
    """Set aside gradients accumulated before this step, so only this step's are summed."""
    stash = [p.grad for p in stage.tied]
    for p in stage.tied:
        p.grad = None
    return stash


def sum_tied_grads(stage: Stage, stash: list) -> None:
    """Sum this step's gradients of each tied parameter over its two ends, then add back what was set aside."""
    for param, before in zip(stage.tied, stash):
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        # Under data parallelism both ends hold the same shard of the matrix: sum the shards.
        with torch.no_grad():  # to_local without autograd is the shard itself, not a temporary view
            local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=stage.mesh.tied_group)
        param.grad = grad if before is None else before.add_(grad)
