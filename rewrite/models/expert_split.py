"""Each expert split over tensor-parallel ranks: which dim of a fused experts tensor holds its features.

Split as a dense MLP is (column then row), each rank holds every expert's slice of the intermediate
features (of gate's and up's in `gate_up_proj`, the same slice of `down_proj`'s inputs); the module's
forward on them gives a partial output, summed over tp (`expert_parallel.tensor`). The dim depends on
the family's layout (`[E, 2I, H]` and `[E, H, I]`, or Aria's and Llama 4's `[E, H, 2I]` and `[E, I, H]`):
its own tp plan says, in transformers' style names (`packed_colwise` / `colwise`: dim 1,
`packed_rowwise` / `rowwise`: dim 2). `tp_layout` reads it; `split_problem` checks on a tiny clone
that two ranks' slices add up to the forward whole.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .experts import every_token, identity_experts, num_experts
from .names import general_path, match_pattern
from .oracle import exception_line, on_tiny_clone
from .tiny_clone import tiny_run

__all__ = ["tp_layout", "split_problem", "take_features"]

# transformers' style for a 3-D experts tensor -> (its dim, before the last two: 1 or 2; packed parts).
_HF_STYLES = {"packed_colwise": (1, 2), "packed_rowwise": (2, 2), "colwise": (1, 1), "rowwise": (2, 1),
              "local_colwise": (1, 1), "local_rowwise": (2, 1)}
_TINY_EXPERTS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
                 "moe_intermediate_size": 32, "expert_intermediate_size": 32}


def tp_layout(model: nn.Module, fqn: str, module: nn.Module) -> dict[str, tuple[int, int]] | str:
    """{tensor name: (dim, packed parts)} of each tensor of experts module `fqn`, from the family's
    tensor-parallel plan; why not, in a phrase, when a tensor is not split by it."""
    config = getattr(model, "config", None)
    rules = dict(getattr(config, "base_model_tp_plan", None) or {})
    name = type(module).__name__
    if identity_experts(module):
        return (f"a {name} with identity experts, whose rows every rank would add again (tp times): it is split "
                "by expert only")
    out, missing = {}, []
    for leaf, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        styles = [s for k, s in rules.items() if _matches_tail(k, f"{fqn}.{leaf}")]
        if tensor.dim() != 3 or len(styles) != 1 or styles[0] not in _HF_STYLES:
            missing.append(f"{leaf} {list(tensor.shape)}" + (f" ({styles[0]})" if styles else ""))
            continue
        out[leaf] = _HF_STYLES[styles[0]]
    if missing or not out:
        return (f"a {name} whose {', '.join(missing) or 'tensors'} {type(config).__name__}'s tensor-parallel plan does "
                "not split by expert features (a 3-D tensor, colwise or rowwise)")
    return out


def _matches_tail(pattern: str, path: str) -> bool:
    """Whether the base model's rule `pattern` names `path` (of the causal LM: under its base model's
    attribute, whatever the family calls it)."""
    width = pattern.count(".") + 1
    return path.count(".") + 1 >= width and match_pattern(pattern, ".".join(path.split(".")[-width:]))


def take_features(tensor: torch.Tensor, dim: int, parts: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice of each of the `parts` packed parts along `dim`, side by side."""
    chunks = tensor.chunk(parts, dim=dim)
    return torch.cat([c.chunk(tp, dim=dim)[rank] for c in chunks], dim=dim)


def split_problem(model: nn.Module, fqn: str, layout: dict[str, tuple[int, int]]) -> str | None:
    """Why `model`'s experts module `fqn`, split over tp as `layout` says, would not give its whole output
    (summed over the ranks); None when it does. Checked on a tiny clone of the config (4 experts of width
    32), at tp 2, cached per class and config."""
    template = general_path(fqn)
    return on_tiny_clone(model, "its experts split over tp", _check, template, tuple(sorted(layout.items())),
                         sizes=_TINY_EXPERTS)


def _check(model_class: type, config, template: str, layout: tuple) -> str | None:
    with tiny_run():
        try:
            tiny = model_class(config).float()
        except Exception as exc:  # noqa: BLE001
            return f"cannot build a tiny {config.model_type} model to check its experts split over tp ({exception_line(exc)})"
        found = [m for n, m in tiny.named_modules() if n and match_pattern(template, n)]
        if not found:
            return f"a tiny {config.model_type} model has no {template} to check its experts split over tp against"
        whole = found[0]
        gen = torch.Generator().manual_seed(0)
        for tensor in [*whole.parameters(), *whole.buffers()]:
            if tensor.is_floating_point():
                tensor.data = torch.randn(tensor.shape, generator=gen) * 0.1
        args = _call(whole, config, gen)
        try:
            want = whole(*args)
            got = sum(_rank(whole, dict(layout), rank)(*args) for rank in range(2))
        except Exception as exc:  # noqa: BLE001
            return f"{type(whole).__name__}.forward fails on one rank's slice of each expert ({exception_line(exc)})"
        if not isinstance(want, torch.Tensor) or want.shape != got.shape or not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            return (f"{type(whole).__name__}.forward on two ranks' slices of each expert does not add up to its output "
                    "whole (it reads the experts' width or mixes features across the split)")
    return None


def _rank(whole: nn.Module, layout: dict, rank: int) -> nn.Module:
    part = copy.deepcopy(whole)
    for leaf, (dim, parts) in layout.items():
        tensor = getattr(part, leaf)
        sliced = take_features(tensor.detach(), dim, parts, 2, rank).clone()
        if isinstance(tensor, nn.Parameter):
            setattr(part, leaf, nn.Parameter(sliced))
        else:
            part.register_buffer(leaf, sliced)
    return part


def _call(module: nn.Module, config, gen: torch.Generator) -> tuple:
    """Arguments for `module`'s forward: 6 tokens, each with 2 chosen experts and weights (every-token
    experts: each expert's rows of them, weighted)."""
    hidden, experts = config.hidden_size, num_experts(module)
    rows = torch.randn(6, hidden, generator=gen)
    if every_token(module):
        return (rows.repeat(experts, 1) * torch.rand(experts * 6, 1, generator=gen),)
    index = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(6)])
    return rows, index, torch.rand(6, 2, generator=gen)  # as EXPERTS_CALL names them
