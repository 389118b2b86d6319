"""The steps of a `rewrite train` run: each one's batch, schedule, gradient norm, update, metrics,
stop-signal check and save, named for a stall report as it goes."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..doing import at_step, doing
from ..pipeline.grad_norm import clip_grad_norm_
from ..pipeline.runner import run_schedule
from ..tensor_parallel.loss import IGNORE_INDEX
from .guard import StateGuard, TrainStopped
from .metrics import MetricsLog, peak_memory_bytes
from .parity import Parity, parity_check
from .progress import Progress
from .signals import StopRequests, TrainInterrupted, stopped_by

if TYPE_CHECKING:
    from .train import Run, TrainConfig

__all__ = ["Steps", "data_key", "run_steps"]


@dataclass
class Steps:
    """What the steps of a run left: their losses and times, the parity check, the guard's counts."""

    guard: StateGuard
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # each step without its parity check
    parity: Parity | None = None
    wall: float = 0.0  # seconds from the first step's start to the last one's end


def data_key(config: TrainConfig) -> dict:
    """What fixes the order of the windows: a resumed run with other values continues on other data."""
    return {"data": config.data, "seq_len": config.seq_len, "seed": config.seed, "pack": config.pack}


def run_steps(run: Run, config: TrainConfig, log: Progress) -> Steps:
    """Train steps `run.first` to `config.steps` on this rank (collective: every rank alike).

    Raises:
        TrainStopped: a non-finite step the guard does not skip, or a save that failed under `stop`.
        TrainInterrupted: SIGINT / SIGTERM: after the step in flight (and its save, unless declined).
    """
    stage = run.stage
    metrics_log = MetricsLog(config.out_dir, enabled=dist.get_rank() == 0, first_step=run.first)
    done = Steps(StateGuard(config.on_nonfinite, config.skip_limit, config.ckpt, run.schedule.base_lrs[0],
                            config.on_save_error))
    log.start()
    reference, start = run.built.reference, time.perf_counter()
    # SIGINT / SIGTERM: stop after the step in flight, saved; the metrics file closed however the loop ends
    with StopRequests(stage.mesh.host_group) as stops, contextlib.closing(metrics_log):
        for step in range(run.first, config.steps + 1):
            at_step(step)  # what each rank does is named by step, for a report if a peer stops answering
            reference = _step(run, config, step, reference, done, metrics_log, log)
            with doing("the stop-signal check (an all-reduce over every rank)"):
                signum = stops.agreed() if step < config.steps else None
            saved = None
            if config.ckpt and (step == config.steps or (config.save_every and step % config.save_every == 0)
                                or (signum and config.save_on_signal)):
                with doing("saving the training state"):
                    saved = done.guard.save(config.ckpt, stage, run.optimizer, run.schedule, log, keep=config.keep,
                                            tokenizer=run.built.tokenizer,
                                            extra={"step": step, "cursor": run.cursor, "data": data_key(config)})
                if saved is not None:
                    log.write(f"saved the training state of step {step} to {saved}")
            if signum:
                raise TrainInterrupted(stopped_by(signum, step, config, saved), signum=signum)
    at_step(None)
    done.wall = time.perf_counter() - start
    return done


def _step(run: Run, config: TrainConfig, step: int, reference, done: Steps, metrics_log: MetricsLog,
          log: Progress):
    """One optimizer step (applied unless the guard skips it); returns the parity reference still to use."""
    stage, optimizer, m = run.stage, run.optimizer, run.plan.pipeline.microbatches
    # The global batch, the same on every rank; each replica runs its own m microbatches of it.
    inputs, targets = run.data.take(step, run.cursor, run.sequences, config.batch_size)
    run.cursor += run.sequences
    mine = slice(stage.dp_rank * m, (stage.dp_rank + 1) * m)
    t0 = time.perf_counter()
    loss = run_schedule(stage, inputs[mine], targets[mine])
    seconds = time.perf_counter() - t0
    if reference is not None:
        done.parity = parity_check(stage.model, reference, inputs, targets, loss)
        reference = None  # free it
        log.write(done.parity.line())
    t0 = time.perf_counter()
    with doing("the gradient norm's all-reduce over every rank"):
        grad_norm = float(clip_grad_norm_(stage, config.max_grad_norm))
    lr = optimizer.param_groups[0]["lr"]
    done.losses.append(float(loss))
    counted = sum(int((t != IGNORE_INDEX).sum()) for t in targets)  # the global batch's
    line = {"loss": done.losses[-1], "lr": lr, "grad_norm": grad_norm, "counted_tokens": counted}
    guard = done.guard
    try:  # the same two numbers on every rank (both reduced over it): every rank decides alike
        applied = guard.applies(step, done.losses[-1], grad_norm)
    except TrainStopped:
        metrics_log.write(step, {**line, "applied": False, "skipped_steps": guard.skipped})
        raise
    if applied:
        optimizer.step()
        run.schedule.step()
    else:
        log.write(f"step {step}: loss {done.losses[-1]:g}, gradient norm {grad_norm:g}: not applied "
                  f"({guard.in_a_row} in a row; --skip-limit {config.skip_limit} stops the run)")
    optimizer.zero_grad(set_to_none=True)
    done.step_seconds.append(seconds + time.perf_counter() - t0)  # the step itself, not the parity check
    metrics_log.write(step, {
        **line, "applied": applied, "skipped_steps": guard.skipped, "step_seconds": done.step_seconds[-1],
        "tokens_per_second": run.sequences * config.seq_len / done.step_seconds[-1],
        "peak_memory_bytes": peak_memory_bytes(run.device),
    })
    log.step(step, done.losses[-1], done.step_seconds[-1])
    if step == run.first and stage.compiled:
        log.write(f"step {step} took {done.step_seconds[-1]:.1f} s, compiling {len(stage.compiled)} blocks (read "
                  "from the compile cache where an earlier run of this plan compiled them)")
    return reference
