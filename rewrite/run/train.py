"""`rewrite train`: a small byte-level training run under a plan, on every rank.

Each rank builds the same randomly initialised model (same seed), rewrites it with
the plan, and trains it with AdamW on random windows of a text file read as bytes
(token id = byte, so vocab 256). Step 1 is checked against the same step run
single-process; rank 0 draws the last step's timeline (under the plan's schedule) and the loss curve.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .byte_data import TrainConfigError, default_data_path, load_bytes, sample_batch
from .parity import Parity, parity_check
from .progress import Progress, plot_loss
from ..plan.schema import load_plan
from .presets import build_model, load_config
from ..rewriter import apply_plan
from ..pipeline.runner import run_schedule
from ..pipeline.timeline import events_to_dicts, gather_timeline, plot_timeline

__all__ = [
    "TrainConfig",
    "TrainConfigError",
    "Parity",
    "train",
    "train_main",
    "build_init_kwargs",
    "default_data_path",
    "load_bytes",
    "sample_batch",
    "parity_check",
    "plot_loss",
]


@dataclass
class TrainConfig:
    """What `rewrite train` runs. Every rank must get the same config."""

    plan: str  # plan file; its mesh fixes the number of processes (dp * pp * tp)
    model: str = "tiny-llama"  # preset name, HF config.json, or a local model directory
    data: str | None = None  # text file read as bytes; None: the repository's data/alice29.txt
    steps: int = 30  # optimizer steps
    batch_size: int = 8  # sequences per microbatch (the plan sets microbatches per step and replica)
    seq_len: int = 128  # bytes per sequence; targets are the same window shifted by one
    lr: float = 3e-3  # AdamW learning rate, constant after a short warm-up
    warmup: int = 3  # steps of linear learning-rate warm-up
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    seed: int = 0  # model initialisation and batch sampling: identical on every rank
    out_dir: str = "out/demo"  # rank 0 writes timeline.png, loss.png and metrics.json here
    parity: bool = True  # check step 1 against a single-process run of the same step
    progress: bool = True  # progress bar on rank 0 (else one line per step)
    timeout_s: float = 300.0  # process-group timeout: a collective stuck longer fails the run instead of holding it


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith("ch") else "s")


def _check(config: TrainConfig, plan, model_config, tokens: torch.Tensor) -> None:
    problems = []
    world = dist.get_world_size()
    if world != plan.mesh.world_size:
        problems.append(
            f"{plan.source}: mesh {plan.mesh.shape_text()} needs {plan.mesh.world_size} processes, "
            f"but {world} were started; run `torchrun --nproc-per-node {plan.mesh.world_size} ...` or change the mesh"
        )
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(config, name) < 1:
            problems.append(f"--{name.replace('_', '-')} is {getattr(config, name)}; use 1 or more")
    if config.lr <= 0:
        problems.append(f"--lr is {config.lr}; use a positive learning rate such as 3e-3")
    vocab = getattr(model_config, "vocab_size", 0)
    if vocab < 256:
        problems.append(
            f"the model's vocab_size={vocab} is below 256: byte-level tokens need ids 0..255; "
            "use a tiny preset (vocab_size=256) or a config with vocab_size >= 256"
        )
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and config.seq_len > max_pos:
        problems.append(f"--seq-len {config.seq_len} exceeds the model's max_position_embeddings={max_pos}; lower it")
    if len(tokens) <= config.seq_len + 1:
        problems.append(f"the text has {len(tokens)} bytes, too few for --seq-len {config.seq_len}; use a longer file")
    if problems:
        raise TrainConfigError("rewrite train: " + "\n  ".join(["cannot start:", *problems]))


def train(config: TrainConfig) -> dict:
    """Train under `config.plan` on this rank; returns the run's metrics (the same on every rank).

    Collective: every rank of the default process group calls it with the same config.
    Rank 0 prints the progress, the parity line and a summary, and writes
    `timeline.png`, `loss.png` and `metrics.json` to `config.out_dir`.

    Raises:
        ValueError: a bad plan, model, text or setting (every rank raises the same,
            before the first collective).

    Example:
        >>> dist.init_process_group("gloo", timeout=timedelta(minutes=5))   # under torchrun --nproc-per-node 4
        >>> metrics = train(TrainConfig("plans/llama-tp2-pp2.yaml", steps=30))
    """
    plan = load_plan(config.plan)
    model_config = load_config(config.model)
    data = Path(config.data) if config.data else default_data_path()
    tokens = load_bytes(data)
    m, dp, data_parallel = plan.pipeline.microbatches, plan.mesh.dp, plan.data_parallel.sharding
    _check(config, plan, model_config, tokens)
    rank = dist.get_rank()
    model = build_model(model_config, seed=config.seed)
    model_class = type(model).__name__  # before apply_plan: data parallelism swaps in FSDP's subclass
    total_params = sum(p.numel() for p in model.parameters())
    reference = copy.deepcopy(model) if config.parity else None
    stage = apply_plan(model, plan)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, config.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))

    log = Progress(config.steps, show=rank == 0, bar=config.progress)
    log.write(
        f"training {config.model} ({model_class}, {total_params:,} parameters) under {plan.source}: "
        f"{plan.mesh.shape_text()} on {_n(dist.get_world_size(), 'rank')}; "
        f"{_n(m, 'microbatch')} x {config.batch_size} x {config.seq_len} bytes of {data} per step"
        + (f" and replica ({dp} replicas, {data_parallel} sharding)" if dp > 1 else "")
    )
    log.start()
    losses, step_seconds, parity = [], [], None
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        # The global batch, the same on every rank; each replica runs its own m microbatches of it.
        inputs, targets = sample_batch(
            tokens, microbatches=m * dp, batch_size=config.batch_size, seq_len=config.seq_len, generator=gen
        )
        mine = slice(stage.dp_rank * m, (stage.dp_rank + 1) * m)
        t0 = time.perf_counter()
        loss = run_schedule(stage, inputs[mine], targets[mine])
        seconds = time.perf_counter() - t0
        if step == 1 and reference is not None:
            parity = parity_check(model, reference, inputs, targets, loss)
            reference = None  # free it
            log.write(parity.line())
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(float(loss))
        step_seconds.append(seconds + time.perf_counter() - t0)  # the step itself, not the parity check
        log.step(step, losses[-1], step_seconds[-1])
    wall = time.perf_counter() - start
    log.close()
    events = gather_timeline(stage)
    metrics = {
        "plan": str(plan.source),
        "model": config.model,
        "data": str(data),
        "mesh": {"dp": dp, "pp": plan.mesh.pp, "tp": plan.mesh.tp, "world_size": dist.get_world_size()},
        "config": asdict(config),
        "losses": losses,
        "step_seconds": step_seconds,
        "train_seconds": wall,
        "tokens_per_step": m * dp * config.batch_size * config.seq_len,
        "parity": asdict(parity) if parity is not None else None,
        "timeline": events_to_dicts(events),
    }
    if rank == 0:
        _write_outputs(config, metrics, events, plan)
    return metrics


def _write_outputs(config: TrainConfig, metrics: dict, events, plan) -> None:
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    losses = metrics["losses"]
    title = (
        f"{plan.pipeline.schedule} timeline of step {len(losses)}: {plan.mesh.shape_text()}, "
        f"{plan.pipeline.microbatches} microbatches"
    )
    plot_timeline(events, tp=plan.mesh.tp, title=title, path=out / "timeline.png")
    plot_loss(losses, title=f"{config.model} under {Path(plan.source).name}: loss per step", path=out / "loss.png")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps "
        f"({metrics['train_seconds']:.1f} s, {metrics['train_seconds'] / len(losses):.2f} s/step)",
        flush=True,
    )
    print(f"wrote {out / 'timeline.png'}, {out / 'loss.png'}, {out / 'metrics.json'}", flush=True)


def build_init_kwargs(config: TrainConfig) -> dict:
    """The keyword arguments `train_main` passes to `dist.init_process_group`.

    Raises:
        TrainConfigError: `config.timeout_s` is not a positive, finite number of seconds.

    Example:
        >>> build_init_kwargs(TrainConfig("plans/llama-tp2.yaml", timeout_s=60))
        {'backend': 'gloo', 'timeout': datetime.timedelta(seconds=60)}
    """
    timeout_s = config.timeout_s
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise TrainConfigError(
            f"rewrite train: --timeout is {timeout_s!r}; use a positive number of seconds, e.g. --timeout 300: "
            "how long a rank may wait in a collective for a stuck or lost peer before the run fails"
        )
    return {"backend": "gloo", "timeout": timedelta(seconds=timeout_s)}


def train_main(config: TrainConfig) -> dict:
    """`train` in a process of its own: sets one torch thread, joins the gloo group, leaves it.

    Under torchrun the rendezvous comes from its environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); run directly, it is a world of one process. The group
    it creates has `config.timeout_s` as its timeout, so a stuck rank fails the run
    within that time instead of holding every rank for torch's default 30 minutes. A
    group the caller already created is used as it is, with its own timeout.

    Raises:
        TrainConfigError: a bad `timeout_s`, on every rank, before any collective.
    """
    init_kwargs = build_init_kwargs(config)  # before the rendezvous: no rank is left waiting
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(**init_kwargs)
    try:
        result = train(config)
        if owns_group:
            # Every rank done before any tears down its connections: gloo aborts a process
            # whose peer closes a pair while its own threads still use it.
            dist.barrier()
        return result
    finally:
        if owns_group:
            dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
