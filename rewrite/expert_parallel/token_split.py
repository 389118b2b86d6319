"""A stage's tokens shared out over its tp ranks before they are dispatched to their experts.

When ep borrows tp ranks (`plan.ranks.expert_groups`), the tp ranks of a replica hold the same tokens.
Each keeps its chunk (`c = ceil(T / tp)` rows, the last chunks shorter or empty) and sends only those to
their experts; the chunks' outputs are all-gathered over tp. The backward mirrors it: each rank keeps its
chunk of the (replicated) output gradient, and the gradients of the chunks' tokens and routing weights
are all-gathered, so every tp rank sees every token's gradient and the experts' gradients hold each token once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..tensor_parallel.comm import group_rank, group_size
from ..tensor_parallel.sequence import gather_from_sequence, scatter_to_sequence, sequence_chunk

__all__ = ["TokenSplit"]


@dataclass(frozen=True)
class TokenSplit:
    """This tp rank's chunk of `tokens` rows (along dim -2) of its `group`."""

    group: ProcessGroup
    tokens: int

    @staticmethod
    def over(group: ProcessGroup | None, tokens: int) -> TokenSplit | None:
        """The split of `tokens` rows over `group`; None when there is nothing to split (no group, or no row)."""
        if group is None or tokens == 0 or group_size(group) == 1:
            return None
        return TokenSplit(group, tokens)

    @property
    def chunk(self) -> int:
        return sequence_chunk(self.tokens, group_size(self.group))

    @property
    def start(self) -> int:
        return min(group_rank(self.group) * self.chunk, self.tokens)

    @property
    def count(self) -> int:
        """Rows this rank keeps (the last ranks may keep fewer, or none)."""
        return min(self.chunk, self.tokens - self.start)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `x` (..., T, d): (..., count, d). Differentiable: the backward all-gathers."""
        if not x.is_floating_point():
            return x.narrow(-2, self.start, self.count)
        return scatter_to_sequence(x, self.group).narrow(-2, 0, self.count)

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (..., count, d) gathered in order: (..., T, d). The backward keeps this rank's."""
        x = F.pad(x, (0, 0, 0, self.chunk - self.count))
        return gather_from_sequence(x, self.group, length=self.tokens, grad="split")
