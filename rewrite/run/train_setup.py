"""What `rewrite train` starts from: the device, the model (a preset, a config, or a Hugging Face
checkpoint with its tokenizer) and the batches it trains on (bytes, or tokenized text)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .byte_data import TrainConfigError, default_data_path, load_bytes, sample_batch
from ..plan.loading import load_plan, load_plan_for
from ..plan.schema import Compile, Lora, ParallelPlan, PlanError
from ..plan.wording import either
from ..values import is_count
from ..plan.ranks import length_problem
from .guard import ON_NONFINITE, ON_SAVE_ERROR
from .init_mark import random_init
from .presets import PRESETS, build_model, load_config

__all__ = ["DEVICES", "DTYPES", "pick_device", "train_plan", "setting_problems", "ModelSource", "model_source", "build_stage",
           "ByteBatches", "TextBatches"]

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DEVICES = ("auto", "cpu", "cuda")  # --device
DTYPES = ("float32", "bfloat16")  # --dtype: the compute dtype over float32 master weights


def pick_device(name: str) -> tuple[torch.device, str]:
    """(this rank's device, the process-group backend) for `--device auto|cpu|cuda`.

    auto: CUDA with NCCL when a GPU is visible, else the CPU with gloo. On CUDA each rank
    takes GPU `LOCAL_RANK` (torchrun sets it).
    """
    if name not in DEVICES:
        raise TrainConfigError(f"--device {name!r}: use {either(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError("--device cuda: no GPU is visible to this process (torch.cuda.is_available() is "
                               "False); use --device cpu, or auto to take a GPU when there is one")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu"), "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise TrainConfigError(f"local rank {local} has no GPU of its own: {torch.cuda.device_count()} visible; "
                               "start at most one process per GPU on each machine")
    return torch.device("cuda", local), "nccl"


@dataclass(frozen=True)
class ModelSource:
    """What `--model` names: a preset, a config (random weights), or a checkpoint (its weights)."""

    name: str
    kind: str  # "preset", "config" or "checkpoint"
    directory: Path | None  # the model directory, when it is one
    tokenizer: bool  # the directory holds a tokenizer: train on its tokens, not bytes
    drawn: bool = False  # a checkpoint of random weights, as `rewrite init-model` drew them (`init_mark`)

    @property
    def trained(self) -> bool:
        """Its weights were trained: fine-tune them (a gentle learning rate), rather than train from scratch."""
        return self.kind == "checkpoint" and not self.drawn

    def describe(self) -> str:
        if self.drawn:
            return "its saved random weights (rewrite init-model: trained from scratch)"
        return "its saved weights" if self.kind == "checkpoint" else "random weights"


def model_source(model: str) -> ModelSource:
    if model in PRESETS:
        return ModelSource(model, "preset", None, False)
    path = Path(model)
    directory = path if path.is_dir() else None
    has = (lambda names: directory is not None and any((directory / n).is_file() for n in names))
    kind = "checkpoint" if has(_WEIGHTS) else "config"
    if kind == "checkpoint" and not has(_TOKENIZER):
        raise TrainConfigError(
            f"{model} holds weights but no tokenizer ({', '.join(_TOKENIZER)}): `rewrite train` tokenizes the "
            "text with the model's own tokenizer; save it there (tokenizer.save_pretrained(DIR)), or use "
            "`rewrite init-model DIR` to make a small model with one"
        )
    return ModelSource(model, kind, directory, has(_TOKENIZER), drawn=kind == "checkpoint" and random_init(directory))


@dataclass
class Built:
    stage: Any
    model_class: str
    total_params: int
    reference: Any  # the single-process copy for the parity check, or None
    tokenizer: Any


def compute_dtype_for(device: torch.device, given: str | None) -> str:
    """`--dtype`, else the recipe's default on `device`: bfloat16 on a GPU that computes in it, else float32
    (as `rewrite plan` and `show` default to bfloat16 on a GPU profile with a bfloat16 peak)."""
    if given is not None:
        return given
    return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


def build_stage(source: ModelSource, plan, *, device: torch.device, seed: int, parity: bool,
                dtype: str = "float32", adapter: str | None = None) -> Built:
    """This rank's stage of the model under `plan` (collective), and what the run reports about it.

    Float32 master weights, computed in `dtype` (`apply_plan`'s compute_dtype). Under a LoRA plan the adapters
    come from `adapter` (a PEFT adapter directory, with a checkpoint's weights) or are drawn; the parity
    reference carries the same."""
    from ..checkpoint.hf_load import from_pretrained
    from ..rewriter import apply_plan

    config = load_config(source.name)
    meta = build_model(config, device="meta")
    model_class, total = type(meta).__name__, sum(p.numel() for p in meta.parameters())
    tokenizer = None
    if source.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.directory)
    if source.kind == "checkpoint":
        reference = None
        if parity:
            from transformers import AutoModelForCausalLM

            reference = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32)
        stage = from_pretrained(source.directory, plan, device=device, dtype=torch.float32,  # float32 master weights
                                compute_dtype=getattr(torch, dtype), adapter=adapter)
    else:
        model = build_model(config, seed=seed, device=device)
        reference = copy.deepcopy(model) if parity else None
        stage = apply_plan(model, plan, compute_dtype=getattr(torch, dtype))
    if reference is not None and plan.lora is not None:
        _adapt_reference(reference, plan, adapter)
    return Built(stage, model_class, total, reference, tokenizer)


def _adapt_reference(reference: nn.Module, plan, adapter: str | None) -> None:
    """The parity reference with the run's adapters: read from `adapter`, else drawn as `apply_plan` draws them."""
    from safetensors.torch import load_file

    from ..binding.resolve import resolve
    from ..lora import apply_lora, put_adapters
    from ..lora.peft_format import ADAPTER_WEIGHTS

    if adapter is not None:
        put_adapters(reference, load_file(str(Path(adapter) / ADAPTER_WEIGHTS)))
    apply_lora(reference, resolve(plan, reference))


def lora_plan(config, plan: ParallelPlan) -> tuple[ParallelPlan, list[str]]:
    """`plan` with the `lora` section `--lora-rank` / `--lora-alpha` ask for, and problems with them."""
    if config.lora_rank is None:
        flags = [f for f, v in (("--lora-alpha", config.lora_alpha),) if v is not None]
        return plan, [f"{flags[0]} needs --lora-rank R" for _ in flags[:1]]
    if plan.lora is not None:
        return plan, [f"{plan.source} has a lora section and --lora-rank was given too; give the adapters' settings once"]
    try:
        lora = Lora(rank=config.lora_rank, alpha=config.lora_alpha)
    except ValueError as exc:
        first = exc.errors()[0] if hasattr(exc, "errors") else {"msg": str(exc), "loc": ("rank",)}
        return plan, [f"--lora-{first['loc'][0]}: {first['msg']}"]
    return plan.model_copy(update={"lora": lora}), []


def compile_plan(config, plan: ParallelPlan) -> ParallelPlan:
    """`plan` compiled (`--compile`: the plan's options, else torch.compile's defaults) or eager (`--no-compile`)."""
    if config.compile is None or (config.compile and plan.compile is not None):
        return plan
    return plan.model_copy(update={"compile": Compile() if config.compile else None})


def train_plan(config) -> ParallelPlan:
    """The plan; a refused one with the rules that match no module of the model beside its problems."""
    try:
        return load_plan(config.plan)
    except PlanError as refused:
        try:
            model = build_model(load_config(config.model), device="meta")
        except ValueError:
            raise refused from None  # the model's own problem is said once the plan is fixed
        return load_plan_for(config.plan, model)  # raises again: the same problems, the model's beside them


def setting_problems(config, plan, model_config) -> list[str]:
    """What is wrong with a `TrainConfig` for this plan and model (every rank finds the same)."""
    problems = []
    world = dist.get_world_size()  # no collective
    if world != plan.mesh.world_size:
        problems.append(
            f"{plan.source}: mesh {plan.mesh.shape_text()} needs {plan.mesh.world_size} processes, "
            f"but {world} {'was' if world == 1 else 'were'} started; run `torchrun --nproc-per-node {plan.mesh.world_size} ...` or change the mesh"
        )
    if plan.lora is not None and config.export and not config.ckpt:
        problems.append(f"--export {config.export}: a LoRA run exports its adapters (PEFT's format) from its last "
                        "training state; add --ckpt DIR")
    if config.adapter is not None and plan.lora is None:
        problems.append(f"--adapter {config.adapter}: the run trains no adapters; add --lora-rank R (the adapter's "
                        "rank) or a lora section to the plan")
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(config, name) < 1:
            problems.append(f"--{name.replace('_', '-')} is {getattr(config, name)}; use 1 or more")
    cp = plan.mesh.cp
    if cp > 1 and config.seq_len >= 1 and (problem := length_problem(config.seq_len, cp)):
        problems.append(f"--seq-len {config.seq_len} under mesh.cp={cp}: {problem}")
    if config.lr is not None and config.lr <= 0:
        problems.append(f"--lr is {config.lr}; use a positive learning rate such as 3e-3 (random weights) or 5e-5 "
                        "(fine-tuning)")
    if config.save_every < 0:
        problems.append(f"--save-every is {config.save_every}; use 0 (only after the last step) or more")
    if config.keep is not None and config.keep < 1:
        problems.append(f"--keep is {config.keep}; keep at least 1 checkpoint")
    if (config.resume or config.save_every) and not config.ckpt:
        problems.append("--resume and --save-every need --ckpt DIR: where the training state is kept")
    if config.dtype is not None and config.dtype not in DTYPES:
        problems.append(f"--dtype {config.dtype!r}: use {either(DTYPES)}")
    if config.on_nonfinite not in ON_NONFINITE:
        problems.append(f"--on-nonfinite {config.on_nonfinite!r}: use {either(ON_NONFINITE)}")
    if config.on_save_error not in ON_SAVE_ERROR:
        problems.append(f"--on-save-error {config.on_save_error!r}: use {either(ON_SAVE_ERROR)}")
    if not is_count(config.skip_limit):
        problems.append(f"--skip-limit is {config.skip_limit!r}; use 1 or more (non-finite steps in a row that stop "
                        "the run)")
    if config.max_grad_norm is not None and not config.max_grad_norm > 0:
        problems.append(f"--max-grad-norm is {config.max_grad_norm}; use a positive norm such as 1.0")
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and config.seq_len > max_pos:
        problems.append(f"--seq-len {config.seq_len} exceeds the model's max_position_embeddings={max_pos}; lower it")
    return problems


class ByteBatches:
    """Random windows of a text file read as bytes (token id = byte), drawn anew for each step."""

    def __init__(self, data: str | None, *, seq_len: int, seed: int):
        self.path = Path(data) if data else default_data_path()
        self.tokens, self.seq_len, self.seed = load_bytes(self.path), seq_len, seed
        self.what = f"bytes of {self.path}"

    def problems(self, vocab_size: int) -> list[str]:
        found = []
        if vocab_size < 256:
            found.append(f"the model's vocab_size={vocab_size} is below 256: byte-level tokens need ids 0..255; "
                         "use a model directory with a tokenizer, a tiny preset, or a config with vocab_size >= 256")
        if len(self.tokens) <= self.seq_len + 1:
            found.append(f"the text has {len(self.tokens)} bytes, too few for --seq-len {self.seq_len}; use a longer file")
        return found

    def take(self, step: int, cursor: int, sequences: int, batch_size: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return sample_batch(self.tokens, microbatches=sequences // batch_size, batch_size=batch_size,
                            seq_len=self.seq_len, generator=gen)


class TextBatches:
    """Tokenized documents packed into windows, shuffled by the seed; the cursor is the position in them."""

    def __init__(self, data: str | None, tokenizer_dir: Path, *, seq_len: int, seed: int):
        from .text_data import load_text_windows

        path = Path(data) if data else default_data_path()
        self.windows = load_text_windows(path, tokenizer_dir, seq_len=seq_len, seed=seed)
        self.what = f"tokens of {path} ({len(self.windows)} windows)"

    def problems(self, vocab_size: int) -> list[str]:
        return []

    def take(self, step: int, cursor: int, sequences: int, batch_size: int):
        inputs, targets = self.windows.take(cursor, sequences)  # (sequences, seq)
        return list(inputs.split(batch_size)), list(targets.split(batch_size))
