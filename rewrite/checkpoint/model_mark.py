"""Which model a training state was written for: its class and its configuration, in `model.json`.

A state of the same shapes loads into any model with its tensor names (a LLaMA's into a Mistral,
rope_theta 10,000 into 500,000): only this mark tells them apart, so `load_training_state` refuses
another model, naming both. A state without the mark loads unchecked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from ..plan.wording import first_few

__all__ = ["MARK_FILE", "model_mark", "write_mark", "model_change"]

MARK_FILE = "model.json"
# What may differ between two runs of one model: how it runs (cache, outputs, attention kernel, dtype)
# and where it was read from, not what it computes.
_RUNTIME = {"_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
            "return_dict", "output_attentions", "output_hidden_states", "attn_implementation", "_commit_hash"}
_WRAPPERS = ("torch.distributed.", "rewrite.")  # where the classes put over a model's own come from


def model_mark(model: nn.Module) -> dict[str, Any]:
    """The model's class, its config's `model_type` and the config's entries that fix what it computes
    (None for a model without a Hugging Face config)."""
    config, entries = getattr(model, "config", None), None
    if config is not None and hasattr(config, "to_dict"):
        entries = {k: v for k, v in config.to_dict().items() if k not in _RUNTIME and not k.startswith("_")}
        entries = json.loads(json.dumps(entries, default=str))  # as the file holds it: tuples as lists
    return {"class": model_class(model), "model_type": getattr(config, "model_type", None), "config": entries}


def model_class(model: nn.Module) -> str:
    """The model's own class name: past the classes FSDP2 (`FSDPLlamaForCausalLM`) and rewrite put over it."""
    return next((c.__name__ for c in type(model).__mro__ if not c.__module__.startswith(_WRAPPERS)),
                type(model).__name__)


def write_mark(path: Path, model: nn.Module) -> None:
    """Write `model`'s mark into the checkpoint directory `path`."""
    (path / MARK_FILE).write_text(json.dumps(model_mark(model), indent=1, sort_keys=True) + "\n")


def model_change(path: Path, model: nn.Module) -> str | None:
    """How the model `path`'s state was written for differs from `model` ('LlamaForCausalLM (llama) ->
    MistralForCausalLM (mistral)', or the differing config entries); None when the same, or unmarked."""
    file = path / MARK_FILE
    if not file.is_file():
        return None
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        return f"its {MARK_FILE} cannot be read ({exc})"
    here = model_mark(model)
    if (saved.get("class"), saved.get("model_type")) != (here["class"], here["model_type"]):
        return f"{_name(saved)} -> {_name(here)}"
    before, after = saved.get("config") or {}, here["config"] or {}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if not changed:
        return None
    shown = first_few([f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in changed], 4)
    return f"{_name(here)} with another configuration ({shown})"


def _name(mark: dict) -> str:
    return f"{mark.get('class')}" + (f" ({kind})" if (kind := mark.get("model_type")) else "")
