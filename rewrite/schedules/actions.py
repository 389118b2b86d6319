"""The cells of a schedule table: `Action`s, the placement of stages on ranks, and what each action waits for.

Kinds are named as torch.distributed.pipelining names them: `F` the forward of a
microbatch on a stage, `B` its whole backward, `I` the input-only backward (the
gradient the previous stage waits for) and `W` the weight gradients an `I` left for later.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "Table", "KINDS", "placement", "needs"]

KINDS = {
    "F": "forward",
    "B": "backward (input and weight gradients)",
    "I": "input-only backward",
    "W": "weight gradients of an I",
}


@dataclass(frozen=True)
class Action:
    """One cell of a table: kind `F`, `B`, `I` or `W` (see `KINDS`) of microbatch `mb` on global stage `stage`."""

    kind: str
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"

    def cell(self, at_stage: bool) -> str:
        """`F3`, or `F3@2` (microbatch 3, stage 2) when `at_stage`."""
        return f"{self}@{self.stage}" if at_stage else str(self)


Table = tuple[tuple[Action, ...], ...]  # one row per pp rank


def placement(schedule: str, pp: int, k: int = 1) -> tuple[int, ...]:
    """The pp rank holding each of the `pp * k` stages.

    Looped (rank r holds stages r, r + pp, ...) for every schedule but 'zbv', whose V
    places stages r and 2pp - 1 - r on rank r.

        >>> placement("interleaved-1f1b", 2, 2), placement("zbv", 2, 2)
        ((0, 1, 0, 1), (0, 1, 1, 0))
    """
    if schedule == "zbv":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(pp * k))
    return tuple(s % pp for s in range(pp * k))


def needs(kind: str, mb: int, s: int, num_stages: int) -> tuple[str, int, int] | None:
    """What action `kind` of (mb, stage s) waits for, as a `(kind, mb, stage)` key (tuples hash in C):
    a forward the previous stage's forward, a backward (B or I) the next stage's backward (the last
    stage's its own forward), a W its I. An I ends as a `B` key: it hands on the input gradient as
    a B does. None for a first-stage forward."""
    if kind == "F":
        return ("F", mb, s - 1) if s > 0 else None
    if kind == "W":
        return ("B", mb, s)
    return ("B", mb, s + 1) if s < num_stages - 1 else ("F", mb, s)
