"""Tensors lent to a collective are handed back before the interpreter shuts down.

gloo runs a collective on a worker thread, which lets go of its tensors a moment *after* the caller's
`wait()` returns. When the caller already dropped a tensor (a temporary: a packed buffer, a gather's
parts), the worker's reference is the last, and freeing it takes the GIL. If the interpreter has begun
to shut down by then, Python ends that thread with `pthread_exit`, which C++ turns into `std::terminate`
("terminate called without an active exception", exit -6) after all the work was done. The groups
outlive `destroy_process_group` while anything refers to them (a stage's layers do), so torch cannot
join those threads first.

Every collective rewrite runs on a temporary `lend`s it (remembered weakly); `settle` waits, with the
GIL released, until no worker holds any, and runs at exit while threads can still take the GIL. Only
lend tensors the caller drops: one still held elsewhere makes `settle` wait for its timeout.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["lend", "outstanding", "settle"]

_lent: list[weakref.ref] = []
_prune_at = 256  # entries kept before dead references are swept out (grows with the live ones)


def lend(*tensors: torch.Tensor) -> None:
    """Remember `tensors`, just handed to a collective and about to be dropped, until released."""
    global _prune_at
    if len(_lent) >= _prune_at:
        _lent[:] = [r for r in _lent if r() is not None]
        _prune_at = max(256, 2 * len(_lent))
    _lent.extend(weakref.ref(t) for t in tensors)


def outstanding() -> int:
    """How many lent tensors are still alive (held by a collective's worker, or by mistake elsewhere)."""
    return sum(r() is not None for r in _lent)


def settle(timeout: float = 10.0) -> int:
    """Wait until no lent tensor is alive, at most `timeout` seconds; return how many still are."""
    deadline, pause = time.monotonic() + timeout, 1e-4
    while True:
        _lent[:] = [r for r in _lent if r() is not None]
        if not _lent or time.monotonic() >= deadline:
            return len(_lent)
        time.sleep(pause)  # releases the GIL: a worker waiting for it frees its tensors now
        pause = min(2 * pause, 0.01)


def _settle_at_exit() -> None:
    left = settle()
    if left:
        print(f"rewrite: {left} tensor(s) lent to collectives were still held at exit", file=sys.stderr)


atexit.register(_settle_at_exit)
