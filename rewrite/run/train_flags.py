"""The `rewrite train` flags, one row per `TrainConfig` field: the parser and `train_config` both read
this table, so a field cannot get a flag without reaching the config, or the other way round."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from .guard import ON_NONFINITE, ON_SAVE_ERROR
from .presets import PRESETS
from .train import LOADED_LR, RANDOM_LR, TrainConfig
from .train_setup import DEVICES, DTYPES

__all__ = ["PLAN_HELP", "MODEL_HELP", "Flag", "FLAGS", "add_train_flags", "train_config"]

PLAN_HELP = "a plan file (.yaml, .yml or .json)"  # every command's PLAN
MODEL_HELP = f"an HF config.json, a local model directory, or a preset: {', '.join(PRESETS)}"


@dataclass(frozen=True)
class Flag:
    """`add_argument(name, help=help, **options)` setting the `TrainConfig` field `field`.

    The default is the field's own unless `options` has one (or an `action`: a switch).
    """

    field: str
    name: str  # `--steps`, or `plan` for the positional
    help: str
    options: dict = field(default_factory=dict)  # type, metavar, choices, action, dest
    negate: bool = False  # a switch that turns the field off: `--no-progress` sets progress=False

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.name.lstrip("-").replace("-", "_")


# In the order `rewrite train --help` lists them. --parity and --no-parity share one dest.
FLAGS = [
    Flag("plan", "plan", PLAN_HELP, {"metavar": "PLAN"}),
    Flag("model", "--model", MODEL_HELP + " (default %(default)s)", {"metavar": "MODEL"}),
    Flag("data", "--data", "a .txt or .jsonl (a `text` field per line) file, a directory of them, or a `datasets` "
         "dataset saved with save_to_disk; tokenized with the model's tokenizer, or read as bytes when it has none "
         "(default: data/alice29.txt). A .jsonl of `messages` (chat template; the loss on the assistant's turns) or "
         "`prompt`/`completion` lines (the loss on the completion) is fine-tuning data, packed into --seq-len rows"),
    Flag("pack", "--no-pack", "fine-tuning data: one example a row, padded, instead of several packed a row "
         "(documents kept apart)", {"action": "store_true"}, negate=True),
    Flag("steps", "--steps", "optimizer steps (default %(default)s)", {"type": int}),
    Flag("batch_size", "--batch-size", "sequences per microbatch (default %(default)s)", {"type": int}),
    Flag("seq_len", "--seq-len", "tokens (bytes) per sequence (default %(default)s)", {"type": int}),
    Flag("lr", "--lr", f"AdamW learning rate (default: {RANDOM_LR:g} from random weights, {LOADED_LR:g} from a "
         "checkpoint's)", {"type": float}),
    Flag("seed", "--seed", "model init and batch sampling seed (default %(default)s)", {"type": int}),
    Flag("out_dir", "--out", "where rank 0 writes timeline.png, loss.png, metrics.json (default %(default)s)"),
    Flag("warmup", "--warmup", "steps of linear LR warm-up (default %(default)s)", {"type": int}),
    Flag("weight_decay", "--weight-decay", "AdamW weight decay (default %(default)s)", {"type": float}),
    Flag("parity", "--parity", "check step 1 against one process (default: on for random weights in float32 on CPU)",
         {"dest": "parity", "action": "store_true", "default": None}),
    Flag("parity", "--no-parity", "skip the single-process check of step 1",
         {"dest": "parity", "action": "store_false"}),
    Flag("ckpt", "--ckpt", "training-state directory (model, optimizer, scheduler, RNG, data position; "
         "torch.distributed.checkpoint), saved after the last step", {"metavar": "DIR"}),
    Flag("save_every", "--save-every", "also save the training state every N steps", {"type": int, "metavar": "N"}),
    Flag("keep", "--keep", "keep only the K newest checkpoints", {"type": int, "metavar": "K"}),
    Flag("resume", "--resume", "continue from the latest complete checkpoint in --ckpt (any plan's); start fresh "
         "when there is none, so one command serves every restart", {"action": "store_true"}),
    Flag("allow_other_model", "--allow-other-model", "with --resume: load a training state written for another "
         "model class or configuration of the same shapes (refused by default, naming both)", {"action": "store_true"}),
    Flag("export", "--export", "at the end, write a plain Hugging Face checkpoint (with the tokenizer) to DIR",
         {"metavar": "DIR"}),
    Flag("device", "--device", "auto: CUDA with NCCL when there is a GPU (one per rank), else CPU with gloo",
         {"choices": DEVICES}),
    Flag("dtype", "--dtype", "compute dtype over float32 weights, gradients and AdamW state (FSDP2 mixed precision "
         "where dp shards, else autocast; docs/precision.md); default: bfloat16 on a GPU, float32 on the CPU",
         {"dest": "train_dtype", "choices": DTYPES}),
    Flag("max_grad_norm", "--max-grad-norm", "clip gradients to this norm of the whole model (over tp, pp and dp)",
         {"type": float, "metavar": "NORM"}),
    Flag("lora_rank", "--lora-rank", "train LoRA adapters of rank R on every decoder layer's attention and MLP "
         "projections, every other weight frozen (the plan's `lora` section; docs/lora.md)",
         {"type": int, "metavar": "R"}),
    Flag("lora_alpha", "--lora-alpha", "with --lora-rank: the adapters' alpha, their scale alpha / R (default: R)",
         {"type": float, "metavar": "ALPHA"}),
    Flag("compile", "--compile", "torch.compile every decoder layer, the embedding and the head (the plan's `compile`; "
         "docs/compile.md)", {"dest": "compile", "action": "store_true", "default": None}),
    Flag("compile", "--no-compile", "run eagerly, whatever the plan's `compile` says",
         {"dest": "compile", "action": "store_false"}),
    Flag("adapter", "--adapter", "start the adapters from a PEFT LoRA adapter directory (adapter_config.json, "
         "adapter_model.safetensors) trained on --model DIR", {"metavar": "DIR"}),
    Flag("on_nonfinite", "--on-nonfinite", "a step whose loss or gradient norm is nan or inf is never applied "
         "nor saved: stop the run (exit 1, naming the last finite checkpoint) or skip the step (default "
         "%(default)s)", {"choices": ON_NONFINITE}),
    Flag("skip_limit", "--skip-limit", "with --on-nonfinite skip, stop after N non-finite steps in a row (default "
         "%(default)s)", {"type": int, "metavar": "N"}),
    Flag("on_save_error", "--on-save-error", "a save that would not fit or fails (a full disk): nothing of it is "
         "kept and `latest` is untouched; stop the run (exit 1) or continue training without it (default "
         "%(default)s)", {"choices": ON_SAVE_ERROR}),
    Flag("save_on_signal", "--no-save-on-signal", "on SIGINT (Ctrl-C) or SIGTERM, stop after the step in flight "
         "without saving the training state there (by default it is saved with --ckpt; a second Ctrl-C stops at once)",
         {"action": "store_true"}, negate=True),
    Flag("progress", "--no-progress", "no progress bar (a line per step instead)", {"action": "store_true"},
         negate=True),
    Flag("timeout_s", "--timeout", "process-group timeout, > 0: a rank waiting longer than this in a collective (a "
         "peer stuck or gone) fails the run instead of holding every rank for torch's default 30 minutes (default "
         "%(default)g). Applies to the group `train` creates; a group the caller already initialised keeps its own "
         "timeout", {"type": float, "metavar": "SECONDS"}),
]


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """Add every row of `FLAGS` to `parser` (the `train` subcommand's)."""
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for flag in FLAGS:
        options = dict(flag.options)
        if "action" not in options and defaults[flag.field] is not MISSING:
            options.setdefault("default", defaults[flag.field])
        parser.add_argument(flag.name, help=flag.help, **options)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` that parsed `rewrite train` flags ask for."""
    values = {}
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        values[flag.field] = not value if flag.negate else value
    return TrainConfig(**values)
