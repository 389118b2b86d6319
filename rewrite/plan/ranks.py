"""The one rank formula: global rank = (dp_rank * pp + pp_rank) * tp + tp_rank.

Tensor-parallel ranks are neighbours (one machine under torchrun), pipeline neighbours
share a tp_rank, data-parallel replicas are the outermost dimension (across machines).
Pure arithmetic: `rewrite.mesh` builds its groups with it, `show` and checkpoints name ranks with it.
"""

from __future__ import annotations

__all__ = ["global_rank", "coordinates", "shape_text"]


def global_rank(dp_rank: int, pp_rank: int, tp_rank: int, *, pp: int, tp: int) -> int:
    """The global rank at these coordinates of a (dp, pp, tp) mesh.

        >>> global_rank(1, 0, 1, pp=2, tp=2)
        5
    """
    return (dp_rank * pp + pp_rank) * tp + tp_rank


def coordinates(rank: int, *, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of global rank `rank`: the inverse of `global_rank`.

        >>> coordinates(5, pp=2, tp=2)
        (1, 0, 1)
    """
    dp_rank, rest = divmod(rank, pp * tp)
    return (dp_rank, *divmod(rest, tp))


def shape_text(dp: int, pp: int, tp: int) -> str:
    """`pp=2 x tp=2`, with `dp=2 x ` in front when there are replicas."""
    return (f"dp={dp} x " if dp > 1 else "") + f"pp={pp} x tp={tp}"
