"""PEFT's names for adapter tensors, and adapters in PEFT's names put on a whole model.

PEFT saves an adapter of layer `model.layers.0.self_attn.q_proj` as `base_model.model.model.layers.0.
self_attn.q_proj.lora_A.weight` (and `lora_B.weight`); in memory its modules add the adapter's name
(`lora_A.default.weight`). rewrite's layers hold them as parameters `q_proj.lora_A` and `q_proj.lora_B`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from collections.abc import Mapping

import torch
from torch import nn

from ..binding.lora_targets import is_lora_linear
from ..errors import InputError
from .adapter import LoraLinear

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "peft_name", "from_peft_name", "put_adapters", "peft_config"]

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's adapter directory: its config,
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # and its tensors
_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<layer>.+)\.(?P<leaf>lora_[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


def peft_name(name: str) -> str:
    """PEFT's saved key for adapter parameter `name` (`...q_proj.lora_A` -> `base_model.model....q_proj.lora_A.weight`)."""
    return f"{_PREFIX}{name}.weight"


def from_peft_name(key: str) -> str | None:
    """rewrite's parameter name for PEFT key `key` (saved, or in memory with its adapter's name); None: not an
    adapter's tensor."""
    found = _PEFT_KEY.match(key)
    return f"{found['layer']}.{found['leaf']}" if found else None


def put_adapters(model: nn.Module, tensors: Mapping[str, torch.Tensor], *, scaling: float = 1.0,
                 dropout: float = 0.0) -> list[str]:
    """Give `model` (whole, not yet rewritten) the adapters `tensors` holds, in place, their values copied:
    keys in PEFT's names (saved or in memory) or rewrite's. Returns the adapted layers' paths; `apply_plan`
    with a `lora` section of their rank and targets keeps them.

    Raises:
        InputError: a key that is no adapter's, a layer the model lacks or that is no nn.Linear, a layer
            given one factor only, or factors whose shapes do not fit the layer and each other.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = from_peft_name(key) or (key if key.rpartition(".")[2] in ("lora_A", "lora_B") else None)
        if name is None:
            raise InputError(f"put_adapters: {key!r} is not a LoRA adapter's tensor (expected '...lora_A.weight' or "
                             "'...lora_B.weight'); pass the adapter's tensors only")
        layer, _, leaf = name.rpartition(".")
        pairs.setdefault(layer, {})[leaf] = tensor
    done = []
    for layer, factors in pairs.items():
        if set(factors) != {"lora_A", "lora_B"}:
            raise InputError(f"put_adapters: {layer} has only {', '.join(factors)}; an adapter needs lora_A and lora_B")
        parent_name, _, leaf = layer.rpartition(".")
        try:
            linear = model.get_submodule(layer)
        except AttributeError:
            raise InputError(f"put_adapters: the model has no module {layer}; was the adapter trained on another "
                             "model?") from None
        if not isinstance(linear, nn.Linear):
            raise InputError(f"put_adapters: {layer} is a {type(linear).__name__}, not an nn.Linear")
        a, b = factors["lora_A"], factors["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != linear.in_features or b.shape[0] != linear.out_features \
                or a.shape[0] != b.shape[1]:
            raise InputError(f"put_adapters: {layer}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit a "
                             f"linear of {linear.in_features} -> {linear.out_features} (A [r, in], B [out, r])")
        if not is_lora_linear(linear):
            linear = LoraLinear.from_linear(linear, rank=a.shape[0], scaling=scaling, dropout=dropout)
            setattr(model.get_submodule(parent_name), leaf, linear)
        with torch.no_grad():
            linear.lora_A.copy_(a)
            linear.lora_B.copy_(b)
        done.append(layer)
    return done


def peft_config(*, rank: int, alpha: float, dropout: float, targets: Iterable[str], linears: Iterable[str],
                base: str | None = None) -> dict:
    """PEFT's `adapter_config.json` for adapters of `rank` and `alpha` on the layers `targets`, in a model whose
    linear layers are `linears` (paths). PEFT matches a list of names by each path's last part: the leaf names
    when they pick exactly `targets`, else a pattern matching exactly those paths."""
    targets, linears = sorted(targets), list(linears)
    leaves = sorted({t.rpartition(".")[2] for t in targets})
    if sorted(f for f in linears if f.rpartition(".")[2] in leaves) == targets:
        target_modules: list[str] | str = leaves
    else:
        target_modules = "^(" + "|".join(re.escape(t) for t in targets) + ")$"
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
            "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": target_modules, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None}
