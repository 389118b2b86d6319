"""Whether a model family runs under context parallelism: checked on a tiny clone, one process.

The clone runs its own forward on a few packed documents with its usual attention and with the
context-parallel one at cp 1 (same mask predicates, no gather); a family that disagrees or fails (kwargs
not passed down, soft caps, sinks, chunked attention) is refused by name.
"""

from __future__ import annotations


import torch
from torch import nn

from ..models.hf_decoder import RECURRENT_KINDS
from ..models.oracle import PACKED_LEAK, TOLERANCE, exception_line, on_tiny_clone, packing_problem, perturbed
from ..models.tiny_clone import tiny_run
from .attention import NAME, register, sequence_shard

__all__ = ["context_parallel_problem"]


def context_parallel_problem(model: nn.Module) -> str | None:
    """Why `model`'s family cannot run with mesh.cp > 1, or None when it can (cached per config)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return f"{type(model).__name__} is not a Hugging Face decoder model: context parallelism runs the model's own " \
               "attention through transformers' attention interface"
    recurrent = sorted(set(getattr(config, "layer_types", None) or ()) & RECURRENT_KINDS)
    if recurrent:  # refused by kind, even where its own forward keeps packed documents apart
        return (f"{config.model_type}'s {', '.join(recurrent)} layers carry a state along the whole sequence, which "
                "a rank holding part of the sequence cannot continue")
    mixing = packing_problem(model)  # anything but the masked attention carrying tokens into others
    if mixing is not None and PACKED_LEAK in mixing:
        return (f"{config.model_type}'s layers mix tokens outside attention (a convolution or recurrent state, or "
                "attention that ignores its mask: packed documents reach each other), which a rank holding part of "
                "the sequence cannot compute")
    return on_tiny_clone(model, "context parallelism against", _check)


def _check(model_class: type, config) -> str | None:
    family = config.model_type
    register()
    with tiny_run():
        tiny = perturbed(model_class, config)
        ids = torch.randint(0, config.vocab_size, (1, 8))
        positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
        try:
            expected = tiny(input_ids=ids, position_ids=positions, use_cache=False).logits
            tiny.set_attn_implementation(NAME)
            shard = sequence_shard(None, 1, 0, 8, device="cpu", position_ids=positions)
            got = tiny(input_ids=ids, position_ids=positions, sequence_shard=shard, use_cache=False).logits
        except Exception as exc:
            if "without its sequence_shard" in str(exc):
                return (f"{family}'s layers do not pass their keyword arguments on to the attention function, "
                        "which needs the rank's sequence shard")
            return f"{family}'s layers do not run with context-parallel attention ({exception_line(exc)})"
    worst = (got - expected).abs().max().item()
    if worst > TOLERANCE:
        return (f"{family}'s attention is not what context-parallel attention computes (max |difference| {worst:.3g} "
                "on a tiny clone): its mask or its attention arguments (soft cap, sinks, chunks) are not causal, "
                "sliding-window and documents alone")
    return None
