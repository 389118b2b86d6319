"""A step's microbatches, checked on every rank; ranks agree on them in one small collective.

Each rank checks the structure of its arguments (shapes and dtypes; once per structure) and their
values (ids inside the vocabulary, targets a cross-entropy accepts; one read of a few integers per
step). One all-reduce of a few integers on the mesh's host group then carries a fingerprint of every
rank's view, whether it found a problem, and each replica's trained tokens (targets other than
-100): a steady step makes no other collective here, and no device read when its microbatches are
on the host. Only when some rank found a problem, or views differ, do the ranks share their
findings (`agree`) and raise the same InputError on every rank, before any tensor is sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.distributed as dist

from ..agreement import agree, describe_ranks, ranks_by_value
from ..plan.ranks import length_problem
from ..lent import lend
from ..tensor_parallel.loss import IGNORE_INDEX
from .batches import KEYS, ids_of, integer_dtype, packing_of, positions_of
from .stage import Stage
from ..errors import InputError
from .input_problems import describe_inputs, local_problems

__all__ = ["check_step_inputs"]


def check_step_inputs(stage: Stage, inputs, targets, *, default_loss: bool, count_tokens: bool = False) -> int | None:
    """Raise the same ValueError on every rank if any rank's microbatches are bad or ranks' differ.

    Collective: every rank calls it before its step's first transfer.

    Args:
        stage, inputs, targets: as `run_schedule` takes them (targets read on the last stage).
        default_loss: targets go to the default cross-entropy: class ids in `[0, classes)` or -100.
        count_tokens: count the global batch's targets other than -100, for a loss normalised by them.

    Returns:
        The global batch's trained tokens when `count_tokens`, else None; the same on every rank.
    """
    view, found, counted, positions = describe_inputs(inputs), True, None, _positions_mark(inputs)
    what, replica, replicas, group = "run_schedule", 0, 1, None
    if isinstance(stage, Stage):
        replica, replicas, group = stage.mesh.dp_rank, stage.mesh.dp, stage.mesh.host_group
        found = _structure_fails(_facts(stage, _packed(inputs)), _layout(inputs), _layout(targets), default_loss,
                                 count_tokens)
        if not found:
            fits, counted = _values_fit(stage, inputs, targets, default_loss, count_tokens)
            found = not fits
    flagged, total = _verdict(group, view, found, positions, counted, replica, replicas)
    if not flagged:
        return total if count_tokens else None
    # Some rank found a problem or saw other microbatches: every rank is here; say what each found.
    views = agree(local_problems(stage, inputs, targets, default_loss, count_tokens), what,
                  view=(view, replica, positions, counted))
    groups = ranks_by_value([v for v, _, _, _ in views])
    if len(groups) > 1:
        seen = "; ".join(f"{describe_ranks(r)}: {v}" for v, r in groups.items())
        raise InputError(
            f"{what}: ranks were given different microbatches ({seen}); pass the same microbatches "
            "(count, shapes, dtypes) on every rank: later stages size their transfers from them"
            + ("; data-parallel replicas pass their own microbatches, all of the same count, shapes and dtypes"
               if stage.mesh.dp > 1 else "")
        )
    for d in range(replicas):
        of_replica, a_replica = (f" (replica {d})", " of a replica") if replicas > 1 else ("", "")
        marks = ranks_by_value([p for v, r, p, _ in views if r == d])
        if len(marks) > 1:
            ranks = [i for i, (_, r, _, _) in enumerate(views) if r == d]
            raise InputError(
                f"{what}: {describe_ranks(ranks)}{of_replica}"
                " were given different position_ids; every stage reads them from its own microbatches, "
                f"so pass the same microbatches on every rank{a_replica}"
            )
        counts = ranks_by_value([c for _, r, _, c in views if r == d and c is not None])
        if len(counts) > 1:
            ranks = [i for i, (_, r, _, c) in enumerate(views) if r == d and c is not None]
            seen = "; ".join(f"{describe_ranks([ranks[i] for i in r])}: {c}" for c, r in counts.items())
            raise InputError(
                f"{what}: the last stage's {describe_ranks(ranks)}{of_replica} were given targets with different "
                f"numbers of trained tokens (other than {IGNORE_INDEX}: {seen}); each of them computes the loss "
                f"of the same rows, so pass the same targets on every rank{a_replica}"
            )
    # Every rank is here alike (the verdict and the views are the group's): the quick checks flagged what the
    # full ones do not find. Training on would divide the loss by a count nobody agreed on.
    raise RuntimeError(f"{what}: the step's input checks disagree with each other ({view}); this is a bug in "
                       "rewrite: please report it with the microbatches' shapes and dtypes")


def _verdict(group, view: str, found: bool, positions: int, counted: int | None, replica: int,
             replicas: int) -> tuple[bool, int]:
    """On every rank alike: whether any rank found a problem, ranks' views differ, or the ranks of a
    replica hold different positions or trained-token counts; and the trained tokens of every replica
    added up (one all-reduce of 3 + 4 x dp int64)."""
    if dist.get_world_size() == 1:
        return found, counted or 0
    mark = _fingerprint(view)
    verdict = torch.full((3 + 4 * replicas,), _LOWEST, dtype=torch.int64)
    verdict[:3] = torch.tensor([mark, -mark, int(found)])
    verdict[3 + 2 * replica : 5 + 2 * replica] = torch.tensor([positions, -positions])  # the other replicas' stay lowest
    if counted is not None:  # the last stage's ranks: their replica's count
        at = 3 + 2 * replicas + 2 * replica
        verdict[at : at + 2] = torch.tensor([counted, -counted])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    lend(verdict)
    highest, negated_lowest, flagged, *marks = verdict.tolist()
    spread = any(top != -low for top, low in zip(marks[::2], marks[1::2]) if top != _LOWEST)
    total = sum(top for top in marks[2 * replicas :: 2] if top != _LOWEST)
    return bool(flagged) or highest != -negated_lowest or spread, total


_LOWEST = torch.iinfo(torch.int64).min


def _digest(*chunks: bytes) -> int:
    """A 62-bit digest of `chunks`, the same in every process (unlike `hash`, which is salted)."""
    h = hashlib.blake2b(digest_size=8)
    for chunk in chunks:
        h.update(chunk)
    return int.from_bytes(h.digest(), "little") >> 2


@lru_cache(maxsize=256)
def _fingerprint(view: str) -> int:
    return _digest(view.encode())


def _positions_mark(inputs) -> int:
    """A digest of the microbatches' position_ids values (0 when none carries them; tensors on a
    device are not read, to spare a synchronisation: their positions go unchecked across ranks)."""
    if not isinstance(inputs, Sequence):
        return 0
    chunks = []
    for i, x in enumerate(inputs):
        pos = x.get("position_ids") if isinstance(x, dict) else None
        if isinstance(pos, torch.Tensor) and pos.device.type == "cpu":
            chunks += [f"{i}:{tuple(pos.shape)}:{pos.dtype}".encode(), pos.detach().contiguous().numpy().tobytes()]
    return _digest(*chunks) if chunks else 0


def _facts(stage: Stage, packed: bool) -> tuple:
    """What the structure rules read of the stage (a cache key); with packed microbatches, why the model
    cannot take them (None when it can)."""
    return stage.takes_token_ids, stage.is_last, stage.num_classes, packing_of(stage) if packed else None, stage.mesh.cp


def _packed(inputs) -> bool:
    return isinstance(inputs, Sequence) and any(isinstance(x, dict) for x in inputs)


def _layout(values) -> tuple | str:
    """A list of microbatches as (shape, dtype) pairs, with (shape, dtype) of the positions third where
    a dict carries them; anything else as its type's name (hashable: part of a cache key)."""
    if not isinstance(values, Sequence):
        return type(values).__name__
    return tuple(_entry(x) for x in values)


def _entry(x) -> tuple | str:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    if isinstance(x, dict) and tuple(sorted(x)) == KEYS and all(isinstance(v, torch.Tensor) for v in x.values()):
        ids, pos = x["input_ids"], x["position_ids"]
        return tuple(ids.shape), ids.dtype, (tuple(pos.shape), pos.dtype)
    return type(x).__name__


@lru_cache(maxsize=256)
def _structure_fails(facts: tuple, inputs: tuple | str, targets: tuple | str, default_loss: bool,
                     count_tokens: bool) -> bool:
    """Whether a structure (from `_layout`) breaks a rule that shapes and dtypes alone decide (`local_problems`')."""
    takes_ids, last, classes, unpackable, cp = facts
    if isinstance(inputs, str) or not inputs or any(isinstance(x, str) for x in inputs):
        return True
    if unpackable is not None:
        return True
    if cp > 1 and any(len(x[0]) != 2 or length_problem(x[0][-1], cp) for x in inputs):
        return True  # a sequence the cp ranks cannot share in balanced chunks
    if takes_ids and any(len(x[0]) != 2 or not integer_dtype(x[1]) for x in inputs):
        return True
    if any(len(x) == 3 and (not takes_ids or x[2][0] != x[0] or not integer_dtype(x[2][1])) for x in inputs):
        return True  # positions: an HF model's, one per token, integers
    if not last:
        return False
    if isinstance(targets, str) or len(targets) != len(inputs):
        return True
    if count_tokens and any(isinstance(t, str) for t in targets):
        return True  # counting trained tokens needs tensors
    return default_loss and any(
        isinstance(t, str) or not integer_dtype(t[1]) or (takes_ids and t[0] != inputs[i][0])
        for i, t in enumerate(targets)
    )


def _values_fit(stage: Stage, inputs, targets, default_loss: bool, count_tokens: bool) -> tuple[bool, int | None]:
    """Token ids inside the vocabulary, targets in [0, classes) or -100, read in one go for every microbatch
    once the structure is known good, with the last stage's count of targets other than -100 (None
    elsewhere, or when not `count_tokens`)."""
    spans = []  # (a tensor, the highest value it may hold; its lowest is 0)
    if stage.takes_token_ids and stage.is_first:
        spans += [(ids_of(x), stage.vocab_size - 1) for x in inputs]
    spans += [(p, None) for p in map(positions_of, inputs) if p is not None]  # positions from 0 up
    if stage.is_last and default_loss:
        top = stage.num_classes - 1 if stage.num_classes else None
        # -100 (ignored) is allowed: read as 0 here, so only other negatives fall below 0.
        spans += [(t.masked_fill(t == IGNORE_INDEX, 0), top) for t in targets]
    spans = [(x, top) for x, top in spans if x.numel()]
    counting = count_tokens and stage.is_last
    if not spans and not counting:
        return True, None
    home = (spans[0][0] if spans else targets[0]).device
    read = [torch.stack(torch.aminmax(x)).to(home, torch.int64) for x, _ in spans]
    if counting:  # one number for every microbatch, read with the rest
        read.append(sum((t != IGNORE_INDEX).sum().to(home, torch.int64) for t in targets).reshape(1))
    extremes = torch.cat(read).tolist()
    counted = extremes.pop() if counting else None
    fits = all(low >= 0 and (top is None or high <= top)
               for low, high, (_, top) in zip(extremes[::2], extremes[1::2], spans))
    return fits, counted
