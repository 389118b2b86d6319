"""One microbatch as a context-parallel rank holds it: its tokens of the ids, positions and targets.

Positions are the tokens' own (0 .. seq - 1, or a packed row's restarting ones), so rotary embeddings
see where each token is; the attention's `SequenceShard` keeps the whole row's documents. Each rank's
loss sums its own tokens; the runner divides by the global batch's count, so the cp ranks' losses add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from .attention import SequenceShard, sequence_shard
from .shard import held, shard_sequence

__all__ = ["SequencePart", "sequence_part"]


@dataclass(frozen=True)
class SequencePart:
    """This rank's part of one microbatch."""

    ids: torch.Tensor  # [mb, seq / cp]
    positions: torch.Tensor  # [mb, seq / cp]
    shard: SequenceShard
    targets: torch.Tensor | None  # [mb, seq / cp] (None where the stage computes no loss)


def sequence_part(ids: torch.Tensor, positions: torch.Tensor | None, targets: torch.Tensor | None, *,
                  group: ProcessGroup | None, cp: int, rank: int, device: torch.device) -> SequencePart:
    """This rank's part of a microbatch of whole `ids` `[mb, seq]` (and `positions`, `targets` alike)."""
    seq = ids.shape[-1]
    mine = held(seq, cp, rank).expand(ids.shape[0], -1) if positions is None else shard_sequence(positions, cp, rank)
    return SequencePart(
        ids=shard_sequence(ids, cp, rank).to(device),
        positions=mine.to(device),
        shard=sequence_shard(group, cp, rank, seq, device=device, position_ids=positions),
        targets=None if targets is None else shard_sequence(targets, cp, rank).to(device),
    )
