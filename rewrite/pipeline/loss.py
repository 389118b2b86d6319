"""The loss the runner computes on the last stage, with or without vocabulary shards.

With `loss_parallel`, the last stage ends with this rank's `[..., vocab / tp]` slice of
the logits. The default loss is then the vocabulary-parallel cross-entropy; a user
loss declared with `takes_logit_shards` receives the slice and a `LogitShard`; any
other user loss receives the full logits, gathered for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed import ProcessGroup
from torch.nn import functional as F

from ..tensor_parallel.comm import gather_from_parallel
from ..tensor_parallel.loss import IGNORE_INDEX, vocab_parallel_cross_entropy

__all__ = ["LogitShard", "causal_lm_loss", "takes_logit_shards", "returns_token_sums", "sums_tokens", "loss_for"]

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class LogitShard:
    """Which vocabulary columns `[start, stop)` of `vocab_size` this rank's logits hold, over `group`."""

    start: int
    stop: int
    vocab_size: int
    group: ProcessGroup


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, *, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the vocabulary in float32, targets already aligned, -100 ignored: the "mean"
    over the counted tokens, or their "sum"."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def takes_logit_shards(loss_fn: LossFn) -> LossFn:
    """Declare that `loss_fn(logits, targets, shard)` works on vocabulary shards (loss_parallel).

    Under `loss_parallel: true` the runner then passes this rank's `[..., vocab / tp]`
    slice of the logits and a `LogitShard`; the function must reduce over
    `shard.group` itself and return the same loss on every rank. Undeclared losses get
    full logits (gathered, which costs what loss parallelism saves).

    Example:
        >>> @rewrite.takes_logit_shards
        ... def loss(logits, targets, shard):
        ...     return rewrite.vocab_parallel_cross_entropy(logits, targets, shard.group, vocab_start=shard.start)
    """
    loss_fn.takes_logit_shards = True
    return loss_fn


def returns_token_sums(loss_fn: LossFn) -> LossFn:
    """Declare that `loss_fn(output, targets)` returns the sum of its tokens' losses, not their mean.

    The runner then divides each microbatch's sum by the global batch's targets other than -100,
    as for the default cross-entropy (see `run_schedule`); such a loss also runs under context
    parallelism, on each rank's part of the sequence.

    Example:
        >>> @rewrite.returns_token_sums
        ... def loss(logits, targets):
        ...     return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum")
    """
    loss_fn.returns_token_sums = True
    return loss_fn


def sums_tokens(loss_fn: LossFn | None) -> bool:
    """Whether the step divides `loss_fn`'s values by the global batch's trained tokens (the default loss does)."""
    return loss_fn is None or bool(getattr(loss_fn, "returns_token_sums", False))


def loss_for(shard: LogitShard | None, loss_fn: LossFn | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The `(output, targets) -> loss` the last stage runs, given its logit shard (or None): the default
    returns the sum over the counted tokens."""
    if shard is None:
        return loss_fn or partial(causal_lm_loss, reduction="sum")
    if loss_fn is None:
        return lambda logits, targets: vocab_parallel_cross_entropy(
            logits, targets, shard.group, vocab_start=shard.start, reduction="sum"
        )
    if getattr(loss_fn, "takes_logit_shards", False):
        return lambda logits, targets: loss_fn(logits, targets, shard)
    return lambda logits, targets: loss_fn(gather_from_parallel(logits, shard.group), targets)
