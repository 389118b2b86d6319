"""A LoRA run's training state: the adapters and their optimizer state only, and a fingerprint of the frozen
base they were trained on (`lora.json`), so that a resume onto another base, or a LoRA state read as a full
one (or the reverse), is refused naming both."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch.distributed.tensor import DTensor

from ..binding.lora_targets import is_adapter
from ..binding.shard_layout import split_of
from ..errors import CheckpointError
from ..pipeline.stage import Stage

__all__ = ["LORA_FILE", "read_record", "fingerprint", "base_sums", "lora_record", "base_change", "state_kind_problems",
           "base_problem"]

LORA_FILE = "lora.json"
_TOLERANCE = 1e-9  # relative: the same weights summed in another order (another plan's shards) agree far closer


def read_record(path: Path) -> dict | None:
    """The `lora.json` of training-state step directory `path` (None: not a LoRA state)."""
    file = path / LORA_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot read it ({exc}); the checkpoint is damaged") from None


def fingerprint(tensors) -> list[float]:
    """[elements, sum, sum of squares] of `tensors`, in float64: a base's fingerprint, or one rank's part of it."""
    count, total, squares = 0, 0.0, 0.0
    for t in tensors:
        t = t.detach().double()
        count, total, squares = count + t.numel(), total + float(t.sum()), squares + float(t.square().sum())
    return [count, total, squares]


def base_sums(stage: Stage) -> list[float]:
    """This rank's part of the frozen weights' fingerprint, over the copies that count once over every rank
    (`ParamSplit.counts`). Summed over the ranks it is the same for any plan of the same base."""
    return fingerprint(param.to_local() if isinstance(param, DTensor) else param
                       for name, param in stage.model.named_parameters() if not is_adapter(name) and split_of(param).counts)


def _base(sums: list[list[float]]) -> dict:
    """The base's fingerprint as `lora.json` holds it, from every rank's part."""
    count, total, squares = (sum(s[i] for s in sums) for i in range(3))
    return {"elements": int(count), "sum": total, "sum_of_squares": squares}


def lora_record(stage: Stage, sums: list[list[float]]) -> dict:
    """What `lora.json` holds: the plan's LoRA settings and the base's fingerprint (every rank's `base_sums`)."""
    lora = stage.resolved.plan.lora
    return {"rank": lora.rank, "alpha": lora.alpha or lora.rank, "targets": list(stage.resolved.lora_targets),
            "base": _base(sums)}


def base_change(record: dict, sums: list[list[float]]) -> str | None:
    """How the base of fingerprint parts `sums` differs from the one `record` (a `lora.json`) was trained on, in
    words; None when the same."""
    saved, here = record.get("base") or {}, _base(sums)
    if saved.get("elements") == here["elements"] and all(math.isclose(
            saved.get(k, math.nan), here[k], rel_tol=_TOLERANCE, abs_tol=1e-12) for k in ("sum", "sum_of_squares")):
        return None
    return (f"{saved.get('elements')} frozen values summing to {saved.get('sum')!r} (squares "
            f"{saved.get('sum_of_squares')!r}) in its {LORA_FILE}, {here['elements']} summing to {here['sum']!r} (squares "
            f"{here['sum_of_squares']!r}) here")


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
    if stage.resolved.plan.lora is None or (record := read_record(path)) is None:
        return None
    change = base_change(record, sums)
    return None if change is None else f"the adapters were trained on another base model: {change}"
