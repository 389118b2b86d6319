"""Microbatches: a tensor of token ids `[mb, seq]`, or a dict with `input_ids` and `position_ids` of that
shape; and a replica's microbatches cut from a global batch, with next-token targets.

Positions restart at 0 where a document starts, so documents packed into one row attend only to
themselves (the model's mask builders read the restarts, as Hugging Face models do under
`DataCollatorWithFlattening`). Every rank holds the same microbatches, so every stage reads a
microbatch's positions from its own copy: nothing but hidden states crosses a stage boundary.

Each data-parallel replica passes its own rows of the global batch: replica d of dp
takes rows `[d * b / dp, (d + 1) * b / dp)`, so the replicas cover the batch once.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from ..errors import InputError
from ..models.oracle import packing_problem
from ..tensor_parallel.loss import IGNORE_INDEX

__all__ = ["microbatches", "KEYS", "ids_of", "positions_of", "packing_of", "integer_dtype"]

KEYS = ("input_ids", "position_ids")


def ids_of(x):
    """The token ids of a microbatch (the tensor itself when it carries no positions)."""
    return x["input_ids"] if isinstance(x, Mapping) else x


def positions_of(x) -> torch.Tensor | None:
    """The microbatch's `position_ids`, or None: positions 0 .. seq - 1 in every row."""
    return x["position_ids"] if isinstance(x, Mapping) else None


_PACKING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> packing_problem(model), once


def packing_of(stage) -> str | None:
    """Why the stage's model cannot take packed documents (`models.oracle.packing_problem`), or None."""
    if not stage.takes_token_ids:
        return None  # refused as a traced model's dicts
    if stage.model not in _PACKING:
        _PACKING[stage.model] = packing_problem(stage.model)
    return _PACKING[stage.model]


def _multiples(step: int, near: int) -> str:
    # The multiples of `step` either side of `near`, for a message: "4 or 8".
    below, above = (near // step) * step, (near // step + 1) * step
    return f"{below} or {above}" if below > 0 else f"{above}"


def microbatches(ids: torch.Tensor, n: int, *, dp_rank: int = 0, dp: int = 1, position_ids: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None) -> tuple[list, list[torch.Tensor]]:
    """This replica's share of a global batch, cut into `n` microbatches of inputs and targets.

    Args:
        ids: token ids of the global batch, `[batch, seq]`, the same on every rank.
        n: microbatches per step (the plan's `pipeline.microbatches`).
        dp_rank, dp: this rank's replica and the number of replicas (`stage.dp_rank`, `stage.dp`).
        position_ids: `[batch, seq]`, each token's position in its document (packed documents).
            Default: one sequence a row (0 .. seq - 1).
        labels: `[batch, seq]`, the tokens to predict, aligned with `ids` (Hugging Face's
            convention: -100 where no loss is counted, e.g. a chat's prompt). Default: `ids`.

    Returns:
        `(inputs, targets)`: `n` each, `[batch / dp / n, seq]`. Inputs are the ids, or dicts of
        `input_ids` and `position_ids` when positions are given; targets the labels shifted left
        by one, with -100 (ignored) where a token has no next one in its document (the row's
        last, a packed document's last), so `causal_lm_loss(logits, target)` is next-token prediction.

    Raises:
        TypeError: `ids`, `position_ids` or `labels` is not an integer tensor.
        ValueError: `ids` is not `[batch, seq]` or the others not of its shape; a negative position;
            dp does not divide the batch; n does not divide this replica's rows; a count below 1 or
            a dp_rank outside `[0, dp)`.

    Example:
        >>> inputs, targets = microbatches(ids, 4, dp_rank=stage.dp_rank, dp=stage.dp)
        >>> loss = rewrite.run_schedule(stage, inputs, targets)
    """
    _integers("ids", ids)
    if ids.dim() != 2:
        raise InputError(f"microbatches: ids must be [batch, seq], got shape {list(ids.shape)}; add a batch dimension with ids[None]")
    for name, given in (("position_ids", position_ids), ("labels", labels)):
        if given is not None:
            _integers(name, given)
            if given.shape != ids.shape:
                raise InputError(f"microbatches: {name} is {list(given.shape)} but ids are {list(ids.shape)}: one per token")
    if position_ids is not None and bool((position_ids < 0).any()):
        raise InputError("microbatches: position_ids hold a negative position; positions count from 0 where each document starts")
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
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    chosen = (ids if labels is None else labels)[mine].long()  # (batch / dp, seq)
    targets = torch.full_like(chosen, IGNORE_INDEX)
    targets[:, :-1] = chosen[:, 1:]  # position t predicts token t + 1; the last has no next token
    if position_ids is None:
        return list(ids[mine].chunk(n)), list(targets.chunk(n))  # n x (batch / dp / n, seq)
    positions = position_ids[mine]
    # A document's last token (the row's, or where positions restart) predicts nothing of the next.
    ends = torch.ones_like(positions, dtype=torch.bool)
    ends[:, :-1] = positions[:, 1:] != positions[:, :-1] + 1
    targets[ends] = IGNORE_INDEX
    inputs = [{"input_ids": i, "position_ids": p} for i, p in zip(ids[mine].chunk(n), positions.chunk(n))]
    return inputs, list(targets.chunk(n))


def integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _integers(name: str, x) -> None:
    if not isinstance(x, torch.Tensor) or not integer_dtype(x.dtype):
        found = type(x).__name__ if not isinstance(x, torch.Tensor) else f"a {x.dtype} tensor"
        what = "token ids" if name == "ids" else name
        raise TypeError(f"microbatches: {name} must be a tensor of integer {what}, got {found}")
