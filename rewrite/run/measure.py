"""Timing plans on this machine's devices (`rewrite plan --measure K`).

The ranks are started as `rewrite calibrate` starts them (`rewrite.launch`: local processes, one torch
thread each on a CPU, a GPU each with NCCL where there are GPUs); each builds every plan's stage in turn
as `rewrite train` does (`build_stage`: the model's random or saved weights, float32 master weights
computed in the planned dtype) and times its steps as `train` runs them: `run_schedule` over the
replica's microbatches of random tokens, the gradient norm clipped, AdamW. A step is its slowest rank's;
the first ones warm up and are not counted. Rank 0 reports each step to a file the caller reads for
its progress bar.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Job", "Timed", "time_plans", "timing_step"]


@dataclass(frozen=True)
class Job:
    """A plan to time: its file's data, sequences per microbatch, the compute dtype."""

    plan: dict
    batch_size: int
    dtype: str


@dataclass(frozen=True)
class Timed:
    """A plan's measured steps (seconds, each its slowest rank's) and, on a GPU, its busiest rank's peak."""

    steps_s: tuple[float, ...]
    peak_bytes: int | None

    @property
    def median_s(self) -> float:
        return statistics.median(self.steps_s)


def time_plans(model: str, jobs: list[Job], *, world: int, seq_len: int, warmup: int = 1, steps: int = 3,
               timeout_s: float = 900.0, progress=None) -> list[Timed]:
    """Each job timed on `world` local ranks, one after another in the same processes, each plan's process
    groups released before the next is built (as alone in its run).

    `progress(done, total, text)` is called here as rank 0 finishes each step (`text`: what it was).

    Raises:
        LaunchError: a rank failed (its traceback) or `timeout_s` passed; every rank is stopped.
    """
    from .launch import launch

    with tempfile.TemporaryDirectory(prefix="rewrite-measure-") as folder:
        report = Path(folder) / "progress"
        report.touch()
        stop = threading.Event()
        watcher = threading.Thread(target=_follow, args=(report, len(jobs) * (warmup + steps), progress, stop),
                                   daemon=True)
        watcher.start()
        try:
            per_rank = launch(_time_on_rank, world, model, jobs, seq_len, warmup, steps, str(report),
                              timeout_s=timeout_s, init_process_group=False, echo=False)
        finally:
            stop.set()
            watcher.join()
    out = []
    for j in range(len(jobs)):
        slowest = [max(r["steps"][j][i] for r in per_rank) for i in range(steps)]
        peaks = [r["peaks"][j] for r in per_rank if r["peaks"][j] is not None]
        out.append(Timed(tuple(slowest), max(peaks) if peaks else None))
    return out


def _follow(report: Path, total: int, progress, stop: threading.Event) -> None:
    """Call `progress` for each line rank 0 adds to `report`, until `stop`."""
    seen = 0
    while True:
        done = stop.is_set()
        lines = report.read_text().split("\n")[:-1]  # whole lines only: the last may still be being written
        for line in lines[seen:]:
            seen += 1
            if progress is not None:
                progress(seen, total, line)
        if done:
            return
        time.sleep(0.2)


def timing_step(stage, plan, batch_size: int, seq_len: int, vocab: int, *, lr: float = 1e-5, seed: int = 0):
    """One training step of `stage` as `rewrite train` runs it, on random tokens: `run_schedule` over this
    replica's share of a global batch (dp x microbatches x `batch_size` sequences), the gradient norm
    clipped at 1, an AdamW step. Returns the step as a function of no arguments."""
    import torch

    from ..pipeline.grad_norm import clip_grad_norm_
    from ..pipeline.runner import run_schedule

    m, dp = plan.pipeline.microbatches, plan.mesh.dp
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (dp * m * batch_size, seq_len + 1), generator=gen)
    mine = tokens[stage.mesh.dp_rank * m * batch_size:(stage.mesh.dp_rank + 1) * m * batch_size]
    ids = [mine[i * batch_size:(i + 1) * batch_size, :-1].contiguous() for i in range(m)]
    targets = [mine[i * batch_size:(i + 1) * batch_size, 1:].contiguous() for i in range(m)]
    optimizer = torch.optim.AdamW(stage.parameters(), lr=lr)

    def step() -> None:
        run_schedule(stage, ids, targets)
        clip_grad_norm_(stage, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _time_on_rank(model: str, jobs: list[Job], seq_len: int, warmup: int, steps: int, report: str) -> dict:
    import torch
    import torch.distributed as dist

    from ..mesh import release_groups
    from ..plan.loading import load_plan
    from .presets import load_config
    from .train_setup import build_stage, model_source, pick_device

    device, backend = pick_device("auto")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    source, vocab = model_source(model), load_config(model).vocab_size
    rank, times, peaks = dist.get_rank(), [], []
    for j, job in enumerate(jobs):
        plan = load_plan(job.plan)
        stage = build_stage(source, plan, device=device, seed=0, parity=False, dtype=job.dtype).stage
        step = timing_step(stage, plan, job.batch_size, seq_len, vocab)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        mine = []
        for i in range(warmup + steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            sync()
            mine.append(time.perf_counter() - start)
            if rank == 0:
                with open(report, "a") as f:
                    f.write(f"plan {j + 1}/{len(jobs)}, step {i + 1}/{warmup + steps}"
                            f"{' (warm-up)' if i < warmup else ''}: {mine[-1]:.3g} s\n")
        times.append(mine[warmup:])
        peaks.append(int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None)
        # Its groups go with it: each live group's threads wake ~100 times a second, slowing the next plans.
        mesh = stage.mesh
        del stage, step
        release_groups(mesh)
        del mesh
        gc.collect()
        if plan.compile is not None:  # the next plan's blocks compile afresh (not against this one's recompile limit)
            torch.compiler.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return {"steps": times, "peaks": peaks}
