"""The routers' auxiliary load-balancing loss, counted as the family's own forward counts it.

With `config.output_router_logits` a transformers MoE causal LM adds its routers' balance to its loss
(`models.router_loss`); the runner computes the loss itself, so `RouterLoss` records the routers' logits
(`_can_record_outputs["router_logits"]`) while a stage runs one microbatch, as one process counts them.
Recomputation runs the routers again outside a forward: nothing is recorded then, nothing counts twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..models.router_loss import Pooled, RouterLossParts, balance, pooled
from ..tensor_parallel.comm import group_rank, group_size
from ..tensor_parallel.mixins import add_mixin
from ..tensor_parallel.sequence import sequence_chunk

__all__ = ["RecordedRouter", "RouterLoss"]


class RecordedRouter:
    """Mixin: a router whose forward also hands its output to `router_loss` (kept there while it records)."""

    router_loss: RouterLoss

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        self.router_loss.record(output)
        return output


class RouterLoss:
    """Records a model's router logits during a stage's forward; `finish` gives their sums, `loss` the
    family's loss (times its coefficient) of the sums pooled over every stage."""

    def __init__(self, model: nn.Module, parts: RouterLossParts, cp_group: ProcessGroup | None = None,
                 sequence=None):  # sequence: sequence parallelism's `SequenceState` (tp group, length in flight)
        self.parts, self.cp_group, self.sequence = parts, cp_group, sequence
        self.logits: list[torch.Tensor] | None = None  # None: not inside a forward, record nothing
        for module in model.modules():
            if isinstance(module, parts.router):
                add_mixin(module, RecordedRouter).router_loss = self

    width = property(lambda self: 2 * self.parts.experts + 1, doc="Numbers in the sums a stage hands on: `2 E + 1`.")

    def record(self, output) -> None:
        """A router's output (its logits, or a tuple holding them at `RouterLossParts.index`): kept while recording."""
        if self.logits is not None:
            self.logits.append(output[self.parts.index] if isinstance(output, tuple) else output)

    def _real_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism, the rows of this rank's part `[b c, E]` that hold tokens (not padding)."""
        group, length = self.sequence.group, self.sequence.length
        chunk = sequence_chunk(length, group_size(group))
        place = group_rank(group) * chunk + torch.arange(logits.shape[0], device=logits.device) % chunk
        return logits[place < length]

    def start(self) -> None:
        """A stage's forward on a microbatch begins: record its routers from here."""
        self.logits = []

    def finish(self, device: torch.device) -> Pooled:
        """The sums of the routers that ran since `start` (no router: zeros); recording stops. Collective over
        the cp group (context parallelism) and the tp group (sequence parallelism)."""
        logits, self.logits = self.logits, None
        if logits and self.sequence is not None:  # outside any checkpointed layer: recomputation saves the same
            logits = [self._real_rows(layer) for layer in logits]
        if logits:
            out = pooled(logits, self.parts.experts, self.parts.top_k)
        else:  # a stage without MoE layers (a dense first layer) adds nothing
            out = Pooled(torch.zeros(self.width, device=device))
        if self.cp_group is not None:
            dist.all_reduce(out.values, group=self.cp_group)
        if self.sequence is not None:
            dist.all_reduce(out.values, group=self.sequence.group)
        return out

    def loss(self, total: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """`coef x` the family's loss of the microbatch's sums `total`, differentiable through `probs`,
        the part of them this stage (this cp rank) computed."""
        return balance(total, probs, self.parts.coef, self.parts.experts)
