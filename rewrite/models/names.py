"""Module and parameter paths: patterns with `*` for a layer index, and the paths of a weight shared by two
modules (one walk, read by the tp rules, checkpoints and dp).

A tied weight (the embedding reused as the head) is one tensor at two paths; `named_parameters()`
lists it once, at its first path, and `named_parameters(remove_duplicate=False)` at both.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from functools import lru_cache

from torch import nn

__all__ = ["canonical_names", "first_names", "tied_modules", "match_pattern", "general_path"]


@lru_cache(maxsize=1 << 17)  # a plan search binds the same few rules to every module of a model dozens of times
def match_pattern(pattern: str, fqn: str) -> bool:
    """`*` matches within one dotted segment; segment counts must agree."""
    pat, parts = pattern.split("."), fqn.split(".")
    return len(pat) == len(parts) and all(fnmatchcase(p, q) for q, p in zip(pat, parts))


def general_path(fqn: str) -> str:
    """`fqn` with every layer index a `*`: 'model.layers.*.mlp' for 'model.layers.3.mlp'."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


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
