"""SIGINT and SIGTERM during `rewrite train`: every rank stops after the same step, its state saved.

A first SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption notice; torchrun forwards either to its
workers) only marks the request, and the step in flight finishes. After each step the ranks agree in
one all-reduce of one integer whether any of them was asked, so every rank stops after the same step,
saves the training state there (`--ckpt`, unless `--no-save-on-signal`) and says so in one line. A
second SIGINT stops at once (KeyboardInterrupt): nothing more is saved, and what was complete stays
as it was (`latest` names a checkpoint only once it is whole).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from ..errors import RewriteError
from ..lent import lend

__all__ = ["TrainInterrupted", "StopRequests", "stopped_by"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainInterrupted(RewriteError, RuntimeError):
    """`rewrite train` stopped on a signal after a whole step (the same message on every rank); `status`
    is the shell's for that signal (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, *, signum: int):
        super().__init__(message)
        self.status = 128 + signum


class StopRequests:
    """While entered: SIGINT and SIGTERM are requests to stop after the step in flight; `agreed()` asks every rank.

    Only the main thread can take signals; elsewhere (a thread of the caller's) nothing is installed and
    the signals keep their own handlers.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group, self.requested, self.previous = group, None, {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        if self.requested is None:
            self.requested = signum  # the step in flight finishes; the next boundary stops
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: at once

    def agreed(self) -> int | None:
        """The signal any rank was sent (the highest number, if several), or None. Collective: every rank, each step."""
        flag = torch.tensor([self.requested or 0], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            lend(flag)
        return int(flag.item()) or None


def stopped_by(signum: int, step: int, config, saved) -> str:
    """The one line `rewrite train` ends with after a signal: the step reached, the checkpoint to go on from,
    and how (`config`: the run's TrainConfig; `saved`: where this step's state went, None if nowhere)."""
    from ..checkpoint.training_state import latest_checkpoint

    name = signal.Signals(signum).name
    head = f"stopped by {name} after step {step} of {config.steps}"
    again = "the same command" + ("" if config.resume else " with --resume")
    if saved is not None:
        return f"{head}: its training state is saved in {saved}; {again} continues from it"
    why = ("no --ckpt" if not config.ckpt else "--no-save-on-signal" if not config.save_on_signal
           else "its save failed, above")
    found = latest_checkpoint(config.ckpt) if config.ckpt else None
    if found is None:
        return f"{head}: nothing saved ({why}), so a new run starts from step 1"
    return f"{head}: not saved ({why}); the last complete checkpoint is {found[1]} (step {found[0]}), {again} continues from it"
