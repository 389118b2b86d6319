"""Single-process reference checks for rewritten models."""

from __future__ import annotations

import torch
from torch import nn

from rewrite import ColumnParallelLinear, RowParallelLinear
from tests.asserts import assert_close


def expected_shard(model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """The slice of the reference tensor `full` that the rewritten parameter `name` holds."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(owner, ColumnParallelLinear):
        n = owner.out_per_rank
        return full[owner.tp_rank * n : (owner.tp_rank + 1) * n]
    if isinstance(owner, RowParallelLinear) and leaf == "weight":
        n = owner.in_per_rank
        return full[:, owner.tp_rank * n : (owner.tp_rank + 1) * n]
    return full


def assert_grads_match(model: nn.Module, reference: nn.Module, *, atol: float = 1e-5, prefix: str = "") -> int:
    """Every parameter's gradient equals the reference's (its slice, when sharded)."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    checked = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        assert name in ref, f"{prefix}{name}: no parameter of that name in the reference model"
        assert_close(f"{prefix}{name}.grad", param.grad, expected_shard(model, name, ref[name].grad), atol=atol)
        checked += 1
    return checked


def assert_params_match(model: nn.Module, reference: nn.Module, *, atol: float = 0.0, prefix: str = "") -> None:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        assert_close(f"{prefix}{name}", param.detach(), expected_shard(model, name, ref[name].detach()), atol=atol)
