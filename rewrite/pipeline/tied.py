"""Parameters two pipeline ranks share (tied embeddings): their gradients summed once per step.

The first stage's embedding and the last stage's LM head are one matrix in the model; carved
onto two ranks, each end accumulates its own share of the gradient, and `TiedSums` adds the
shares over `mesh.tied_group` after the step's backwards (a `GradFinish` of the stage).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..grad_finish import GradFinish

__all__ = ["TiedSums"]


class TiedSums(GradFinish):
    """The gradients of the parameters `names` of `model` (this rank's end of each tied pair) summed over
    `group`, once per step. Found by name at each step: data parallelism and checkpoint loading put
    other tensors in their place."""

    doing = "the tied weights' gradient sum between the first and last stage"

    def __init__(self, model: nn.Module, names: list[str], group: ProcessGroup | None):
        self.model, self.names, self.group = model, names, group
        self.params: list[nn.Parameter] = []
        self.stash: list[torch.Tensor | None] = []

    def begin(self) -> None:
        """Set aside gradients accumulated before this step, so only this step's are summed."""
        self.params = [self.model.get_parameter(n) for n in self.names]
        self.stash = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """Sum this step's gradient of each tied parameter over its two ends, then add back what was set aside."""
        for param, before in zip(self.params, self.stash):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            # Under data parallelism both ends hold the same shard of the matrix: sum the shards.
            with torch.no_grad():  # to_local without autograd is the shard itself, not a temporary view
                local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.group)
            param.grad = grad if before is None else before.add_(grad)
        self.params, self.stash = [], []
