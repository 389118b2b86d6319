"""Where each rank sits: the world as one grid, `torch.arange(world).view(dp, pp, cp, tp)`, every group a slice.

Global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank: a stage's tp ranks are neighbours
(one machine), dp replicas outermost (across machines). Pure: `rewrite.mesh` makes the groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["DIMS", "Coords", "Shape", "expert_place", "expert_groups", "length_problem"]

DIMS = ("dp", "pp", "cp", "tp")  # the grid's dimensions, outermost first: the one order of coordinates


@dataclass(frozen=True)
class Coords:
    """A rank's coordinates in the grid."""

    dp: int = 0
    pp: int = 0
    cp: int = 0
    tp: int = 0


@dataclass(frozen=True)
class Shape:
    """The grid's sizes, and ep: how many of a stage's dp x tp ranks split the experts (it adds no ranks)."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def grid(self) -> torch.Tensor:
        """Every global rank at its coordinates: `[dp, pp, cp, tp]`."""
        return torch.arange(self.world).view(self.dp, self.pp, self.cp, self.tp)

    def rank(self, at: Coords) -> int:
        """The global rank at `at`: `grid()[at.dp, at.pp, at.cp, at.tp]`.

        >>> Shape(dp=2, pp=2, tp=2).rank(Coords(dp=1, tp=1)), Shape(pp=2, cp=2, tp=2).rank(Coords(pp=1, cp=1))
        (5, 6)
        """
        return ((at.dp * self.pp + at.pp) * self.cp + at.cp) * self.tp + at.tp

    def coords(self, rank: int) -> Coords:
        """Where global rank `rank` sits (`rank(coords(r)) == r`).

        >>> Shape(dp=2, pp=2, tp=2).coords(5)
        Coords(dp=1, pp=0, cp=0, tp=1)
        """
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        dp, pp = divmod(rest, self.pp)
        return Coords(dp, pp, cp, tp)

    def along(self, *dims: str) -> list[list[int]]:
        """The groups of ranks whose coordinates differ only in `dims`: one per value of the others (in the
        grid's order), its ranks running over `dims` (the last fastest).

        >>> Shape(dp=2, cp=2, tp=2).along("tp"), Shape(dp=2, cp=2, tp=2).along("dp", "cp")
        ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
        """
        fixed = [i for i, name in enumerate(DIMS) if name not in dims]
        grid = self.grid().permute(*fixed, *(DIMS.index(name) for name in dims))
        return grid.reshape(-1, math.prod(getattr(self, name) for name in dims)).tolist()

    def text(self) -> str:
        """`pp=2 x tp=2`: dp and cp named when above 1, ` (ep=4)` after it when ep is."""
        sizes = [f"{name}={getattr(self, name)}" for name in DIMS if name in ("pp", "tp") or getattr(self, name) > 1]
        return " x ".join(sizes) + (f" (ep={self.ep})" if self.ep > 1 else "")


def expert_place(shape: Shape, at: Coords) -> tuple[int, int]:
    """(ep_rank, copy): the rank's place in its expert-parallel group, and which of the stage's groups that is.

    >>> expert_place(Shape(dp=2, tp=2, ep=4), Coords(dp=1)), expert_place(Shape(dp=2, tp=2, ep=2), Coords(dp=1, tp=1))
    ((2, 0), (1, 1))
    """
    i = at.dp * shape.tp + at.tp  # the rank's place in its stage's dp x tp, tp fastest
    return i % shape.ep, i // shape.ep


def expert_groups(shape: Shape) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-replica groups) as lists of global ranks.

    ep borrows a stage's dp x tp ranks at one cp rank, tp fastest: a group is `ep` consecutive ones (part of one
    replica's tp group, or the tp groups of ep / tp neighbouring replicas), its `e`-th rank holding expert block
    `e`. The `e`-th ranks of a stage's groups, over every cp rank, hold the same experts.

    >>> expert_groups(Shape(dp=4, ep=2)), expert_groups(Shape(dp=2, tp=2, ep=2))
    (([[0, 1], [2, 3]], [[0, 2], [1, 3]]), ([[0, 1], [2, 3]], [[0, 2], [1, 3]]))
    >>> expert_groups(Shape(dp=2, tp=2, ep=4))
    ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    """
    pp, cp, ep = shape.pp, shape.cp, shape.ep
    split = shape.grid().permute(1, 2, 0, 3).reshape(pp, cp, -1, ep)  # (pp, cp, copies, ep)
    groups = split.permute(2, 0, 1, 3).reshape(-1, ep)  # (copies x pp x cp, ep)
    return groups.tolist(), split.permute(0, 3, 2, 1).reshape(pp * ep, -1).tolist()  # (pp x ep, copies x cp)


def length_problem(seq: int, cp: int) -> str | None:
    """Why a sequence of `seq` tokens cannot be split over `cp` ranks, naming the lengths that can; None when it can."""
    step = 2 * cp
    if seq % step == 0 and seq > 0:
        return None
    below = seq // step * step
    near = f"{below} or {below + step}" if below else f"{below + step}"
    return (f"a sequence of {seq} tokens does not split into 2 x cp = {step} equal chunks (cp ranks hold two each, "
            f"balanced for the causal mask); use a length that {step} divides, e.g. {near}")
