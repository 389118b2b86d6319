"""The fused experts module of a Hugging Face mixture of experts, as rewrite can split it by expert.

transformers' MoE families hold a layer's experts in one module (`gate_up_proj [E, 2I, H]`, `down_proj
[E, H, I]`, gpt-oss's transposed ones and biases alike) called as `experts(hidden_states, top_k_index,
top_k_weights)`: each (token, choice) row runs through its expert, weighted. Every parameter's first
dimension is the expert, so a rank holding experts `[a, b)` holds rows `[a, b)` of each, and the
module's own forward on them is the family's math.

Llama 4's experts (`EVERY_TOKEN_EXPERTS`) are called as `experts(hidden_states [E T, H])`, every token
through every expert, routing weights applied to the inputs before; they split alike, only the
exchange differs (`expert_parallel/dispatch`).

LongCat-Flash has zero-computation experts after the routed ones (`IDENTITY_EXPERTS`): a row routed
to one comes back as itself, weighted (`gate_up_proj` holds never-read rows for them, `down_proj`
none). Its forward reads two choices a row at least: `paired_choices` adds an identity expert at
weight 0, which adds exactly 0 to the row and to every gradient.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

__all__ = ["EVERY_TOKEN_EXPERTS", "EXPERTS_CALL", "IDENTITY_EXPERTS", "every_token", "expert_block",
           "experts_problem", "identity_experts", "num_experts", "paired_choices", "set_expert_counts"]

# The call every fused experts module answers: the token rows, their chosen experts and weights
# (gpt-oss names the last two router_indices and routing_weights).
EXPERTS_CALL = ("hidden_states", "top_k_index", "top_k_weights")

# Experts modules that run every token through every expert, called as forward(hidden_states) on the rows
# of all experts one after another ([E T, H]: expert e's are rows e T .. (e + 1) T), weights applied before.
EVERY_TOKEN_EXPERTS = frozenset({"Llama4TextExperts"})

# Experts modules with zero-computation (identity) experts numbered after the routed ones, by class:
# the attributes holding (the routed count, the identity count, both together), read by the family's forward.
IDENTITY_EXPERTS = {"LongcatFlashExperts": ("num_routed_experts", "zero_expert_num", "total_experts")}


def every_token(module: nn.Module) -> bool:
    """Whether `module` is of a declared every-token kind (`EVERY_TOKEN_EXPERTS`), or made from one."""
    return any(c.__name__ in EVERY_TOKEN_EXPERTS for c in type(module).__mro__)


def _identity_names(module: nn.Module) -> tuple[str, str, str] | None:
    """`IDENTITY_EXPERTS`' attributes of `module`'s class (or of the family class it was made from)."""
    return next((IDENTITY_EXPERTS[c.__name__] for c in type(module).__mro__ if c.__name__ in IDENTITY_EXPERTS), None)


def num_experts(module: nn.Module) -> int | None:
    """The (routed) experts a fused experts module holds (its `num_experts`), or None when it has no such count."""
    names = _identity_names(module)
    count = getattr(module, names[0] if names else "num_experts", None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def identity_experts(module: nn.Module) -> int:
    """The zero-computation experts numbered after `module`'s routed ones (`IDENTITY_EXPERTS`); 0 for others."""
    names = _identity_names(module)
    return int(getattr(module, names[1], 0) or 0) if names else 0


def expert_block(module: nn.Module) -> int | None:
    """The largest count dividing both the routed and the identity experts of `module` (its routed experts
    when it has no identity ones): an ep splitting it must divide this, each rank holding as many of both."""
    count = num_experts(module)
    return None if count is None else math.gcd(count, identity_experts(module))


def set_expert_counts(module: nn.Module, routed: int, identity: int) -> None:
    """Tell `module`'s forward it holds `routed` experts (and `identity` zero-computation ones after them:
    one at least for an identity kind, the one `paired_choices` names)."""
    names = _identity_names(module)
    if names is None:
        module.num_experts = routed
        return
    for name, value in zip(names, (routed, identity, routed + max(identity, 1))):
        setattr(module, name, value)


def paired_choices(module: nn.Module, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The choices `[R, 1]` of rows for `module`'s own forward over its local experts: as they are, or for an
    identity kind with a second choice each, its first identity expert at weight 0."""
    names = _identity_names(module)
    if names is None:
        return ids, weights
    spare = torch.full_like(ids, getattr(module, names[0]))
    return torch.cat([ids, spare], dim=1), torch.cat([weights, torch.zeros_like(weights)], dim=1)


def experts_problem(module: nn.Module) -> str | None:
    """Why `module` cannot be split by expert, in a phrase; None when it can: it answers `EXPERTS_CALL`,
    says how many experts it holds, and has parameters (and buffers), each with the experts first."""
    name = type(module).__name__
    count = num_experts(module)
    if count is None:
        return f"a {name} with no num_experts: not a fused experts module"
    try:
        params = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        params = ()
    if every_token(module):
        if params[:1] != EXPERTS_CALL[:1]:
            return f"a {name} called as forward({', '.join(params)}), not as forward(hidden_states)"
    elif len(params) < 3 or params[0] != EXPERTS_CALL[0]:
        return (f"a {name} called as forward({', '.join(params)}), not as forward({', '.join(EXPERTS_CALL)}): its "
                "experts do not take each token's chosen experts and weights, so they cannot be split by expert")
    tensors = [*module.named_parameters(), *module.named_buffers()]
    if not tensors:
        return f"a {name} without parameters"
    rows = {count, count + identity_experts(module)}
    other = [f"{n} {tuple(t.shape)}" for n, t in tensors if t.dim() == 0 or t.shape[0] not in rows]
    if other:
        return (f"a {name} whose {', '.join(other[:3])} {'does' if len(other) == 1 else 'do'} not have its "
                f"{count} experts as first dimension")
    return None
