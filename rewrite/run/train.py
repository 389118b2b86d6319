"""`rewrite train`: a training run under a plan, on every rank.

The model is a Hugging Face checkpoint directory (its weights, read slice by slice, and
its tokenizer), a config or a preset (random weights, the same seed on every rank). Text
is tokenized with the model's tokenizer and packed into shuffled windows, or read as
bytes when there is no tokenizer. AdamW, a linear warm-up, optional clipping on the global
gradient norm; resumable training state every `save_every` steps (DCP), metrics per step,
and at the end the timeline, the loss curve and optionally a plain HF export.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ..checkpoint.model_mark import model_change
from ..compiled import compile_cache_dir, use_compile_cache
from ..checkpoint.training_state import latest_checkpoint, load_training_state
from ..pipeline.timeline import gather_timeline
from ..plan.wording import plural
from .byte_data import TrainConfigError, default_data_path, load_bytes, sample_batch
from .packing import TuningBatches
from .parity import Parity, parity_check
from .presets import load_config
from .progress import Progress, plot_loss, write_outputs
from .show.columns import format_bytes
from .train_export import export_trained
from .train_loop import Steps, data_key, run_steps
from .train_setup import (ByteBatches, TextBatches, build_stage, compile_plan, compute_dtype_for, lora_plan, model_source,
                          pick_device, setting_problems, train_plan)
from .tuning_data import is_tuning_file

__all__ = [
    "TrainConfig",
    "TrainConfigError",
    "Parity",
    "train",
    "default_data_path",
    "load_bytes",
    "sample_batch",
    "parity_check",
    "plot_loss",
    "Run",
]



RANDOM_LR = 3e-3  # the default learning rate from random weights (a tiny model learns in tens of steps)
LOADED_LR = 5e-5  # and from a checkpoint's weights: fine-tuning, where 3e-3 would undo the pretraining


@dataclass
class TrainConfig:
    """What `rewrite train` runs. Every rank must get the same config."""

    plan: str  # plan file; its mesh fixes the number of processes (dp * pp * cp * tp)
    model: str = "tiny-llama"  # preset name, HF config.json, or a model directory (weights + tokenizer: loaded)
    data: str | None = None  # .txt, .jsonl, a directory of them, or a saved `datasets` dataset; None: data/alice29.txt
    # (a .jsonl of messages or prompt/completion lines: fine-tuning examples, `tuning_data`)
    pack: bool = True  # fine-tuning examples packed several a row (documents apart); False: one a row, padded
    steps: int = 30  # optimizer steps in all (a resumed run goes on up to this many)
    batch_size: int = 8  # sequences per microbatch (the plan sets microbatches per step and replica)
    seq_len: int = 128  # tokens (or bytes) per sequence; targets are the same window shifted by one
    lr: float | None = None  # AdamW learning rate, constant after a short warm-up; None: RANDOM_LR or LOADED_LR
    warmup: int = 3  # steps of linear learning-rate warm-up
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    seed: int = 0  # model initialisation and data order: identical on every rank
    out_dir: str = "out/demo"  # rank 0 writes timeline.png, loss.png, metrics.json and metrics.jsonl here
    parity: bool | None = None  # check step 1 against one process; None: on for random weights in float32 on CPU
    progress: bool = True  # progress bar on rank 0 (else one line per step)
    timeout_s: float = 300.0  # process-group timeout: a collective stuck longer fails the run instead of holding it
    ckpt: str | None = None  # training-state directory (DCP): where --save-every writes and --resume reads
    save_every: int = 0  # save the training state every this many steps (and after the last); 0: only after the last
    keep: int | None = None  # keep this many newest checkpoints; None: all
    resume: bool = False  # continue from the latest complete checkpoint in ckpt, if there is one
    allow_other_model: bool = False  # resume a state written for another model class or config of the same shapes
    export: str | None = None  # write a plain Hugging Face checkpoint (and tokenizer) here at the end
    device: str = "auto"  # auto (CUDA + NCCL when there is a GPU, else CPU + gloo), cpu or cuda
    dtype: str | None = None  # compute dtype over float32 weights, gradients and AdamW state: float32 or bfloat16
    # (FSDP2's mixed precision where dp shards, else autocast); None: bfloat16 on a GPU, float32 on the CPU
    max_grad_norm: float | None = None  # clip gradients to this global norm (over tp, pp and dp); None: no clipping
    lora_rank: int | None = None  # train LoRA adapters of this rank (the plan's `lora`, default targets), the rest frozen
    lora_alpha: float | None = None  # with lora_rank: the adapters' alpha (scale alpha / rank); None: the rank
    compile: bool | None = None  # torch.compile the plan's blocks (True) or run eagerly (False); None: as the plan says
    adapter: str | None = None  # a PEFT adapter directory to start the adapters from (with --model DIR, a lora plan)
    on_nonfinite: str = "stop"  # a step with a nan/inf loss or gradient norm is never applied: stop the run, or skip it
    skip_limit: int = 5  # under on_nonfinite="skip": this many non-finite steps in a row stop the run
    on_save_error: str = "stop"  # a save that does not fit or fails (removed, latest untouched): stop, or continue
    save_on_signal: bool = True  # SIGINT / SIGTERM: save the training state (with ckpt) after the step in flight


def train(config: TrainConfig) -> dict:
    """Train under `config.plan` on this rank; returns the run's metrics (the same on every rank).

    Collective: every rank of the default process group calls it with the same config.
    Rank 0 prints the progress, the parity line and a summary, and writes
    `timeline.png`, `loss.png`, `metrics.json` and `metrics.jsonl` to `config.out_dir`.
    With `config.ckpt`, the training state is saved every `save_every` steps and after the
    last; with `resume`, the run continues from the latest complete one there (any plan's).

    Raises:
        ValueError: a bad plan, model, text or setting (every rank raises the same,
            before the first collective).

    Example:
        >>> dist.init_process_group("gloo", timeout=timedelta(minutes=5))   # under torchrun, 4 processes
        >>> metrics = train(TrainConfig("plans/llama-tp2-pp2.yaml", steps=30))
    """
    gc.disable()  # the model's and optimizer's objects live as long as the run: no collector passes while
    try:  # they are made, and none over them afterwards (the step's own garbage is still collected)
        run = _start(config)
    finally:
        gc.freeze()
        gc.enable()
    log = Progress(config.steps, show=dist.get_rank() == 0, bar=config.progress, done=run.first - 1)
    _announce(run, config, log)
    done = run_steps(run, config, log)
    log.close()
    if config.export:
        export_trained(run.stage, run.plan, run.built.tokenizer, config.export, config.ckpt, config.steps)
    return _report(run, config, done)


@dataclass
class Run:
    """A run set up on this rank: what the loop steps (`train_loop.run_steps`) and the report reads."""

    plan: object  # the ParallelPlan
    source: object  # where the model comes from (`train_setup.model_source`)
    data: object  # the batches: tokenized text, fine-tuning examples or bytes
    device: torch.device
    dtype: str
    built: object  # `train_setup.build_stage`'s result: the stage, the parity reference, the tokenizer
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    sequences: int  # the global batch, in sequences
    resume: tuple | None = None  # (step, directory) of the checkpoint resumed from
    first: int = 1  # the first step this run trains
    cursor: int = 0  # where the data's next window starts
    transplant: str | None = None  # how the resumed state's model differs from this one (--allow-other-model)
    changed: list = field(default_factory=list)  # the data settings that differ from the run that saved

    @property
    def stage(self):
        return self.built.stage


def _start(config: TrainConfig) -> Run:
    """The plan, data, stage and optimizer of a run, the training state resumed; every setting checked first, on
    every rank alike."""
    plan, lora_problems = lora_plan(config, compile_plan(config, train_plan(config)))
    source = model_source(config.model)
    try:
        model_config = load_config(config.model)
    except ValueError as exc:  # from the arguments alone: every rank finds the same, and rank 0 says it once
        raise TrainConfigError(f"rewrite train: cannot start:\n  {exc}") from None
    device, _ = pick_device(config.device)
    dtype = compute_dtype_for(device, config.dtype)
    problems = lora_problems + setting_problems(config, plan, model_config)
    if config.adapter is not None and source.kind != "checkpoint":
        problems.append(f"--adapter {config.adapter}: an adapter is trained on a base model's weights; pass that "
                        "base as --model DIR (a Hugging Face checkpoint directory)")
    if config.parity and dtype != "float32":
        problems.append(f"--parity compares step 1 with one process in float32 to 1e-5, and this run computes in "
                        f"{dtype}: add --dtype float32, or leave --parity out")
    data = _batches(config, source)
    problems += data.problems(getattr(model_config, "vocab_size", 0))
    if problems:
        raise TrainConfigError("rewrite train: " + "\n  ".join(["cannot start:", *problems]))
    resume = latest_checkpoint(config.ckpt) if config.resume and config.ckpt else None
    if plan.compile is not None:
        use_compile_cache()  # before the first compile: the next run of this plan reads what this one compiles
    parity = config.parity
    if parity is None:
        parity = source.kind != "checkpoint" and device.type == "cpu" and dtype == "float32"
    built = build_stage(source, plan, device=device, seed=config.seed, parity=parity and resume is None, dtype=dtype,
                        adapter=config.adapter)
    lr = config.lr if config.lr is not None else LOADED_LR if source.trained else RANDOM_LR
    trained = [p for p in built.stage.parameters() if p.requires_grad]  # under a LoRA plan, the adapters
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=config.weight_decay)
    warmup = max(1, config.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    sequences = plan.pipeline.microbatches * plan.mesh.dp * config.batch_size
    run = Run(plan, source, data, device, dtype, built, optimizer, schedule, sequences, resume)
    if resume is not None:
        _resume(run, config)
    return run


def _batches(config: TrainConfig, source):
    """The run's data: fine-tuning examples or text through the model's tokenizer, else bytes."""
    if source.tokenizer and config.data and is_tuning_file(config.data):
        return TuningBatches(config.data, source.directory, seq_len=config.seq_len, seed=config.seed, pack=config.pack)
    if source.tokenizer:
        return TextBatches(config.data, source.directory, seq_len=config.seq_len, seed=config.seed)
    if config.data and is_tuning_file(config.data):
        raise TrainConfigError(f"rewrite train: cannot start:\n  --data {config.data} holds fine-tuning examples "
                               f"(messages or prompt/completion), which need the model's tokenizer, and --model "
                               f"{config.model} has none; pass a model directory with one (`rewrite init-model DIR`)")
    return ByteBatches(config.data, seq_len=config.seq_len, seed=config.seed)


def _resume(run: Run, config: TrainConfig) -> None:
    """Load the latest training state into the run, refusing one written for another model unless allowed."""
    run.transplant = model_change(run.resume[1], run.stage.model)
    if run.transplant and not config.allow_other_model:  # the same files on every rank: every rank refuses alike
        raise TrainConfigError(f"rewrite train: cannot resume: {run.resume[1]} was written for another model: "
                               f"{run.transplant}; pass the --model it was written for, or --allow-other-model to "
                               "load it into this one on purpose")
    extra = load_training_state(config.ckpt, run.stage, run.optimizer, run.schedule,
                                allow_other_model=config.allow_other_model)  # the base of a LoRA state too
    run.first, run.cursor = extra["step"] + 1, extra["cursor"]
    run.changed = [f"{k} {extra['data'][k]!r} -> {v!r}" for k, v in data_key(config).items()
                   if k in extra.get("data", {}) and extra["data"][k] != v]


def _announce(run: Run, config: TrainConfig, log: Progress) -> None:
    """What is trained on what, and anything the user should know before the first step (rank 0 prints)."""
    plan, built, resume, m, dp = run.plan, run.built, run.resume, run.plan.pipeline.microbatches, run.plan.mesh.dp
    weights = f"the weights of {resume[1]}" if resume is not None else run.source.describe()
    lr = run.schedule.base_lrs[0]  # a resumed run goes on at its saved learning rate
    lr_why = ("--lr" if config.lr is not None and resume is None else "the saved run's" if resume is not None
              else f"the default for {'loaded' if run.source.trained else 'random'} weights; --lr sets it")
    log.write(
        f"training {config.model} ({built.model_class}, {built.total_params:,} parameters) with {weights} "
        f"under {plan.source}, AdamW lr {lr:g} ({lr_why}): "
        f"{plan.mesh.shape_text()} on {plural(dist.get_world_size(), 'rank')} ({run.device.type}, "
        f"{_recipe(run.dtype, built.stage)}); "
        f"{plural(m, 'microbatch')} x {config.batch_size} x {config.seq_len} {run.data.what} per step"
        + (f" and replica ({dp} replicas, {plan.data_parallel.sharding} sharding)" if dp > 1 else "")
    )
    if (lora := plan.lora) is not None:
        log.write(f"LoRA: adapters of rank {lora.rank} (scale {lora.scaling:g}) on "
                  f"{plural(len(run.stage.resolved.lora_targets), 'linear layer')}, "
                  f"{'read from ' + config.adapter if config.adapter else 'fresh (B zero)'}; every other weight frozen")
    if run.stage.compiled:
        log.write(f"compile: {plural(len(run.stage.compiled), 'block')} under torch.compile "
                  f"({plan.compile.backend}), compiled in the first step and kept in {compile_cache_dir()} for the "
                  "next run; --no-compile runs eagerly")
    if hasattr(run.data, "per_step"):
        log.write(run.data.per_step(run.sequences))
    if built.reference is not None:
        held = sum(p.numel() * p.element_size() for p in built.reference.parameters())
        log.write(f"--parity: each rank also holds the whole model once more, in one process, for step 1's check: "
                  f"{format_bytes(2 * held)} of weights and gradients and that model's activations, which `rewrite "
                  "show` does not count and peak_memory_bytes does; --no-parity leaves it out")
    if config.resume and resume is None:
        log.write(f"--resume: {config.ckpt} holds no checkpoint yet (no `latest` file): starting from step 1")
    if resume is not None:
        log.write(f"resumed from {resume[1]}: step {run.first} of {config.steps}" if run.first <= config.steps else
                  f"{resume[1]} is already at step {run.first - 1}, past --steps {config.steps}: nothing to train")
        if run.transplant:
            log.write(f"warning: --allow-other-model: {resume[1]} was written for another model ({run.transplant}); "
                      "its weights and optimizer state are loaded into this one")
        if run.changed:
            log.write(f"warning: the data differ from the run that saved ({'; '.join(run.changed)}): the steps "
                      "from here on do not see the windows an uninterrupted run would")


def _report(run: Run, config: TrainConfig, done: Steps) -> dict:
    """The run's metrics (the same on every rank), written out by rank 0 with the timeline and loss plots."""
    plan, events = run.plan, gather_timeline(run.stage)
    metrics = {
        "plan": str(plan.source),
        "model": config.model,
        "data": run.data.what,
        "mesh": {"dp": plan.mesh.dp, "pp": plan.mesh.pp, "tp": plan.mesh.tp, "world_size": dist.get_world_size()},
        "config": asdict(config),
        "first_step": run.first,
        "losses": done.losses,
        "skipped_steps": done.guard.skipped,
        "failed_saves": done.guard.failed_saves,
        "step_seconds": done.step_seconds,
        "train_seconds": done.wall,
        "tokens_per_step": run.sequences * config.seq_len,
        "parity": asdict(done.parity) if done.parity is not None else None,
        "timeline": [asdict(e) for e in events],
    }
    if dist.get_rank() == 0 and done.losses:
        write_outputs(config, metrics, events, plan)
    return metrics


def _recipe(dtype: str, stage) -> str:
    """'float32', or how the stage computes in bfloat16 over its float32 weights."""
    if stage.precision is None:
        return dtype
    how = "FSDP2 mixed precision" if stage.precision.by == "fsdp" else "autocast"
    return f"{dtype} compute ({how}), float32 weights"
