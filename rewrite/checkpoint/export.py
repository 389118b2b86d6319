"""A training checkpoint (DCP, any plan) to a plain Hugging Face checkpoint, in one process; a LoRA state's
adapters in PEFT's format, or merged into their base."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..binding.lora_targets import is_adapter
from ..errors import CheckpointError
from ..lora import merge_adapters, peft_config, peft_name, put_adapters
from ..lora.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .layout import meta_model
from .lora_state import base_change, fingerprint, read_record
from .pieces import Piece, fit_problems
from .safe_reader import load_pieces, read_metadata
from .state_dirs import checkpoint_path

__all__ = ["export_checkpoint", "checkpoint_path", "export_adapter", "merge_into"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, step: int | None = None,
                      adapter_only: bool = False, base: str | Path | None = None) -> Path:
    """Write the model of a training checkpoint as a plain Hugging Face checkpoint, with its tokenizer.

    A LoRA training state (adapters only) is written as a PEFT adapter directory (`adapter_only=True`), or
    merged into `base`, the Hugging Face checkpoint it was trained on (docs/lora.md).

    No collective (under torchrun, call it on one rank): the whole model is built on the CPU from
    the checkpoint's `config.json`, every tensor read whole from the boxes the training ranks wrote
    (whatever their plan), and `save_pretrained` writes it: `AutoModelForCausalLM.from_pretrained(out_dir)`
    (and `AutoTokenizer`, when the run saved one) loads it.

    Args:
        checkpoint: a run's checkpoint directory (its latest step) or one `step-N` directory.
        out_dir: where the Hugging Face checkpoint goes.
        step: export `step-N` of the run instead of its latest.

    Returns:
        `out_dir`.

    Raises:
        ValueError: no complete checkpoint, or one that does not cover the model of its config; a LoRA state
            with neither `adapter_only` nor `base`, or merged into another base; those options on a full state.

    Example:
        >>> rewrite.export_checkpoint("ckpt", "out/model")
    """
    from transformers import AutoConfig

    path, out_dir = checkpoint_path(checkpoint, step), Path(out_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: it was saved from a model without a Hugging Face config")
    record = read_record(path)
    if record is None and (adapter_only or base is not None):
        raise CheckpointError(f"{path} is a full training state, not a LoRA one: export it without "
                              "adapter_only / base (--adapter-only / --merge)")
    if record is not None:
        if adapter_only == (base is not None):
            raise CheckpointError(f"{path} holds a LoRA training state (the adapters only): export the adapters "
                                  "(adapter_only=True, --adapter-only) or merge them into the base they were "
                                  "trained on (base=DIR, --merge DIR)")
        if adapter_only:
            return export_adapter(path, out_dir, record)
        merge_into(path, out_dir, record, base)
        _copy_tokenizer(Path(base), out_dir)
        return out_dir
    stored = read_metadata(path / ".metadata").state_dict_metadata  # no code of the file runs
    config = AutoConfig.from_pretrained(path)
    floats = {md.properties.dtype for k, md in stored.items() if k.startswith("model/") and md.properties.dtype.is_floating_point}
    model = meta_model(config, dtype=floats.pop() if len(floats) == 1 else None)
    model.to_empty(device="cpu")  # non-persistent buffers (rotary) are not saved: garbage in them is harmless
    state = {f"model/{n}": Piece(t.detach(), t.size(), torch.Size([0] * t.dim())) for n, t in model.state_dict().items()}
    if problems := fit_problems(state, stored):
        raise CheckpointError(f"{path} does not hold the model of its config.json: " + "; ".join(problems))
    load_pieces(state, path, no_dist=True)
    model.save_pretrained(out_dir)
    _copy_tokenizer(path, out_dir)
    return out_dir


def _copy_tokenizer(source: Path, out_dir: Path) -> None:
    """The tokenizer saved at `source`, if any, saved again at `out_dir`."""
    if any((source / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)


def _adapters(path: Path) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the state at `path`, whole (read from the boxes the training ranks wrote)."""
    stored = read_metadata(path / ".metadata").state_dict_metadata  # no code of the file runs
    state = {k: Piece(torch.empty(tuple(md.size), dtype=md.properties.dtype), md.size, torch.Size([0] * len(md.size)))
             for k, md in stored.items() if k.startswith("model/") and is_adapter(k)}
    if not state:
        raise CheckpointError(f"{path} holds no adapter tensors; it is not a LoRA training state")
    load_pieces(state, path, no_dist=True)
    return {k[len("model/"):]: piece.tensor for k, piece in state.items()}


def export_adapter(path: Path, out_dir: str | Path, record: dict) -> Path:
    """The adapters of LoRA state `path` (its `record`) as a PEFT adapter directory: `adapter_config.json` and
    `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, out_dir)` loads."""
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    tensors = _adapters(path)
    linears = [f for f, m in meta_model(AutoConfig.from_pretrained(path)).named_modules() if isinstance(m, nn.Linear)]
    config = peft_config(rank=record["rank"], alpha=record["alpha"], dropout=0.0, targets=record["targets"],
                         linears=linears)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({peft_name(n): t.contiguous() for n, t in tensors.items()}, str(out_dir / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def merge_into(path: Path, out_dir: str | Path, record: dict, base: str | Path) -> nn.Module:
    """The base checkpoint `base` with the adapters of LoRA state `path` merged (`lora.merge_adapters`), saved
    as a plain Hugging Face checkpoint at `out_dir`; the base must be the one the adapters were trained on (its
    fingerprint in `record`). Returns the merged model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if change := base_change(record, [fingerprint(model.parameters())]):
        raise CheckpointError(f"{base} is not the base the adapters of {path} were trained on: {change}; merge into "
                              "that base")
    put_adapters(model, _adapters(path), scaling=record["alpha"] / record["rank"])
    merge_adapters(model)
    model.save_pretrained(str(out_dir))
    return model
