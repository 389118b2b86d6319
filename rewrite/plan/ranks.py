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
    """`pp=2 x tp=2`, with `dp=2 x ` in front when there are replicas (`dp=4 (ep=2) x ` when ep of them
    split the experts) and `cp=2 x ` before tp when cp > 1."""
    replicas = f"dp={dp}" + (f" (ep={ep})" if ep > 1 else "") + " x " if dp > 1 else ""
    return replicas + f"pp={pp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp}"


def length_problem(seq: int, cp: int) -> str | None:
    """Why a sequence of `seq` tokens cannot be split over `cp` ranks, naming the lengths that can; None when it can."""
    step = 2 * cp
    if seq % step == 0 and seq > 0:
        return None
    below, above = seq // step * step, (seq // step + 1) * step
    near = f"{below} or {above}" if below else f"{above}"
    return (f"a sequence of {seq} tokens does not split into 2 x cp = {step} equal chunks (cp ranks hold two each, "
            f"balanced for the causal mask); use a length that {step} divides, e.g. {near}")


def expert_groups(pp: int, tp: int, dp: int, cp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-replica groups) of a mesh, as lists of global ranks.

    An expert-parallel group is `ep` neighbouring dp replicas at the same pp, cp and tp ranks
    (dp ranks `[g * ep, (g + 1) * ep)`): together they hold every expert once, dp rank `d` the
    experts of block `d % ep`. The replicas of a block (dp ranks `d` with the same `d % ep`, over
    every cp rank) hold the same experts.

        >>> expert_groups(1, 1, 4, 1, 2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    def at(d: int, p: int, c: int, t: int) -> int:
        return global_rank(d, p, t, pp=pp, tp=tp, cp=cp, cp_rank=c)

    places = [(p, c, t) for p in range(pp) for c in range(cp) for t in range(tp)]
    groups = [[at(g * ep + e, p, c, t) for e in range(ep)] for g in range(dp // ep) for p, c, t in places]
    replicas = [[at(g * ep + e, p, c, t) for g in range(dp // ep) for c in range(cp)]
                for p in range(pp) for t in range(tp) for e in range(ep)]
    return groups, replicas
