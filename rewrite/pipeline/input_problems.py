"""What is wrong with one rank's microbatches, in words: the problems `check_step_inputs` gathers from every
rank once some rank found one (the structure, token ids inside the vocabulary, positions, targets).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..plan.ranks import length_problem
from ..tensor_parallel.loss import IGNORE_INDEX
from .batches import KEYS, ids_of, integer_dtype, packing_of
from .stage import Stage

__all__ = ["local_problems", "describe_inputs"]


def _is_tensor_list(values) -> bool:
    """A non-empty list of microbatches: tensors, or dicts of tensors."""
    return isinstance(values, Sequence) and len(values) > 0 and all(
        isinstance(x, torch.Tensor) or (isinstance(x, dict) and x and all(isinstance(v, torch.Tensor) for v in x.values()))
        for x in values
    )


def _kind(x) -> str:
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_kind(v)}" for k, v in x.items()) + "}"
    return f"[{', '.join(map(str, x.shape))}] {str(x.dtype).removeprefix('torch.')}"


def describe_inputs(inputs) -> str:
    """'4 x [2, 16] int64' when uniform, else every microbatch's shape and dtype (dicts: every entry's)."""
    if not _is_tensor_list(inputs):
        return "no list of tensors"
    kinds = [_kind(x) for x in inputs]
    return f"{len(kinds)} x {kinds[0]}" if len(set(kinds)) == 1 else f"{len(kinds)}: " + ", ".join(kinds)


def _names(what: str, indices: list[int], shown: int = 3) -> str:
    """'inputs[0], inputs[1]' or 'inputs[0], inputs[1], inputs[2] and 5 more'."""
    from ..plan.wording import first_few

    return first_few([f"{what}[{i}]" for i in indices], shown)


def _first_outside(x: torch.Tensor, low: int, high: int | None, *, allow: int | None = None) -> str | None:
    """'300 at (0, 5)' for the first value outside [low, high) (and not `allow`), else None."""
    bad = x < low if high is None else (x < low) | (x >= high)
    if allow is not None:
        bad &= x != allow
    if not bool(bad.any()):
        return None
    where = tuple(bad.nonzero()[0].tolist())
    return f"{int(x[where])} at {where}"


def local_problems(stage: Stage, inputs, targets, default_loss: bool, count_tokens: bool) -> list[str]:
    if not isinstance(stage, Stage):
        return [f"needs the Stage returned by apply_plan, got {type(stage).__name__}"]
    if not _is_tensor_list(inputs):
        got = f"a tensor of shape {list(inputs.shape)}" if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        return [f"inputs must be a non-empty list of tensors, one per microbatch (on every rank), got {got}; "
                "cut a [batch, seq] batch of token ids with `inputs, targets = rewrite.microbatches(ids, "
                "stage.resolved.plan.pipeline.microbatches, dp_rank=stage.dp_rank, dp=stage.dp)` "
                "(packed documents: add position_ids=, and each microbatch is a dict of input_ids and position_ids)"]
    if problems := _position_problems(stage, inputs):
        return problems
    inputs = [ids_of(x) for x in inputs]
    if stage.takes_token_ids:
        vocab = stage.vocab_size
        not_ids = [i for i, x in enumerate(inputs) if x.dim() != 2 or not integer_dtype(x.dtype)]
        if not_ids:
            kinds = ", ".join(dict.fromkeys(_kind(inputs[i]) for i in not_ids))
            problems.append(f"{_names('inputs', not_ids)} must be integer token ids [mb, seq], got {kinds}")
        for i, x in enumerate(inputs):
            if stage.is_first and i not in not_ids and (bad := _first_outside(x, 0, vocab)):
                problems.append(f"inputs[{i}] holds id {bad}, outside the vocabulary [0, {vocab})")
        uneven = [i for i, x in enumerate(inputs) if i not in not_ids and length_problem(x.shape[-1], stage.mesh.cp)]
        if uneven and stage.mesh.cp > 1:
            problems.append(f"{_names('inputs', uneven)}: mesh.cp={stage.mesh.cp}: "
                            + length_problem(inputs[uneven[0]].shape[-1], stage.mesh.cp))
    if stage.is_last:
        if not isinstance(targets, Sequence) or len(targets) != len(inputs):
            got = len(targets) if isinstance(targets, Sequence) else type(targets).__name__
            problems.append(f"targets must be a list with one tensor per microbatch ({len(inputs)}), got {got}")
        elif default_loss:
            problems += _target_problems(stage, inputs, targets)
        elif count_tokens and (odd := [i for i, t in enumerate(targets) if not isinstance(t, torch.Tensor)]):
            problems.append(f"{_names('targets', odd)} must be tensors: a loss declared with returns_token_sums "
                            f"is divided by the global batch's targets other than {IGNORE_INDEX}, got "
                            f"{type(targets[odd[0]]).__name__}")
    return problems


def _position_problems(stage: Stage, inputs) -> list[str]:
    """What is wrong with the microbatches given as dicts (`input_ids` with `position_ids`)."""
    dicts = [i for i, x in enumerate(inputs) if isinstance(x, dict)]
    if not dicts:
        return []
    if not stage.takes_token_ids:
        return [f"{_names('inputs', dicts)} are dicts: position_ids need a Hugging Face decoder model run by "
                "the module walker; a traced model takes one tensor per microbatch"]
    if unpackable := packing_of(stage):
        return [f"{_names('inputs', dicts)} carry position_ids (packed documents), which "
                f"{type(stage.model).__name__} cannot take: {unpackable}"]
    problems = []
    for i in dicts:
        x = inputs[i]
        if tuple(sorted(x)) != KEYS:
            problems.append(f"inputs[{i}] has keys {sorted(x)}; a microbatch with positions has exactly "
                            "'input_ids' and 'position_ids'")
            continue
        ids, pos = x["input_ids"], x["position_ids"]
        if pos.shape != ids.shape or not integer_dtype(pos.dtype):
            problems.append(f"inputs[{i}]['position_ids'] is {_kind(pos)} but its input_ids are {_kind(ids)}: "
                            "one integer position per token")
        elif bad := _first_outside(pos, 0, None):
            problems.append(f"inputs[{i}]['position_ids'] holds {bad}: positions count from 0 where each "
                            "document starts")
    return problems


def _target_problems(stage: Stage, inputs, targets) -> list[str]:
    """What the default cross-entropy would fail on, on this rank alone."""
    problems, classes = [], stage.num_classes
    span = f"[0, {classes})" if classes else "[0, classes)"
    for i, t in enumerate(targets):
        if not isinstance(t, torch.Tensor) or not integer_dtype(t.dtype):
            got = _kind(t) if isinstance(t, torch.Tensor) else type(t).__name__
            problems.append(f"targets[{i}] must hold integer class ids in {span} or {IGNORE_INDEX}, got {got}")
        elif stage.takes_token_ids and t.shape != inputs[i].shape:
            problems.append(f"targets[{i}] is {_kind(t)} but inputs[{i}] is {_kind(inputs[i])}: one target per token")
        elif bad := _first_outside(t, 0, classes, allow=IGNORE_INDEX):
            problems.append(f"targets[{i}] holds {bad}, outside {span} and not {IGNORE_INDEX} (ignored)")
    return problems
