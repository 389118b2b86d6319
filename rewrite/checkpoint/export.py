"""A training checkpoint (DCP, any plan) to a plain Hugging Face checkpoint, in one process."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .layout import meta_model
from .pieces import Piece
from .adapter_export import export_adapter, lora_record_of, merge_into
from .safe_reader import load_pieces, read_metadata
from .training_state import latest_checkpoint, saved_steps, step_dir
from ..errors import CheckpointError

__all__ = ["export_checkpoint", "checkpoint_path"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def checkpoint_path(checkpoint: str | Path, step: int | None = None) -> Path:
    """The `step-N` directory meant by `checkpoint`: a run's directory (its latest, or `step`) or a step's own.

    Raises:
        ValueError: nothing complete there, with what was found.
    """
    checkpoint = Path(checkpoint)
    if step is not None:
        path = step_dir(checkpoint, step)
        if not (path / ".metadata").is_file():
            steps = saved_steps(checkpoint)
            raise CheckpointError(f"{checkpoint} has no complete checkpoint of step {step}; "
                             + (f"its saved steps: {', '.join(map(str, steps))} (`step=N`, or leave `step` out for "
                                f"the latest, {steps[-1]})" if steps else "it holds no saved step"))
    elif (checkpoint / ".metadata").is_file():
        path = checkpoint
    else:
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise CheckpointError(f"{checkpoint} holds no training checkpoint (neither a `latest` file nor a "
                                  ".metadata file); pass the checkpoint directory of a run that saved one")
        path = found[1]
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: it was saved from a model without a Hugging Face config")
    return path


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
    record = lora_record_of(path)
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
    missing = [k for k in state if k not in stored]
    shapes = [k for k in state if k in stored and tuple(stored[k].size) != tuple(state[k].size)]
    if missing or shapes:
        raise CheckpointError(f"{path} does not hold the model of its config.json: {len(missing)} tensors missing "
                              f"{missing[:3]}, {len(shapes)} of another shape {shapes[:3]}")
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        load_pieces(state, path, no_dist=True)
    model.save_pretrained(out_dir)
    _copy_tokenizer(path, out_dir)
    return out_dir


def _copy_tokenizer(source: Path, out_dir: Path) -> None:
    """The tokenizer saved at `source`, if any, saved again at `out_dir`."""
    if any((source / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)
