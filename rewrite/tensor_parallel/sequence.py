"""Sequence-parallel collectives, differentiable (Megatron-LM's sequence parallelism).

Outside the tensor-parallel linears, hidden states `(b, s, h)` are split along the
sequence (dim -2): each rank holds `c = ceil(s / tp)` rows, zero padded at the end.
Each collective is a no-op for a group of one and raises ValueError below 2 dimensions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from . import comm
from .comm import _Adjoint, group_rank, group_size

__all__ = ["sequence_chunk", "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence"]

_GRAD_MODES = ("reduce_scatter", "split")


def sequence_chunk(length: int, tp: int) -> int:
    """Rows per rank for a sequence of `length` split over `tp` ranks: ceil(length / tp).

    Rank r holds rows [r*c, (r+1)*c); rows past `length` are zero padding (at length 1, tp 4 the
    last ranks hold padding only). Example: sequence_chunk(7, 2) == 4; rank 1 holds rows 4..6 and one padding row.
    """
    if length < 0 or tp < 1:
        raise ValueError(f"sequence_chunk needs length >= 0 and tp >= 1; got length={length}, tp={tp}")
    return -(-length // tp)


def _check_rank(x: torch.Tensor, what: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{what} needs a (..., s, h) tensor with the sequence at dim -2; got shape {tuple(x.shape)}")


def _chunk(x: torch.Tensor, i: int, c: int) -> torch.Tensor:
    """Rows [i*c, (i+1)*c) of dim -2 of x (..., s, h), zero padded to c rows: (..., c, h)."""
    s = x.shape[-2]
    start = min(i * c, s)
    rows = x.narrow(-2, start, min(c, s - start))  # a view; may be empty
    return rows if rows.shape[-2] == c else F.pad(rows, (0, 0, 0, c - rows.shape[-2]))


def _my_chunk(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's padded chunk of x (..., s, h): a fresh contiguous copy, never a view (which would keep x alive)."""
    rows = _chunk(x, group_rank(group), sequence_chunk(x.shape[-2], group_size(group)))
    return rows if rows._base is None else rows.clone(memory_format=torch.contiguous_format)


def _gather(x: torch.Tensor, group: ProcessGroup | None, length: int) -> torch.Tensor:
    """One all-gather of x (*lead, c, h) along dim -2, trimmed: (*lead, length, h)."""
    tp, c = group_size(group), x.shape[-2]
    x = x.contiguous()
    # Collectives concatenate along dim 0, so the gathered buffer is chunk-major:
    # (tp * lead0, *lead[1:], c, h), viewed as (tp, *lead, c, h).
    out = x.new_empty((tp * x.shape[0], *x.shape[1:]))
    comm.all_gather_into(out, x, group)
    out = out.view(tp, *x.shape)
    if math.prod(x.shape[:-2]) == 1:  # no batch to interleave: chunk-major is sequence order
        return out.view(*x.shape[:-2], tp * c, x.shape[-1]).narrow(-2, 0, length)
    # Concatenate the chunks along dim -2, dropping padding rows: one copy, contiguous.
    parts = [out[i].narrow(-2, 0, max(0, min(c, length - i * c))) for i in range(tp)]
    return torch.cat(parts, dim=-2)


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """One reduce-scatter (sum) of x (*lead, s, h): this rank's padded chunk (*lead, c, h)."""
    tp = group_size(group)
    c = sequence_chunk(x.shape[-2], tp)
    # Chunk-major input (tp, *lead, c, h) = (tp * lead0, ...) for dim-0 scatter; one copy.
    chunks = torch.stack([_chunk(x, i, c) for i in range(tp)])
    out = x.new_empty(chunks.shape[1:])
    comm.reduce_scatter_into(out, chunks.flatten(0, 1), group)
    return out


def scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's sequence chunk of a replicated x: (b, s, h) -> (b, c, h), c = ceil(s / tp).

    No communication forward; backward all-gathers the gradient: dL/dX is [dL/dY_0 ... dL/dY_{tp-1}]
    trimmed to s, on every rank. Example: at tp 2, x of shape (1, 7, h) gives rank 1 rows 4..6 plus one zero row.
    """
    _check_rank(x, "scatter_to_sequence")
    if group_size(group) == 1:
        return x
    return _Adjoint.apply(x, _my_chunk, (group,), _gather, (group, x.shape[-2]))  # the full X can then be freed


def gather_from_sequence(
    x: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    length: int | None = None,
    grad: str = "reduce_scatter",
) -> torch.Tensor:
    """All-gather sequence chunks: (b, c, h) -> (b, length, h) (length defaults to tp * c).

    Args:
        x: this rank's chunk, as made by `scatter_to_sequence`/`reduce_scatter_to_sequence`.
        group: the tensor-parallel group (default group when None).
        length: the true sequence length s, to drop the padding rows; ceil(s / tp) must be c.
        grad: backward: "reduce_scatter" sums the partial gradients of the group's
            consumers (column-parallel linears, each giving dL/dY W_r^T) and keeps this rank's chunk,
            dL/dX_r = (sum_q dL/dY^(q))[r*c:(r+1)*c]; "split" keeps this rank's chunk without
            communication (replicated consumers: every rank's dL/dY is already the full gradient).
    Raises:
        ValueError: for a bad `grad`, or a `length` that does not split into chunks of c.
    Example: gather_from_sequence(shard, tp_group, length=7)  # (b, 4, h) at tp 2 -> (b, 7, h)
    """
    _check_rank(x, "gather_from_sequence")
    if grad not in _GRAD_MODES:
        raise ValueError(f"gather_from_sequence: grad={grad!r} is not one of {_GRAD_MODES}")
    tp, c = group_size(group), x.shape[-2]
    if length is None:
        length = tp * c
    elif length < 0 or sequence_chunk(length, tp) != c:
        raise ValueError(
            f"gather_from_sequence: length={length} does not fit chunks of c={c} rows on {tp} ranks "
            f"(ceil(length / {tp}) must be {c}, so length in [{max(tp * c - tp + 1, 0)}, {tp * c}]); "
            "pass the sequence length the shards were made from"
        )
    if tp == 1:
        return x
    return _Adjoint.apply(x, _gather, (group, length), _reduce_scatter if grad == "reduce_scatter" else _my_chunk,
                          (group,))


def reduce_scatter_to_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum partial outputs over the group and keep this rank's chunk: (b, s, h) -> (b, c, h).

    One reduce-scatter forward (x padded to tp * c rows) of the partial X^(q) (row layers' outputs); backward
    all-gathers the gradient, trimmed to s: dL/dX^(q) is the same on every rank.
    Example: reduce_scatter_to_sequence(row_linear_partial_out, tp_group)
    """
    _check_rank(x, "reduce_scatter_to_sequence")
    return x if group_size(group) == 1 else _Adjoint.apply(x, _reduce_scatter, (group,), _gather, (group, x.shape[-2]))
