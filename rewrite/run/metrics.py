"""Per-step metrics of `rewrite train`: one JSON line per step, and TensorBoard events when installed."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

__all__ = ["MetricsLog", "peak_memory_bytes", "strict_json"]


def strict_json(value):
    """`value` with every nan and inf float (at any depth) made None, which JSON writes as null:
    strict readers refuse the NaN that `json.dumps` writes by default."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: CUDA's allocator peak on a GPU, else the peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class MetricsLog:
    """Appends `{"step": n, ...}` lines to `out_dir/metrics.jsonl` (resumed runs continue the file).

    With `tensorboard` installed (`pip install "rewrite[tensorboard]"`), the same scalars
    go to TensorBoard event files in `out_dir/tensorboard`. Only the rank that writes
    makes one (`enabled`); the others do nothing.
    """

    def __init__(self, out_dir: str | Path, *, enabled: bool, first_step: int = 1):
        self.enabled, self.writer, self.file = enabled, None, None
        if not enabled:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "metrics.jsonl"
        kept = []
        if path.exists():  # a resumed run: keep the lines of the steps before it, drop the ones it redoes
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < first_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash
        self.file = open(path, "w")
        self.file.writelines(line + "\n" for line in kept)
        self.file.flush()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the optional extra is not installed
            return
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=first_step)

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(strict_json({"step": step, **values}), allow_nan=False) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
