"""A plan's module patterns: `*` within one dotted segment, and what to say when one matches nothing."""

from __future__ import annotations

import difflib

from ..models.names import general_path, match_pattern

__all__ = ["match_pattern", "closest", "unmatched_problem", "general_path"]


def closest(name: str, candidates: list[str]) -> str:
    general = {general_path(c) for c in candidates}
    pool = sorted(general | set(candidates)) if "*" in name else candidates
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unmatched_problem(at: str, key: str, pattern: str, names: list[str]) -> str:
    """'line 3: tensor_parallel['...'] matches no module; did you mean '...'?' (`key`: the plan's section)."""
    return f"{at}{key}[{pattern!r}] matches no module{closest(pattern, names)}"
