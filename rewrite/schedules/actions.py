"""The cells of a schedule table: `Action`s, the placement of stages on ranks, and what each action waits for.

Kinds are named as torch.distributed.pipelining names them: `F` the forward of a
microbatch on a stage, `B` its whole backward, `I` the input-only backward (the
gradient the previous stage waits for) and `W` the weight gradients an `I` left for later.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "Table", "KINDS", "placement", "needs", "done_key", "ends_pair"]

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


def done_key(action: Action) -> Action:
    """What an action's end makes available, as `needs` names it: an `I` hands on the input
    gradient as a `B` does, so both count as the backward `B` of their (mb, stage)."""
    return Action("B", action.mb, action.stage) if action.kind == "I" else action


def needs(action: Action, num_stages: int) -> Action:
    """What this action waits for (a `done_key`): a forward for the previous stage's forward,
    a backward (B or I) for the next stage's backward (the last stage's for its own
    forward), a W for its I.

    A first-stage forward waits for nothing and gets itself back.
    """
    mb, s = action.mb, action.stage
    if action.kind == "F":
        return Action("F", mb, s - 1) if s > 0 else action
    if action.kind == "W":
        return Action("B", mb, s)
    return Action("B", mb, s + 1) if s < num_stages - 1 else Action("F", mb, s)


def ends_pair(action: Action) -> bool:
    """Whether the (mb, stage) pair's activations may go after this action: its B, or the W after its I."""
    return action.kind in ("B", "W")
