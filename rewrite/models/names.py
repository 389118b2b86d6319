"""Parameter paths when weights are shared: one walk, read by the tp rules, checkpoints and dp.

A tied weight (the embedding reused as the head) is one tensor at two paths; `named_parameters()`
lists it once, at its first path, and `named_parameters(remove_duplicate=False)` at both.
"""

from __future__ import annotations

from torch import nn

__all__ = ["canonical_names", "first_names", "tied_modules"]


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter path -> the first path holding the same tensor (itself unless tied)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}


def first_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first path (find a parameter again after a wrapper replaced it)."""
    return {id(p): name for name, p in model.named_parameters()}


def tied_modules(model: nn.Module) -> dict[str, str]:
    """Module path -> the first path of the weight it shares, for each module holding a tied weight's later path."""
    return {name.rsplit(".", 1)[0]: first for name, first in canonical_names(model).items() if name != first}
