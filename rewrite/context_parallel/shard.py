"""Which tokens of a sequence each context-parallel rank holds, balanced for the causal mask.

The sequence of S tokens is cut into 2 cp chunks; rank r holds chunks r and 2 cp - 1 - r (Llama 3,
section 3.3.2, and torch's `context_parallel`): under a causal mask the early chunks attend to
little and the late ones to much, so each rank pairs one of each and does the same work. Every
rank holds the whole microbatch (ids, positions, targets) and keeps its own tokens of it.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..errors import InputError
from ..plan.ranks import length_problem

__all__ = ["length_problem", "held", "shard_sequence", "gathered_order"]


@lru_cache(maxsize=64)
def _held(seq: int, cp: int, rank: int) -> torch.Tensor:
    chunk = seq // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)])


def held(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global indices of the `seq / cp` tokens rank `rank` holds, in the order it holds them.

    Raises:
        InputError: `seq` does not split into 2 cp chunks (`length_problem`).
    """
    if problem := length_problem(seq, cp):
        raise InputError(problem)
    return _held(seq, cp, rank).to(device)


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` along `dim` (the sequence): two chunks, concatenated."""
    return x.index_select(dim, held(x.shape[dim], cp, rank, x.device))


@lru_cache(maxsize=64)
def _order(seq: int, cp: int) -> torch.Tensor:
    rank_major = torch.cat([_held(seq, cp, r) for r in range(cp)])  # global index of each gathered row
    return torch.argsort(rank_major)


def gathered_order(seq: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[seq]`: for each global index, its row among the ranks' shards gathered in rank order."""
    return _order(seq, cp).to(device)
