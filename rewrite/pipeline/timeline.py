"""The pipeline timeline: when a step's actions ran on this rank, every rank's gathered, drawn as a Gantt chart.

On a GPU an action's kernels run after the host has moved on, so the host's clock would
time their launch. A CUDA event recorded before and after an action times the work itself,
and reading one waits for it: the clock reads its events only when the timeline is read,
so timing a step adds no host synchronisation to it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..agreement import share
from ..plan.ranks import Shape
from ..plan.wording import noun_for

if TYPE_CHECKING:
    from .stage import Stage

__all__ = ["StepClock", "TimelineEvent", "gather_timeline", "plot_timeline"]

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
    """One step's action times on this rank: `mark()` before and after, `add` the action, `events()` to read."""

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


# TimelineEvent.kind -> bar colour, and the legend's words for it.
COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "backward-input": "#F2B880", "backward-weight": "#55A868"}
LABELS = {"forward": "forward (F)", "backward": "backward (B)", "backward-input": "backward, input grad (I)",
          "backward-weight": "backward, weight grad (W)"}


def gather_timeline(stage: Stage, *, group=None) -> list[TimelineEvent]:
    """Every rank's events of the last step run through its stage, sorted by rank then start.

    Collective: every rank of `group` (default: the whole world) calls it; every
    rank gets the full list. Times are wall-clock seconds (`time.time()`; on a GPU, CUDA
    events counted from the host's time at the step's start), so ranks on several
    machines are only as aligned as those machines' clocks.

    Example:
        >>> loss = rewrite.run_schedule(stage, inputs, targets)
        >>> events = gather_timeline(stage)       # on every rank
        >>> if dist.get_rank() == 0: plot_timeline(events).savefig("timeline.png")
    """
    mine = [tuple(asdict(e).values()) for e in stage.timeline]  # plain tuples pickle anywhere
    events = [TimelineEvent(*e) for rank_events in share(mine, group=group) for e in rank_events]
    return sorted(events, key=lambda e: (e.rank, e.start))


def plot_timeline(events: Sequence[TimelineEvent], *, tp: int | None = None, cp: int | None = None,
                  title: str | None = None, ax=None, path: str | Path | None = None):
    """A Gantt chart, a row per rank: a bar per action (F blue, B orange, I light orange, W green),
    its microbatch index on each.

    Args:
        events: from `gather_timeline` (or any ranks' `stage.timeline`, concatenated).
        tp: tensor-parallel size, to label rows with their tp rank (rank % tp).
        cp: context-parallel size, to label rows with their cp rank as well.
        title: the chart title; default names the microbatch count.
        ax: a matplotlib Axes to draw on; default: a new figure sized to the ranks.
        path: when given, the figure is saved there as PNG.

    Returns:
        The matplotlib `Figure` (in a notebook, the cell shows it).

    Raises:
        ValueError: no events (run a step with `run_schedule` first).
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not events:
        raise ValueError("no timeline events to plot: run a step with rewrite.run_schedule(stage, ...) first")
    ranks = sorted({e.rank for e in events})
    t0 = min(e.start for e in events)
    span = max(max(e.end for e in events) - t0, 1e-9)
    if ax is None:
        fig = Figure(figsize=(10, 1.0 + 0.6 * len(ranks)), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    row = {rank: i for i, rank in enumerate(ranks)}
    for e in events:
        left, width, y = e.start - t0, max(e.end - e.start, span * 1e-3), row[e.rank]
        ax.barh(y, width, left=left, height=0.7, color=COLORS.get(e.kind, "gray"), edgecolor="white", linewidth=0.5)
        if width > span * 0.012:  # label only bars wide enough to hold a digit
            ax.text(left + width / 2, y, str(e.mb_idx), ha="center", va="center", fontsize=8, color="white")
    labels = []
    for rank in ranks:
        held = sorted({e.stage_idx for e in events if e.rank == rank})
        where = [f"{noun_for(len(held), 'stage')} {','.join(map(str, held))}"]
        if cp and cp > 1:
            where.append(f"cp {Shape(cp=cp, tp=tp or 1).coords(rank).cp}")
        if tp:
            where.append(f"tp {rank % tp}")
        labels.append(f"rank {rank}\n{', '.join(where)}")
    ax.set_yticks(range(len(ranks)), labels)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("seconds since the step's first forward")
    ax.set_title(title or f"Pipeline timeline: {len({e.mb_idx for e in events})} microbatches (numbers on bars), {len(ranks)} ranks")
    kinds = [k for k in COLORS if any(e.kind == k for e in events)] + sorted({e.kind for e in events} - set(COLORS))
    handles = [Patch(color=COLORS.get(k, "gray"), label=LABELS.get(k, k)) for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
