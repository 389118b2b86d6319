"""What this rank is doing: a name for each action and collective it enters, for a report when a wait fails.

`with doing("recv F3 for stage 1", peer=2)` sets one attribute, no communication. When a wait raises (a
peer stopped, gloo's timeout expired), the innermost name is kept (`stalled`) for the message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Activity", "doing", "at_step", "stalled"]


@dataclass(frozen=True)
class Activity:
    """One named action: `what` it is, the global rank it waits for (`peer`, when one), the training step."""

    what: str
    peer: int | None = None
    step: int | None = None

    def describe(self) -> str:
        """'step 5: recv B1 for stage 0 from rank 1' (or without the step, outside a training loop)."""
        return (f"step {self.step}: " if self.step is not None else "") + self.what


class _State:
    now: Activity | None = None
    step: int | None = None
    failed: Activity | None = None  # the innermost activity an exception left, until the next step


_STATE = _State()


def at_step(step: int | None) -> None:
    """The training loop is at `step` (None: outside one); what the last one left is forgotten."""
    _STATE.step, _STATE.failed = step, None


@contextmanager
def doing(what: str, *, peer: int | None = None) -> Iterator[None]:
    """Name what runs inside (an action, a transfer, a collective) and the peer it waits for, if one."""
    before = _STATE.now
    _STATE.now = Activity(what, peer, _STATE.step)
    try:
        yield
    except BaseException:
        if _STATE.failed is None:  # the innermost name: where the wait was
            _STATE.failed = _STATE.now
        raise
    finally:
        _STATE.now = before


def stalled() -> Activity | None:
    """Where the last failure left this rank (else what it is doing now; None outside any named activity)."""
    return _STATE.failed or _STATE.now
