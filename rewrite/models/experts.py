"""The fused experts module of a Hugging Face mixture of experts, as rewrite can split it by expert.

transformers' MoE families hold a layer's experts in one module (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`, gpt-oss's transposed ones and biases alike) called as
`experts(hidden_states, top_k_index, top_k_weights)`: it runs each (token, choice) row through its
expert and applies the routing weight itself, wherever the family applies it. Every parameter's
first dimension is the expert, so a rank holding experts `[a, b)` holds the rows `[a, b)` of each,
and the module's own forward on those rows is the family's math for them.

Llama 4's experts are of another kind, declared here by class (`EVERY_TOKEN_EXPERTS`): called as
`experts(hidden_states [E T, H])`, every token through every expert (one batched product), its
routing weights applied to the inputs before (0 for an expert not chosen). Their parameters too
have the experts first, so they split alike; only the exchange differs (`expert_parallel/dispatch`).
"""

from __future__ import annotations

import inspect
import sys

from torch import nn

__all__ = ["EVERY_TOKEN_EXPERTS", "EXPERTS_CALL", "every_token", "experts_problem", "num_experts",
           "router_loss_parts"]

# The call every fused experts module answers: the token rows, their chosen experts and weights
# (gpt-oss names the last two router_indices and routing_weights).
EXPERTS_CALL = ("hidden_states", "top_k_index", "top_k_weights")

# Experts modules that run every token through every expert, called as forward(hidden_states) on the rows
# of all experts one after another ([E T, H]: expert e's are rows e T .. (e + 1) T), weights applied before.
EVERY_TOKEN_EXPERTS = frozenset({"Llama4TextExperts"})


def every_token(module: nn.Module) -> bool:
    """Whether `module` is of a declared every-token kind (`EVERY_TOKEN_EXPERTS`)."""
    return type(module).__name__ in EVERY_TOKEN_EXPERTS


def num_experts(module: nn.Module) -> int | None:
    """The experts a fused experts module holds (its `num_experts`), or None when it has no such count."""
    count = getattr(module, "num_experts", None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def experts_problem(module: nn.Module) -> str | None:
    """Why `module` cannot be split by expert, in a phrase; None when it can.

    It can when it answers `EXPERTS_CALL` (three arguments, the first the hidden states), says how many experts it holds, has parameters,
    and every parameter (and buffer) has the experts as its first dimension.
    """
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
    other = [f"{n} {tuple(t.shape)}" for n, t in tensors if t.dim() == 0 or t.shape[0] != count]
    if other:
        return (f"a {name} whose {', '.join(other[:3])} {'does' if len(other) == 1 else 'do'} not have its "
                f"{count} experts as first dimension")
    return None


def router_loss_parts(model: nn.Module) -> tuple | str | None:
    """(loss function, router class, output index, coefficient, experts, top k) of a model that adds its
    routers' loss; None when it adds none (`output_router_logits` off); why not, in words, when it would
    add one this cannot count."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    recorder = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    router = getattr(recorder, "target_class", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    if fn is None or router is None or not isinstance(experts, int) or not isinstance(top_k, int) or coef is None:
        return (f"{type(model).__name__} adds its routers' auxiliary loss (output_router_logits) in a way rewrite "
                "does not read (no load_balancing_loss_func and router_logits recorder, experts and top k)")
    return fn, router, getattr(recorder, "index", 0), float(coef), experts, top_k
