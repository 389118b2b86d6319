"""How a step's gradients are finished: one small protocol, and one flat sum.

Each way a backward leaves gradients incomplete (the dp average, the experts' sum, the tp partial sums,
a tied embedding's two ends) is a `GradFinish`, listed in order on the stage (`Stage.grad_finish`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["GradFinish", "flat_sum"]


class GradFinish:
    """One way a step's gradients are completed, called by the runner at four points of a step; every call
    but `finish` does nothing unless overridden. Collective: `finish` runs on every rank of its group."""

    # What a rank waiting in `finish` is said to be doing (`rewrite.doing`).
    doing = "finishing the step's gradients"

    def begin(self) -> None:
        """Before the step's first action (backwards only accumulate; what was accumulated before may be set aside)."""

    def next_backward_reduces(self) -> None:
        """Before a whole backward that may reduce as it goes: the step's last (no W after it), or every one
        under `data_parallel.reduce: microbatch`."""

    def end(self) -> None:
        """After the step's actions, however they ended (an error included)."""

    def finish(self) -> None:
        """After the step's last action: complete the gradients, once per step."""
        raise NotImplementedError


def flat_sum(tensors: Sequence[torch.Tensor], group: ProcessGroup | None,
             reduce: Callable[[torch.Tensor, ProcessGroup | None], object] | None = None) -> None:
    """Sum `tensors` over `group` in one collective, in place: flattened into one buffer, reduced, copied back.

    `reduce(flat, group)` sums a contiguous tensor in place (default `dist.all_reduce`).
    """
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if reduce is None:
        dist.all_reduce(flat, group=group)
    else:
        reduce(flat, group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))
