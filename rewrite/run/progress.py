"""What `rewrite train` shows while it runs and draws after: the progress and the loss curve."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .metrics import strict_json

__all__ = ["Progress", "plot_loss", "write_outputs"]


def plot_loss(losses: list[float], *, title: str = "training loss", path: str | Path | None = None, first: int = 1,
              steps: list[int] | None = None):
    """The loss per step (the first being step `first`, or each at its own of `steps`) as a line; returns the
    matplotlib Figure (saved as PNG to `path`). Steps are whole numbers on the axis."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps or range(first, first + len(losses)), losses, marker="o", markersize=3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


class Progress:
    """tqdm on rank 0 when asked for; otherwise one plain line per step (or nothing)."""

    def __init__(self, total: int, *, show: bool, bar: bool, done: int = 0):
        self.show, self.want_bar, self.bar, self.total, self.done = show, bar, None, total, done  # done: steps before a resume

    def start(self) -> None:
        """Open the bar (after the heading lines, so they print above it)."""
        if self.show and self.want_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

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


def write_outputs(config, metrics: dict, events, plan) -> None:
    """Rank 0, after the run: the timeline and loss pictures, metrics.json, and a summary line."""
    from ..pipeline.timeline import plot_timeline

    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    losses = metrics["losses"]
    title = (
        f"{plan.pipeline.schedule} timeline of step {metrics['first_step'] + len(losses) - 1}: {plan.mesh.shape_text()}, "
        f"{plan.pipeline.microbatches} microbatches"
    )
    plot_timeline(events, tp=plan.mesh.tp, cp=plan.mesh.cp, title=title, path=out / "timeline.png")
    steps, every = _logged_losses(out / "metrics.jsonl", metrics["first_step"], losses)  # a resumed run: all its steps
    plot_loss(every, steps=steps, title=f"{config.model} under {Path(plan.source).name}: loss per step",
              path=out / "loss.png")
    (out / "metrics.json").write_text(json.dumps(strict_json(metrics), indent=2, allow_nan=False) + "\n")
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps "
        + (f"({metrics['skipped_steps']} not applied: not finite) " if metrics.get("skipped_steps") else "")
        + f"({metrics['train_seconds']:.1f} s, {metrics['train_seconds'] / len(losses):.2f} s/step)",
        flush=True,
    )
    print(f"wrote {out / 'timeline.png'}, {out / 'loss.png'}, {out / 'metrics.json'}", flush=True)


def _logged_losses(path: Path, first: int, losses: list[float]) -> tuple[list[int], list[float]]:
    """(steps, losses) of the whole run as `metrics.jsonl` holds them (the steps before a resume too);
    this run's own when the file is missing or does not end with them."""
    rows = {}
    try:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[int(row["step"])] = None if row["loss"] is None else float(row["loss"])  # null: not finite
    except (OSError, ValueError, KeyError, TypeError):
        rows = {}
    mine = list(range(first, first + len(losses)))
    if [rows.get(step, "missing") for step in mine] != strict_json(losses):
        return mine, losses
    steps = sorted(rows)
    return steps, [math.nan if rows[step] is None else rows[step] for step in steps]
