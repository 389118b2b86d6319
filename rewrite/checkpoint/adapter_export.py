"""A LoRA training state (DCP, any plan) out of rewrite, in one process: the adapters in PEFT's format, or
merged into their base as a plain Hugging Face checkpoint."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..binding.lora_targets import is_adapter
from ..errors import CheckpointError
from ..lora import merge_adapters, peft_config, peft_name, put_adapters
from ..lora.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .lora_state import LORA_FILE
from .pieces import Piece
from .safe_reader import load_pieces, read_metadata

__all__ = ["lora_record_of", "export_adapter", "merge_into"]


def lora_record_of(path: Path) -> dict | None:
    """The `lora.json` of training-state step directory `path` (None: not a LoRA state)."""
    file = path / LORA_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot read it ({exc}); the checkpoint is damaged") from None


def _adapters(path: Path) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the state at `path`, whole (read from the boxes the training ranks wrote)."""
    stored = read_metadata(path / ".metadata").state_dict_metadata  # no code of the file runs
    state = {k: Piece(torch.empty(tuple(md.size), dtype=md.properties.dtype), md.size, torch.Size([0] * len(md.size)))
             for k, md in stored.items() if k.startswith("model/") and is_adapter(k)}
    if not state:
        raise CheckpointError(f"{path} holds no adapter tensors; it is not a LoRA training state")
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        load_pieces(state, path, no_dist=True)
    return {k[len("model/"):]: piece.tensor for k, piece in state.items()}


def export_adapter(path: Path, out_dir: str | Path, record: dict) -> Path:
    """The adapters of LoRA state `path` (its `record`) as a PEFT adapter directory: `adapter_config.json` and
    `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, out_dir)` loads."""
    from .layout import meta_model
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
    elements = sum(p.numel() for p in model.parameters())
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    saved = record.get("base", {})
    if elements != saved.get("elements") or not math.isclose(total, saved.get("sum", math.nan), rel_tol=1e-9,
                                                                abs_tol=1e-12):
        raise CheckpointError(f"{base} is not the base the adapters of {path} were trained on: {elements} values "
                              f"summing to {total!r} there, {saved.get('elements')} summing to {saved.get('sum')!r} "
                              "in the state's lora.json; merge into that base")
    put_adapters(model, _adapters(path), scaling=record["alpha"] / record["rank"])
    merge_adapters(model)
    model.save_pretrained(str(out_dir))
    return model
