"""Ranks agree before they talk: one collective shares what every rank found and saw, so every rank
raises the same error and a problem on one never leaves its peers waiting in a collective it will not reach.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .errors import InputError
from .lent import lend
from .plan.wording import noun_for, plural

__all__ = ["share", "agree", "raise_problems", "ranks_by_value", "describe_ranks"]


def share(value: Any, *, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value` (picklable), in the group's rank order (default: the whole world).

    `all_gather_object`'s way (sizes first, then the padded bytes), on tensors of our own, so
    they are lent (see `lent`) and a rank exiting right after cannot abort.
    """
    n = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
    size = torch.tensor([mine.numel()], device=device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = F.pad(mine, (0, longest - mine.numel()))
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    lend(size, *sizes, padded, *parts)
    return [pickle.loads(p[: int(s)].cpu().numpy().tobytes()) for p, s in zip(parts, sizes)]


def describe_ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0, 1, 2'."""
    return f"{noun_for(len(ranks), 'rank')} {', '.join(map(str, ranks))}"


def ranks_by_value(values: list[Any]) -> dict[Any, list[int]]:
    """Ranks grouped by the value they hold, groups in order of their first rank."""
    groups: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups


def raise_problems(per_rank: list[list[str]], what: str, error: type[Exception] = InputError) -> None:
    """Raise one `error` listing every rank's problems (the same text on every rank), if any."""
    texts = list(dict.fromkeys(p for found in per_rank for p in found))
    if not texts:
        return
    holders = {text: [r for r, found in enumerate(per_rank) if text in found] for text in texts}
    if len(holders) == 1:  # one cause: said once, without a "1 problem" header over its own list
        (text, ranks), = holders.items()
        raise error(f"{what}: {describe_ranks(ranks)}: {text}")
    count = plural(len(holders), "problem")
    lines = [f"  {describe_ranks(r)}: {p}".replace("\n", "\n    ") for p, r in holders.items()]
    raise error(f"{what}: {count}\n" + "\n".join(lines))


def agree(problems: list[str], what: str, *, view: Any = None, error: type[Exception] = InputError) -> list[Any]:
    """Share every rank's problems and `view`; raise the same `error` everywhere if any rank had a problem,
    else return every rank's `view`, in rank order.

    Example:
        >>> views = agree(my_problems, "save_pretrained", view=my_sizes)   # on every rank
    """
    gathered = share((problems, view))
    raise_problems([found for found, _ in gathered], what, error)
    return [v for _, v in gathered]
