"""When a step's actions ran: the host's clock on the CPU, CUDA events on a GPU.

On a GPU an action's kernels run after the host has moved on, so the host's clock would
time their launch. A CUDA event recorded before and after an action times the work itself,
and reading one waits for it: the clock reads its events only when the timeline is read,
so timing a step adds no host synchronisation to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["StepClock", "TimelineEvent"]


@dataclass(frozen=True)
class TimelineEvent:
    """One action of one microbatch on one rank (wall-clock seconds)."""

    rank: int
    stage_idx: int  # a stage id (0 .. num_stages - 1), not a rank
    mb_idx: int
    kind: str  # "forward", "backward" (whole), "backward-input" or "backward-weight"
    start: float
    end: float


class StepClock:
    """One step's action times on this rank: `mark()` before and after, `add` the action, `events()` to read.

    Example:
        >>> clock = StepClock(torch.device("cpu"))
        >>> start = clock.mark(); ...; clock.add(0, 0, 0, "forward", start, clock.mark())
        >>> [e.kind for e in clock.events()]
        ['forward']
    """

    def __init__(self, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        self.records: list[tuple] = []  # (rank, stage_idx, mb_idx, kind, start mark, end mark)
        self.resolved: list[TimelineEvent] | None = None
        # On a GPU: the host's time when an origin event was recorded; events are timed from it.
        self.origin = (time.time(), self.mark()) if self.on_gpu else None

    def mark(self):
        """Now: seconds on the host, or a CUDA event recorded on the current stream."""
        if not self.on_gpu:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, rank: int, stage_idx: int, mb_idx: int, kind: str, start, end) -> None:
        self.records.append((rank, stage_idx, mb_idx, kind, start, end))
        self.resolved = None

    def events(self) -> list[TimelineEvent]:
        """The step's events in seconds; on a GPU this waits for the step's last recorded action."""
        if self.resolved is None:
            if not self.on_gpu:
                self.resolved = [TimelineEvent(*r) for r in self.records]
            else:
                wall, origin = self.origin
                if self.records:
                    self.records[-1][-1].synchronize()  # recorded last on the stream: the others are done too
                seconds = lambda event: wall + origin.elapsed_time(event) / 1e3  # noqa: E731
                self.resolved = [TimelineEvent(*r[:4], seconds(r[4]), seconds(r[5])) for r in self.records]
        return self.resolved
