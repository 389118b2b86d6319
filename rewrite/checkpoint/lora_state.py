"""A LoRA run's training state: the adapters and their optimizer state only, and a fingerprint of the frozen
base they were trained on (`lora.json`), so that a resume onto another base, or a LoRA state read as a full
one (or the reverse), is refused naming both."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from ..binding.lora_targets import is_adapter
from ..binding.shard_layout import split_of
from ..pipeline.stage import Stage

__all__ = ["LORA_FILE", "kept_in_state", "base_sums", "lora_record", "state_kind_problems", "base_problem"]

LORA_FILE = "lora.json"
_TOLERANCE = 1e-9  # relative: the same weights summed in another order (another plan's shards) agree far closer


def kept_in_state(stage: Stage, name: str) -> bool:
    """Whether state-dict tensor `name` is saved in this stage's training state: all of them, or under a LoRA
    plan the adapters' only (the frozen base comes from the model the run starts from)."""
    return stage.resolved.plan.lora is None or is_adapter(name)


def base_sums(stage: Stage) -> list[float]:
    """This rank's part of the frozen weights' fingerprint: [elements, sum, sum of squares] over the copies
    that count once over every rank (`ParamSplit.counts`), in float64. Summed over the ranks it is the same
    for any plan of the same base."""
    count, total, squares = 0, 0.0, 0.0
    for name, param in stage.model.named_parameters():
        if is_adapter(name) or not split_of(param).counts:
            continue
        local = (param.to_local() if isinstance(param, DTensor) else param).detach().double()
        count, total, squares = count + local.numel(), total + float(local.sum()), squares + float(local.square().sum())
    return [count, total, squares]


def lora_record(stage: Stage, sums: list[list[float]]) -> dict:
    """What `lora.json` holds: the plan's LoRA settings and the base's fingerprint (every rank's `base_sums`)."""
    lora = stage.resolved.plan.lora
    count, total, squares = (sum(s[i] for s in sums) for i in range(3))
    return {"rank": lora.rank, "alpha": lora.alpha or lora.rank, "targets": list(stage.resolved.lora_targets),
            "base": {"elements": int(count), "sum": total, "sum_of_squares": squares}}


def state_kind_problems(path: Path, stage: Stage, stored: dict) -> list[str]:
    """A LoRA state read under a plan without `lora`, or a full state under one with it."""
    model_keys = [k[len("model/"):] for k in stored if k.startswith("model/")]
    adapters = [k for k in model_keys if is_adapter(k)]
    full = [k for k in model_keys if not is_adapter(k)]
    lora = stage.resolved.plan.lora
    if lora is None and adapters and not full:
        return [f"{path} holds a LoRA training state (adapters only, e.g. {adapters[0]}); resume it under a plan "
                "with a lora section of its rank (and the base model it was trained on)"]
    if lora is not None and full:
        return [f"{path} holds a full training state (every weight, e.g. {full[0]}), and this plan trains LoRA "
                "adapters only; start the adapters from those weights instead: export the state to a Hugging "
                "Face checkpoint (`rewrite export`) and read it with the lora plan"]
    return []


def base_problem(path: Path, stage: Stage, sums: list[list[float]]) -> str | None:
    """How the frozen base here differs from the one `path`'s adapters were trained on (None: the same, or
    the state has no fingerprint)."""
    file = path / LORA_FILE
    if stage.resolved.plan.lora is None or not file.is_file():
        return None
    try:
        saved = json.loads(file.read_text())["base"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {LORA_FILE} cannot be read ({exc})"
    here = lora_record(stage, sums)["base"]
    same = saved.get("elements") == here["elements"] and all(
        math.isclose(saved.get(k, math.nan), here[k], rel_tol=_TOLERANCE, abs_tol=1e-12) for k in ("sum", "sum_of_squares"))
    if same:
        return None
    return (f"the adapters were trained on another base model: {saved.get('elements')} frozen values summing to "
            f"{saved.get('sum')!r} (squares {saved.get('sum_of_squares')!r}) there, {here['elements']} summing to "
            f"{here['sum']!r} (squares {here['sum_of_squares']!r}) here")
