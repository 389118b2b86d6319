"""Ranks agree before they talk: one collective shares what every rank found and saw.

Each rank checks its own arguments, then all call `share` at the same point. Every rank
then holds every rank's findings and raises the same error, so a problem on one rank
never leaves its peers waiting in a collective it will not reach.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["share", "agree", "raise_problems", "ranks_by_value", "describe_ranks"]


def share(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (one collective on the default group)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def describe_ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0, 1, 2'."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def ranks_by_value(values: list[Any]) -> dict[Any, list[int]]:
    """Ranks grouped by the value they hold, groups in order of their first rank."""
    groups: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups


def raise_problems(per_rank: list[list[str]], what: str) -> None:
    """Raise one ValueError listing every rank's problems (the same text on every rank), if any."""
    texts = list(dict.fromkeys(p for found in per_rank for p in found))
    if not texts:
        return
    holders = {text: [r for r, found in enumerate(per_rank) if text in found] for text in texts}
    count = f"{len(holders)} problem" + ("s" if len(holders) != 1 else "")
    lines = [f"  {describe_ranks(r)}: {p}".replace("\n", "\n    ") for p, r in holders.items()]
    raise ValueError(f"{what}: {count}\n" + "\n".join(lines))


def agree(problems: list[str], what: str, *, view: Any = None) -> list[Any]:
    """Share every rank's problems and `view`; raise the same ValueError everywhere if any rank had a problem.

    Returns every rank's `view`, in rank order, when no rank had a problem.

    Example:
        >>> views = agree(my_problems, "save_pretrained", view=my_sizes)   # on every rank
    """
    gathered = share((problems, view))
    raise_problems([found for found, _ in gathered], what)
    return [v for _, v in gathered]
