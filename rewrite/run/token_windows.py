"""A token stream cut into windows of `seq_len + 1` tokens, drawn in shuffled epochs whose order is a pure
function of the seed and a cursor: all a resumed run needs to draw the same batches again.
"""

from __future__ import annotations

import torch

from .byte_data import TrainConfigError

__all__ = ["EpochOrder", "TokenWindows"]


class EpochOrder:
    """`count` items drawn in shuffled epochs: position `p` of the endless sequence is item
    `perm_e[p % count]` of epoch `e = p // count`, `perm_e = torch.randperm(count)` seeded with
    `seed * 1_000_003 + e`. A position (the cursor) is all a resumed run needs."""

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed = count, seed
        self._perms: dict[int, torch.Tensor] = {}  # epoch -> permutation, the last two used

    def permutation(self, epoch: int) -> torch.Tensor:
        """The item order of `epoch`, shape `(count,)`."""
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            if len(self._perms) >= 2:
                del self._perms[next(iter(self._perms))]  # oldest first: dicts keep insertion order
            self._perms[epoch] = torch.randperm(self.count, generator=generator)
        return self._perms[epoch]

    def items(self, cursor: int, count: int) -> torch.Tensor:
        """The items at positions `cursor .. cursor + count - 1`, shape `(count,)`.

        Raises:
            ValueError: a negative cursor or count.
        """
        if cursor < 0 or count < 0:
            raise ValueError(f"take(cursor={cursor}, count={count}): both must be >= 0")
        positions = torch.arange(cursor, cursor + count)  # (count,)
        epochs, slots = positions // self.count, positions % self.count
        chosen = torch.empty(count, dtype=torch.int64)
        for epoch in epochs.unique().tolist():
            here = epochs == epoch
            chosen[here] = self.permutation(epoch)[slots[here]]
        return chosen


class TokenWindows:
    """A token stream cut into windows of `seq_len + 1` tokens, drawn in shuffled epochs.

    Window `i` is `stream[i*seq_len : i*seq_len + seq_len + 1]`: consecutive windows share
    one token, so each token but the first is a target exactly once per epoch, save a
    dropped tail shorter than a window. Position `p` of the endless sequence of
    windows is window `perm_e[p % n]` of epoch `e = p // n`, where `perm_e` is
    `torch.randperm(n)` seeded with `seed * 1_000_003 + e`.

    The cursor (how many windows were taken so far) is the only state: a resumed run
    rebuilds the windows from the same text, seq_len and seed and passes the cursor it
    saved, and gets the same batches the first run would have, in any process.

    Example:
        >>> windows = TokenWindows(torch.arange(100), seq_len=8, seed=0)
        >>> inputs, targets = windows.take(0, 4)  # (4, 8) each; next call: take(4, ...)
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int) -> None:
        if stream.dim() != 1:
            raise ValueError(f"the token stream must be 1-D, got shape {tuple(stream.shape)}")
        if seq_len < 1:
            raise TrainConfigError(f"seq_len={seq_len} must be at least 1")
        count = (len(stream) - 1) // seq_len
        if count < 1:
            fix = f"use seq_len <= {len(stream) - 1} or pass more text" if len(stream) >= 2 else "pass more text"
            raise TrainConfigError(
                f"the training text is {len(stream)} tokens, too few for one window of seq_len + 1 = "
                f"{seq_len + 1} tokens; {fix}"
            )
        self.stream = stream.long()
        self.seq_len = seq_len
        self.seed = seed
        self._order = EpochOrder(count, seed)

    def __len__(self) -> int:
        return self._order.count

    def permutation(self, epoch: int) -> torch.Tensor:
        """The window order of `epoch`, shape `(len(self),)`."""
        return self._order.permutation(epoch)

    def take(self, cursor: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows at positions `cursor .. cursor + count - 1`, as inputs and targets.

        Returns:
            `(inputs, targets)`, each `(count, seq_len)` int64, `targets[:, :-1] == inputs[:, 1:]`.
        Raises:
            ValueError: a negative cursor or count.
        """
        windows = self._order.items(cursor, count)
        offsets = torch.arange(self.seq_len + 1)  # (seq + 1,)
        tokens = self.stream[windows.unsqueeze(1) * self.seq_len + offsets]  # (count, seq + 1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
