"""The routers' auxiliary loss of a mixture of experts across pipeline stages and sequence shards.

The loss pools every MoE layer's rows of a microbatch (`models.router_loss`): no stage can count it
alone. Each stage adds its routers' sums to those of the stages before it and hands them on beside
its activation (an "f" message, `2 E + 1` float32 numbers); the last stage holds the microbatch's
sums, adds the loss to the language-model loss, and hands the sums back beside each gradient (a "b"
message). A stage's backward then adds the loss's gradient through its own routers' probabilities
(`RouterLoss.loss` of the whole sums, differentiable through this stage's part) to the gradient
arriving at its output: every stage's routers get what one process running the microbatch gives
them, and nothing but sums travels.

Under context parallelism the sums are added over the cp group first (each cp rank holds some of
the rows) and, like the language-model loss, each cp rank's part of the backward is scaled by cp:
the runner's gradient average over dp x cp then adds the cp ranks' parts up.
"""

from __future__ import annotations

import torch

from ..expert_parallel.aux_loss import RouterLoss

__all__ = ["RouterSums"]


class RouterSums:
    """One step's router sums on this rank, per (microbatch, stage), between its F and its B."""

    def __init__(self, routers: RouterLoss, microbatches: int, cp: int, device: torch.device):
        self.routers, self.m, self.cp, self.device = routers, microbatches, cp, device
        self.probs: dict[tuple[int, int], torch.Tensor | None] = {}  # a middle stage's own probabilities
        self.totals: dict[tuple[int, int], torch.Tensor] = {}  # the last stage's: the microbatch's sums

    @property
    def shape(self) -> tuple[tuple[int], torch.dtype]:
        """What an "f" or "b" message holds."""
        return (self.routers.width,), torch.float32

    def start(self) -> None:
        self.routers.start()

    def forward(self, mb: int, s: int, before: torch.Tensor | None, last: bool) -> torch.Tensor:
        """After stage `s` ran microbatch `mb`: its sums plus `before` (the previous stages', None on the
        first stage), to hand on; on the last stage, the router loss to add to the microbatch's loss."""
        mine = self.routers.finish(self.device)
        total = mine.values if before is None else before + mine.values
        if not last:
            self.probs[mb, s] = mine.probs
            return total
        self.totals[mb, s] = total
        return self.routers.loss(total, mine.probs)

    def last_share(self, loss: torch.Tensor) -> torch.Tensor:
        """Under context parallelism, a cp rank's part of the last stage's router loss: its value divided
        by cp (the cp ranks' losses add up to the microbatch's), its gradient whole (this rank's rows')."""
        if self.cp == 1:
            return loss
        return loss.detach() / self.cp + (loss - loss.detach())

    def backward(self, mb: int, s: int, total: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Before stage `s`'s backward of microbatch `mb`: the microbatch's sums (`total`, received beside
        the gradient; None on the last stage) and the router loss this stage adds to its backward roots
        (None on the last stage, whose loss holds it, or a stage without routers)."""
        if total is None:
            return self.totals.pop((mb, s)), None
        probs = self.probs.pop((mb, s))
        if probs is None:
            return total, None
        return total, self.routers.loss(total, probs) * (self.cp / self.m)
