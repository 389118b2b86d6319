"""The one rank formula: global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank.

Tensor-parallel ranks are neighbours (one machine under torchrun), then the context-parallel
ranks of a stage (each holding part of the sequence), pipeline neighbours share a cp_rank and
tp_rank, data-parallel replicas are the outermost dimension (across machines). With cp = 1 it is
(dp_rank * pp + pp_rank) * tp + tp_rank. Pure arithmetic: `rewrite.mesh` builds its groups with
it, `show` and checkpoints name ranks with it.
"""

from __future__ import annotations

__all__ = ["global_rank", "coordinates", "cp_rank_of", "expert_groups", "length_problem", "shape_text"]


def global_rank(dp_rank: int, pp_rank: int, tp_rank: int, *, pp: int, tp: int, cp: int = 1, cp_rank: int = 0) -> int:
    """The global rank at these coordinates of a (dp, pp, cp, tp) mesh.

        >>> global_rank(1, 0, 1, pp=2, tp=2)
        5
        >>> global_rank(0, 1, 0, pp=2, tp=2, cp=2, cp_rank=1)
        6
    """
    return ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank


def coordinates(rank: int, *, pp: int, tp: int, cp: int = 1) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of global rank `rank` (its cp_rank: `cp_rank_of`).

        >>> coordinates(5, pp=2, tp=2)
        (1, 0, 1)
    """
    dp_rank, rest = divmod(rank, pp * cp * tp)
    pp_rank, rest = divmod(rest, cp * tp)
    return dp_rank, pp_rank, rest % tp


def cp_rank_of(rank: int, *, tp: int, cp: int) -> int:
    """The context-parallel rank of global rank `rank`.

        >>> cp_rank_of(6, tp=2, cp=2)
        1
    """
    return rank // tp % cp


def shape_text(dp: int, pp: int, tp: int, cp: int = 1, ep: int = 1) -> str:
    """`pp=2 x tp=2`, with `dp=2 x ` in front when there are replicas, `cp=2 x ` before tp when cp > 1,
    and ` (ep=4)` after it when ep of a stage's dp x tp ranks split the experts."""
    replicas = f"dp={dp} x " if dp > 1 else ""
    experts = f" (ep={ep})" if ep > 1 else ""
    return replicas + f"pp={pp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp}" + experts


def length_problem(seq: int, cp: int) -> str | None:
    """Why a sequence of `seq` tokens cannot be split over `cp` ranks, naming the lengths that can; None when it can."""
    step = 2 * cp
    if seq % step == 0 and seq > 0:
        return None
    below, above = seq // step * step, (seq // step + 1) * step
    near = f"{below} or {above}" if below else f"{above}"
    return (f"a sequence of {seq} tokens does not split into 2 x cp = {step} equal chunks (cp ranks hold two each, "
            f"balanced for the causal mask); use a length that {step} divides, e.g. {near}")


def expert_place(dp_rank: int, tp_rank: int, *, tp: int, ep: int) -> tuple[int, int]:
    """(ep_rank, copy) of the rank at `dp_rank`, `tp_rank` of a stage: ep borrows the stage's dp x tp ranks,
    tp fastest (`expert_groups`); `copy` counts the expert-parallel groups of the stage (at one cp rank).

        >>> expert_place(1, 0, tp=2, ep=4), expert_place(1, 1, tp=2, ep=2)
        ((2, 0), (1, 1))
    """
    return (dp_rank * tp + tp_rank) % ep, (dp_rank * tp + tp_rank) // ep


def expert_groups(pp: int, tp: int, dp: int, cp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-replica groups) of a mesh, as lists of global ranks.

    ep borrows a stage's dp x tp ranks (at one cp rank), numbered `dp_rank * tp + tp_rank` (tp
    fastest): an expert-parallel group is `ep` consecutive ones, so its tp ranks first (ep <= tp: part
    of one replica's tp group; ep > tp: whole tp groups of ep / tp neighbouring replicas). Together they
    hold every expert once, the group's `e`-th rank the experts of block `e`. The ranks at the same
    place of every group of the stage, over every cp rank, hold the same experts.

        >>> expert_groups(1, 1, 4, 1, 2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
        >>> expert_groups(1, 2, 2, 1, 2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
        >>> expert_groups(1, 2, 2, 1, 4)
        ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    """
    def at(i: int, p: int, c: int) -> int:  # the stage's i-th rank of dp x tp
        return global_rank(i // tp, p, i % tp, pp=pp, tp=tp, cp=cp, cp_rank=c)

    copies = dp * tp // ep
    places = [(p, c) for p in range(pp) for c in range(cp)]
    groups = [[at(g * ep + e, p, c) for e in range(ep)] for g in range(copies) for p, c in places]
    replicas = [[at(g * ep + e, p, c) for g in range(copies) for c in range(cp)] for p in range(pp) for e in range(ep)]
    return groups, replicas
