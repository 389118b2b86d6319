"""A mixture of experts' auxiliary load-balancing loss, as sums a pipeline can carry from stage to stage.

With `config.output_router_logits`, a transformers MoE causal LM adds `router_aux_loss_coef x
load_balancing_loss_func(router_logits of every layer, E, k)`: Switch's balance, pooled over every layer's rows,

    loss = E x sum_e (T_e / N) (P_e / N)

with `T_e` the (row, choice) pairs whose top k holds expert e, `P_e` the rows' softmax probabilities
of e summed, `N` the rows. A stage hands on just these sums (`Pooled`, `2 E + 1` numbers); the gradient
reaches each stage's routers through its own `P` alone, as `E T / N^2` (`balance`).
`router_loss_parts` checks on random logits that a family's own function is that pooled balance.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Pooled", "RouterLossParts", "balance", "pooled", "router_loss_parts"]


@dataclass(frozen=True)
class RouterLossParts:
    """How a family adds its routers' loss: its own function, the router class whose output (at `index`)
    are the logits, the coefficient, the experts and the choices per row."""

    fn: object
    router: type
    index: int
    coef: float
    experts: int
    top_k: int


@dataclass
class Pooled:
    """One forward's (or several stages') sums: `values = [T (E), P (E), N]` without a graph, float32;
    `probs`: this forward's own `P`, with its graph (None once handed on)."""

    values: torch.Tensor
    probs: torch.Tensor | None = None


def pooled(logits: list[torch.Tensor], experts: int, top_k: int) -> Pooled:
    """The sums of one forward's router logits (each `[rows, E]`), computed as the family's function does."""
    counts = torch.zeros(experts, dtype=torch.float32, device=logits[0].device)
    probs = torch.zeros(experts, dtype=torch.float32, device=logits[0].device)
    rows = 0
    for layer in logits:
        if layer.dim() != 2 or layer.shape[-1] != experts:
            raise ValueError(f"router logits of shape {tuple(layer.shape)}: expected [rows, {experts}]")
        weights = torch.softmax(layer, dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.bincount(chosen, minlength=experts).to(torch.float32)
        probs = probs + weights.float().sum(dim=0)
        rows += layer.shape[0]
    rows_t = torch.tensor([float(rows)], device=counts.device)
    return Pooled(torch.cat([counts, probs.detach(), rows_t]), probs)


def balance(total: torch.Tensor, probs: torch.Tensor | None, coef: float, experts: int) -> torch.Tensor:
    """`coef x` the loss of the pooled sums `total` (every stage's), differentiable through this stage's own
    `probs` (a part of `total`'s P): its value is the whole loss, its gradient this stage's share."""
    counts, summed, rows = total[:experts], total[experts:2 * experts], total[2 * experts]
    if probs is not None:
        summed = summed - probs.detach() + probs
    return coef * experts * (counts * summed).sum() / (rows * rows)


def router_loss_parts(model: nn.Module) -> RouterLossParts | str | None:
    """How `model` adds its routers' loss; None when it adds none (`output_router_logits` off); why not,
    in words, when it would add one this cannot count."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    name = type(model).__name__
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    recorder = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    router = getattr(recorder, "target_class", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    if fn is None or router is None or not isinstance(experts, int) or not isinstance(top_k, int) or coef is None:
        return (f"{name} adds its routers' auxiliary loss (output_router_logits) in a way rewrite "
                "does not read (no load_balancing_loss_func and router_logits recorder, experts and top k)")
    if not _is_pooled_balance(fn, experts, top_k):
        return (f"{name}'s load_balancing_loss_func is not Switch's balance over every layer's rows pooled "
                "(the sums rewrite carries between stages)")
    return RouterLossParts(fn, router, getattr(recorder, "index", 0), float(coef), experts, top_k)


def _is_pooled_balance(fn, experts: int, top_k: int) -> bool:
    """Whether the family's own function gives `balance` of `pooled` on random logits of three layers."""
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(rows, experts, generator=gen) for rows in (5, 7, 3)]
    try:
        want = fn(tuple(layers), experts, top_k, None)
    except Exception:  # noqa: BLE001 - a function that cannot take these is not the pooled balance
        return False
    got = balance(pooled(layers, experts, top_k).values, None, 1.0, experts)
    return isinstance(want, torch.Tensor) and bool(torch.allclose(want.float(), got, rtol=1e-5, atol=1e-7))
