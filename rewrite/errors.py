"""What rewrite refuses, as one family of exceptions.

Every refusal is a `RewriteError` saying what is wrong and what to do, raised alike on every rank before
anything ran or was lost; each also derives from a builtin (`ValueError`, `RuntimeError` for a launch).

    >>> try:
    ...     stage = rewrite.apply_plan(model, "plan.yaml")
    ... except rewrite.RewriteError as refused:
    ...     print(refused)   # every problem, with the fix
"""

from __future__ import annotations

__all__ = ["RewriteError", "InputError", "CheckpointError", "CheckpointWriteError", "first_line"]


class RewriteError(Exception):
    """Base of every refusal rewrite raises on purpose; anything else is a bug to report."""


class InputError(RewriteError, ValueError):
    """A call's arguments cannot be used: a step's microbatches, a model that does not match
    its plan, ranks that were given different ones."""


class CheckpointError(RewriteError, ValueError):
    """A checkpoint that cannot be read into this model and plan, or a directory that holds none."""


class CheckpointWriteError(RewriteError, OSError):
    """A checkpoint that did not fit or could not be written (a full disk, a write error): what was
    written of it is removed and the previous checkpoint stays the latest. Raised on every rank."""


def first_line(exc: BaseException) -> str:
    """The first line of what `exc` says, for a one-line report; its type's name when it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
