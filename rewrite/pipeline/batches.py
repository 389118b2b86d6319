"""A replica's microbatches from a global batch of token ids, with next-token targets.

Each data-parallel replica passes its own rows of the global batch: replica d of dp
takes rows `[d * b / dp, (d + 1) * b / dp)`, so the replicas cover the batch once.
"""

from __future__ import annotations

import torch

from ..tensor_parallel.loss import IGNORE_INDEX
from ..errors import InputError

__all__ = ["microbatches"]


def _multiples(step: int, near: int) -> str:
    # The multiples of `step` either side of `near`, for a message: "4 or 8".
    below, above = (near // step) * step, (near // step + 1) * step
    return f"{below} or {above}" if below > 0 else f"{above}"


def microbatches(
    ids: torch.Tensor, n: int, *, dp_rank: int = 0, dp: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This replica's share of a global batch, cut into `n` microbatches of inputs and targets.

    Args:
        ids: token ids of the global batch, `[batch, seq]`, the same on every rank.
        n: microbatches per step (the plan's `pipeline.microbatches`).
        dp_rank: this rank's replica (`stage.dp_rank`).
        dp: the number of replicas (`stage.dp`).

    Returns:
        `(inputs, targets)`: `n` tensors each, `[batch / dp / n, seq]`. Inputs are the ids;
        targets the ids shifted left by one, with -100 (ignored) in the last position, so
        `causal_lm_loss(logits, target)` is next-token prediction.

    Raises:
        TypeError: `ids` is not an integer tensor.
        ValueError: `ids` is not `[batch, seq]`; dp does not divide the batch; n does not
            divide this replica's rows; a count below 1 or a dp_rank outside `[0, dp)`.

    Example:
        >>> inputs, targets = microbatches(ids, 4, dp_rank=stage.dp_rank, dp=stage.dp)
        >>> loss = rewrite.run_schedule(stage, inputs, targets)
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        found = type(ids).__name__ if not isinstance(ids, torch.Tensor) else f"a {ids.dtype} tensor"
        raise TypeError(f"microbatches: ids must be a tensor of integer token ids, got {found}")
    if ids.dim() != 2:
        raise InputError(f"microbatches: ids must be [batch, seq], got shape {list(ids.shape)}; add a batch dimension with ids[None]")
    if n < 1 or dp < 1:
        raise InputError(f"microbatches: n={n} and dp={dp} must both be >= 1")
    if not 0 <= dp_rank < dp:
        raise InputError(f"microbatches: dp_rank={dp_rank} is outside [0, {dp}); pass stage.dp_rank")
    batch = ids.shape[0]
    if batch == 0:
        raise InputError(f"microbatches: the global batch is empty; pass at least {dp * n} rows (dp={dp} x n={n})")
    if batch % dp:
        raise InputError(
            f"microbatches: the global batch has {batch} rows, which dp={dp} replicas cannot share evenly; "
            f"use a multiple of {dp} rows (e.g. {_multiples(dp, batch)}), or of {dp * n} for {n} microbatches each"
        )
    rows = batch // dp
    if rows % n:
        divisors = [d for d in range(1, rows + 1) if rows % d == 0]
        raise InputError(
            f"microbatches: each replica gets {rows} rows ({batch} / dp={dp}), which {n} microbatches cannot "
            f"split evenly; use n in {divisors} or a global batch of {_multiples(dp * n, batch)} rows"
        )
    mine = ids[dp_rank * rows : (dp_rank + 1) * rows]  # (batch / dp, seq)
    targets = torch.full_like(mine, IGNORE_INDEX, dtype=torch.long)
    targets[:, :-1] = mine[:, 1:]  # position t predicts token t + 1; the last has no next token
    return list(mine.chunk(n)), list(targets.chunk(n))  # n x (batch / dp / n, seq)
