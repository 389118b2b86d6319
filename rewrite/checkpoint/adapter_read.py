"""Where `from_pretrained` finds a LoRA plan's adapters: in a PEFT adapter directory (`adapter=`), or drawn
fresh (`lora.drawn`). Each is a source `hf_load` reads this rank's slice of, as it reads the base weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..binding.lora_targets import is_adapter
from ..binding.resolve import ResolvedPlan
from ..errors import CheckpointError
from ..lora.adapter import drawn
from ..lora.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, from_peft_name, peft_name
from ..plan.schema import ParallelPlan
from .disk_layout import Stored
from .layout import Entry

__all__ = ["Drawn", "adapter_sources"]


@dataclass(frozen=True)
class Drawn:
    """A fresh adapter factor: drawn whole (the same on every rank, for any plan), this rank's slice kept."""

    name: str
    seed: int = 0  # the plan's lora.seed
    dtype: torch.dtype | None = None

    @property
    def order(self) -> tuple[Path, str]:
        return Path(""), self.name

    def read(self, entry: Entry) -> torch.Tensor:
        return entry.cut(drawn(self.name, entry.full_shape, self.seed)).to(self.dtype or torch.float32)


def adapter_sources(plan: ParallelPlan, resolved: ResolvedPlan, entries: list[Entry], adapter: Path | None
                    ) -> tuple[dict[str, Drawn | Stored], list[str]]:
    """A source for each adapter entry of this rank (the PEFT adapter's tensors, else drawn), and problems: an
    adapter directory that is not PEFT's, of another rank or scale, or not covering the plan's targets."""
    wanted = [e for e in entries if is_adapter(e.name)]
    if adapter is None:
        return {e.name: Drawn(e.name, plan.lora.seed) for e in wanted}, []
    problems = _config_problems(plan, adapter)
    weights = adapter / ADAPTER_WEIGHTS
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {from_peft_name(k): (k, tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception as exc:  # SafetensorError, OSError
        return {}, problems + [f"{weights}: cannot read it ({exc}); pass a PEFT adapter directory "
                               f"({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"]
    held = {n.rpartition(".")[0] for n in shapes if n}
    targets = set(resolved.lora_targets)
    if held != targets:
        extra, missing = sorted(held - targets), sorted(targets - held)
        said = (f"holds adapters on {extra[0]}, which the plan's lora.targets does not name" if extra
                else f"has no adapter on {missing[0]}, which the plan's lora.targets names")
        problems.append(f"{weights} {said} ({len(held)} adapted layers there, {len(targets)} in the plan); "
                        "make lora.targets those the adapter was trained on")
    sources = {}
    for e in wanted:
        key, shape = shapes.get(e.name, (peft_name(e.name), None))
        if shape is None:
            continue  # said above
        if shape != e.full_shape:
            problems.append(f"{weights}: {key} is {list(shape)}, this model's {e.name} is {list(e.full_shape)}; "
                            "the adapter was trained on another model or rank")
            continue
        sources[e.name] = Stored(weights, key)  # in the model's dtype (`headers.plan_read`)
    return sources, problems


def _config_problems(plan: ParallelPlan, adapter: Path) -> list[str]:
    """The adapter's own config against the plan's lora section: its kind, rank and scale."""
    path = adapter / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc}); pass a PEFT adapter directory") from None
    lora, problems = plan.lora, []
    kind = config.get("peft_type")
    if kind not in ("LORA", None):
        problems.append(f"{path}: peft_type {kind!r}; only LoRA adapters are read")
    if config.get("r") != lora.rank:
        problems.append(f"{path}: r={config.get('r')}, the plan's lora.rank is {lora.rank}; make them equal")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or abs(alpha / lora.rank - lora.scaling) > 1e-9:
        problems.append(f"{path}: lora_alpha={alpha}, the plan's lora.alpha is {lora.alpha or lora.rank}; make "
                        "them equal (the adapter was trained with that scale)")
    for flag in ("use_rslora", "use_dora"):
        if config.get(flag):
            problems.append(f"{path}: {flag} is set; only plain LoRA adapters are read (docs/lora.md)")
    return problems
