"""Which tokens of a sequence each context-parallel rank holds, balanced for the causal mask.

The sequence of S tokens is cut into 2 cp chunks; rank r holds chunks r and 2 cp - 1 - r (Llama 3,
section 3.3.2, and torch's `context_parallel`): under a causal mask the early chunks attend to little
and the late ones to much, so each rank pairs one of each and does the same work.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..errors import InputError
from ..plan.ranks import length_problem

__all__ = ["length_problem", "held", "shard_sequence", "gathered_order"]


def held(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global indices of the `seq / cp` tokens rank `rank` holds, in the order it holds them (cached;
    under torch.compile computed where traced, which makes them the graph's constants).

    Raises:
        InputError: `seq` does not split into 2 cp chunks (`length_problem`).
    """
    return (_held if torch.compiler.is_compiling() else _held_cached)(seq, cp, rank, device)


def _held(seq: int, cp: int, rank: int, device: torch.device | str) -> torch.Tensor:
    if problem := length_problem(seq, cp):
        raise InputError(problem)
    chunk, second = seq // (2 * cp), 2 * cp - 1 - rank
    starts = (rank * chunk, second * chunk)
    return torch.cat([torch.arange(start, start + chunk) for start in starts]).to(device)


_held_cached = lru_cache(maxsize=64)(_held)


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` along `dim` (the sequence): two chunks, concatenated."""
    return x.index_select(dim, held(x.shape[dim], cp, rank, x.device))


def _order(seq: int, cp: int) -> torch.Tensor:
    rank_major = torch.cat([held(seq, cp, r) for r in range(cp)])  # global index of each gathered row
    return torch.argsort(rank_major)


_order_cached = lru_cache(maxsize=64)(_order)


def gathered_order(seq: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[seq]`: for each global index, its row among the ranks' shards gathered in rank order."""
    return (_order if torch.compiler.is_compiling() else _order_cached)(seq, cp).to(device)
