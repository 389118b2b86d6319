"""A plan's module patterns: `*` within one dotted segment, and what to say when one matches nothing."""

from __future__ import annotations

import difflib
import re
from fnmatch import fnmatchcase
from functools import lru_cache

__all__ = ["match_pattern", "closest", "unmatched_problem", "general_path"]


@lru_cache(maxsize=1 << 17)  # a plan search binds the same few rules to every module of a model dozens of times
def match_pattern(pattern: str, fqn: str) -> bool:
    """`*` matches within one dotted segment; segment counts must agree."""
    pat, parts = pattern.split("."), fqn.split(".")
    return len(pat) == len(parts) and all(fnmatchcase(p, q) for q, p in zip(pat, parts))


def general_path(fqn: str) -> str:
    """`fqn` with every layer index a `*`: 'model.layers.*.mlp' for 'model.layers.3.mlp'."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", fqn)


def closest(name: str, candidates: list[str]) -> str:
    general = {general_path(c) for c in candidates}
    pool = sorted(general | set(candidates)) if "*" in name else candidates
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unmatched_problem(at: str, key: str, pattern: str, names: list[str]) -> str:
    """'line 3: tensor_parallel['...'] matches no module; did you mean '...'?' (`key`: the plan's section)."""
    return f"{at}{key}[{pattern!r}] matches no module{closest(pattern, names)}"
