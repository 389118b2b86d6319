"""What `rewrite train` shows while it runs and draws after: the progress and the loss curve."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["Progress", "plot_loss"]


def plot_loss(losses: list[float], *, title: str = "training loss", path: str | Path | None = None):
    """The loss per step as a line; returns the matplotlib Figure (saved as PNG to `path`)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


class Progress:
    """tqdm on rank 0 when asked for; otherwise one plain line per step (or nothing)."""

    def __init__(self, total: int, *, show: bool, bar: bool):
        self.show, self.want_bar, self.bar, self.total = show, bar, None, total

    def start(self) -> None:
        """Open the bar (after the heading lines, so they print above it)."""
        if self.show and self.want_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

    def step(self, step: int, loss: float, seconds: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f}")
            self.bar.update(1)
        elif self.show:
            print(f"step {step}/{self.total}  loss {loss:.4f}  {seconds:.2f} s", flush=True)

    def write(self, text: str) -> None:
        if not self.show:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
