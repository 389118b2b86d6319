"""The router's auxiliary load-balancing loss, counted as the family's own forward counts it.

With `config.output_router_logits`, a transformers MoE causal LM adds
`router_aux_loss_coef x load_balancing_loss_func(router_logits of every layer, E, k)` to its loss:
one Switch-style balance over every layer's rows of the forward's batch. The runner computes the
loss itself, so `RouterLoss` records the routers' logits as the family declares them
(`_can_record_outputs["router_logits"]`: the router class and which output) while a microbatch's
forward runs, and hands them to the family's own `load_balancing_loss_func`: the scope is the
microbatch, as one process running that microbatch counts it (each replica's, under dp and ep).
Recomputation (activation checkpointing) runs the routers again in the backward, outside a
forward: nothing is recorded then, so nothing counts twice.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RouterLoss"]


class RouterLoss:
    """Records a model's router logits during a forward; `finish` gives `coef x` the family's loss on them."""

    def __init__(self, model: nn.Module, parts: tuple):
        """`parts`: `models.experts.router_loss_parts(model)`."""
        self.fn, router, self.index, self.coef, self.experts, self.top_k = parts
        self.logits: list[torch.Tensor] | None = None  # None: not inside a forward, record nothing
        for module in model.modules():
            if isinstance(module, router):
                module.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args, output) -> None:
        if self.logits is not None:
            self.logits.append(output[self.index] if isinstance(output, tuple) else output)

    def start(self) -> None:
        """A microbatch's forward begins: record its routers from here."""
        self.logits = []

    def finish(self) -> torch.Tensor:
        """The microbatch's auxiliary loss, weighted by the family's coefficient; recording stops."""
        logits, self.logits = self.logits, None
        if not logits:
            raise RuntimeError("the routers' auxiliary loss: no router ran in this forward")
        return self.coef * self.fn(tuple(logits), self.experts, self.top_k, None)
