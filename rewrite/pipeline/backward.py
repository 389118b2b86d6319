"""A stage's backward in two halves, for zero-bubble schedules: B now, W later.

B computes the gradient of the stage input only, which the previous stage is
waiting for; W computes the parameters' gradients, which nobody waits for, so a
schedule can put it in what would otherwise be a bubble. torch.distributed.pipelining
already splits the autograd graph this way (it keeps the gradients at the nodes
where the weight paths leave the input path, and W resumes from them), so this
module only adapts its two functions (private to torch: `torch_internals`) to the runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..torch_internals import backward_input as _input_half, backward_weight as _weight_half

__all__ = ["Deferred", "backward_input", "backward_weight"]


@dataclass
class Deferred:
    """What W needs: the saved split of one microbatch's backward on one stage."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    whole: tuple[list, list | None] | None = None  # (outputs, their gradients): W runs it all


def backward_input(
    outs: list[torch.Tensor], grads: list[torch.Tensor] | None, x: torch.Tensor, params: Sequence[nn.Parameter]
) -> tuple[torch.Tensor | None, Deferred]:
    """Gradient of `x` (None when `x` needs none) from the stage's outputs `outs` (losses when `grads` is
    None; a middle stage's activation, and its routers' loss beside it under a mixture of experts).

    When `x` takes no gradient (token ids on the first stage) nothing runs now and W
    runs the whole backward.
    """
    if not (x.is_floating_point() and x.requires_grad):
        return None, Deferred(whole=(outs, grads))
    (dx,), groups = _input_half(list(outs), grads, [x], iter(params))
    return dx, Deferred(groups=groups)


def backward_weight(deferred: Deferred, params: Sequence[nn.Parameter]) -> None:
    """Accumulate the parameters' gradients into `.grad`, completing `backward_input`."""
    if deferred.whole is not None:
        out, grad = deferred.whole
        torch.autograd.backward(out, grad)
    elif deferred.groups:
        _weight_half(iter(params), deferred.groups)
