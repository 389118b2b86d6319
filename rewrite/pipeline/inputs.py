"""A step's microbatches, checked on every rank and agreed on in one collective.

Each rank checks what it can see (token ids inside the vocabulary, targets a
cross-entropy accepts); then one collective shares every rank's problems and its view
of the microbatches (count, shapes, dtypes). Any problem or difference raises the same
ValueError on every rank, naming the rank and the tensor, before any tensor is sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..agreement import agree, describe_ranks, ranks_by_value
from ..tensor_parallel.loss import IGNORE_INDEX
from .stage import Stage
from ..errors import InputError

__all__ = ["check_step_inputs"]


def check_step_inputs(stage: Stage, inputs, targets, *, default_loss: bool, what: str = "run_schedule") -> None:
    """Raise the same ValueError on every rank if any rank's microbatches are bad or ranks' differ.

    Collective: every rank calls it before its step's first transfer.

    Args:
        stage: this rank's `Stage`.
        inputs: this rank's list of model inputs, one per microbatch.
        targets: this rank's targets (read on the last stage).
        default_loss: targets go to the default cross-entropy, so they must be class
            ids in `[0, classes)` or -100.
        what: the caller's name, for the message.
    """
    problems = _local_problems(stage, inputs, targets, default_loss)
    views = agree(problems, what, view=_describe(inputs))
    groups = ranks_by_value(views)
    if len(groups) > 1:
        seen = "; ".join(f"{describe_ranks(r)}: {v}" for v, r in groups.items())
        raise InputError(
            f"{what}: ranks were given different microbatches ({seen}); pass the same microbatches "
            "(count, shapes, dtypes) on every rank: later stages size their transfers from them"
            + ("; data-parallel replicas pass their own microbatches, all of the same count, shapes and dtypes"
               if stage.mesh.dp > 1 else "")
        )


def _is_tensor_list(values) -> bool:
    return isinstance(values, Sequence) and len(values) > 0 and all(isinstance(x, torch.Tensor) for x in values)


def _kind(x: torch.Tensor) -> str:
    return f"[{', '.join(map(str, x.shape))}] {str(x.dtype).removeprefix('torch.')}"


def _describe(inputs) -> str:
    """'4 x [2, 16] int64' when uniform, else every microbatch's shape and dtype."""
    if not _is_tensor_list(inputs):
        return "no list of tensors"
    kinds = [_kind(x) for x in inputs]
    return f"{len(kinds)} x {kinds[0]}" if len(set(kinds)) == 1 else f"{len(kinds)}: " + ", ".join(kinds)


def _names(what: str, indices: list[int], shown: int = 3) -> str:
    """'inputs[0], inputs[1]' or 'inputs[0], inputs[1], inputs[2] and 5 more'."""
    names = ", ".join(f"{what}[{i}]" for i in indices[:shown])
    return names + (f" and {len(indices) - shown} more" if len(indices) > shown else "")


def _is_integer(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def _first_outside(x: torch.Tensor, low: int, high: int | None, *, allow: int | None = None) -> str | None:
    """'id 300 at (0, 5)' for the first value outside [low, high) (and not `allow`), else None."""
    bad = x < low if high is None else (x < low) | (x >= high)
    if allow is not None:
        bad &= x != allow
    if not bool(bad.any()):
        return None
    where = tuple(bad.nonzero()[0].tolist())
    return f"{int(x[where])} at {where}"


def _local_problems(stage: Stage, inputs, targets, default_loss: bool) -> list[str]:
    if not isinstance(stage, Stage):
        return [f"needs the Stage returned by apply_plan, got {type(stage).__name__}"]
    if not _is_tensor_list(inputs):
        got = f"a tensor of shape {list(inputs.shape)}" if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        return [f"inputs must be a non-empty list of tensors, one per microbatch (on every rank), got {got}; "
                "cut a [batch, seq] batch of token ids with `inputs, targets = rewrite.microbatches(ids, "
                "stage.resolved.plan.pipeline.microbatches, dp_rank=stage.dp_rank, dp=stage.dp)`"]
    problems = []
    if stage.takes_token_ids:
        vocab = stage.vocab_size
        not_ids = [i for i, x in enumerate(inputs) if x.dim() != 2 or not _is_integer(x)]
        if not_ids:
            kinds = ", ".join(dict.fromkeys(_kind(inputs[i]) for i in not_ids))
            problems.append(f"{_names('inputs', not_ids)} must be integer token ids [mb, seq], got {kinds}")
        for i, x in enumerate(inputs):
            if stage.is_first and i not in not_ids and (bad := _first_outside(x, 0, vocab)):
                problems.append(f"inputs[{i}] holds id {bad}, outside the vocabulary [0, {vocab})")
    if stage.is_last:
        if not isinstance(targets, Sequence) or len(targets) != len(inputs):
            got = len(targets) if isinstance(targets, Sequence) else type(targets).__name__
            problems.append(f"targets must be a list with one tensor per microbatch ({len(inputs)}), got {got}")
        elif default_loss:
            problems += _target_problems(stage, inputs, targets)
    return problems


def _target_problems(stage: Stage, inputs, targets) -> list[str]:
    """What the default cross-entropy would fail on, on this rank alone."""
    problems, classes = [], stage.num_classes
    span = f"[0, {classes})" if classes else "[0, classes)"
    for i, t in enumerate(targets):
        if not isinstance(t, torch.Tensor) or not _is_integer(t):
            got = _kind(t) if isinstance(t, torch.Tensor) else type(t).__name__
            problems.append(f"targets[{i}] must hold integer class ids in {span} or {IGNORE_INDEX}, got {got}")
        elif stage.takes_token_ids and t.shape != inputs[i].shape:
            problems.append(f"targets[{i}] is {_kind(t)} but inputs[{i}] is {_kind(inputs[i])}: one target per token")
        elif bad := _first_outside(t, 0, classes, allow=IGNORE_INDEX):
            problems.append(f"targets[{i}] holds {bad}, outside {span} and not {IGNORE_INDEX} (ignored)")
    return problems
