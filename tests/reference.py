"""Single-process reference checks for rewritten models."""

from __future__ import annotations

from torch import nn

from rewrite.tensor_parallel.layers import local_shard
from tests.asserts import assert_close


def assert_grads_match(model: nn.Module, reference: nn.Module, *, atol: float = 1e-5, prefix: str = "") -> int:
    """Every parameter's gradient equals the reference's (its slice, when sharded)."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    checked = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        assert name in ref, f"{prefix}{name}: no parameter of that name in the reference model"
        assert_close(f"{prefix}{name}.grad", param.grad, local_shard(model, name, ref[name].grad), atol=atol)
        checked += 1
    return checked


def assert_params_match(model: nn.Module, reference: nn.Module, *, atol: float = 0.0, prefix: str = "") -> None:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        assert_close(f"{prefix}{name}", param.detach(), local_shard(model, name, ref[name].detach()), atol=atol)
