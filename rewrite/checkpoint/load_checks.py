"""What `from_pretrained` reads and checks on each rank before any tensor: the configs, the plan bound to a
meta model, and every file and tensor this rank needs (present, readable, of the config's shape, of one save).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..binding.resolve import ResolvedPlan, resolve
from ..errors import CheckpointError
from ..plan.ranks import expert_place
from ..plan.schema import ParallelPlan, PlanError
from . import swap
from .disk_layout import Source, Stacked, stored_keys, stored_names
from .headers import load_dtype, model_dtype, model_keys, read_headers, save_id_problems, weight_map_of
from .layout import INDEX, Entry, meta_model, stage_entries

__all__ = ["ReadPlan", "plan_read"]


@dataclass
class ReadPlan:
    """What a rank reads of a checkpoint before loading it."""

    problems: list[str] = field(default_factory=list)
    sources: dict = field(default_factory=dict)  # entry name -> where it is stored
    entries: list[Entry] = field(default_factory=list)
    meta: nn.Module | None = None
    generation: object = None  # the GenerationConfig, if stored
    note: str | None = None  # names the tensors a dtype cast changes
    floats: torch.dtype | None = None  # the one floating dtype of the loaded model
    dtype: torch.dtype | None = None  # cast to on load; None keeps the stored one


def plan_read(read: ReadPlan, directory: Path, plan: ParallelPlan, dtype: torch.dtype | None) -> None:
    """Fill `read` as it goes (what was found before an exception is kept): the configs, the plan bound to a
    meta model, and every file and tensor this rank needs checked."""
    at = plan.mesh.shape.coords(dist.get_rank())
    directory = swap.current(directory)  # the old checkpoint, if a save was killed mid-swap
    config, read.generation = _read_configs(directory)
    read.meta = meta = meta_model(config)
    resolved = _resolve(plan, meta, directory, config)
    read.entries = stage_entries(meta, resolved, at.pp, at.tp, expert_place(plan.mesh.shape, at)[0])
    weight_map, index_id = weight_map_of(directory)
    stored, read.problems = stored_names(meta, weight_map, directory)  # transformers' on-disk layout
    read.sources, found = _check_sources(directory, weight_map, read.entries, stored)
    read.problems += found
    headers = read_headers(directory, weight_map.values())  # every file: all ranks decide alike
    read.problems += save_id_problems(directory, headers, index_id)
    keys = {**model_keys(meta, weight_map), **{k: weight_map[k] for k in stored_keys(stored)}}
    read.dtype, read.note = load_dtype(headers, keys, config, dtype)
    read.floats = model_dtype(headers, keys, read.dtype)


def _read_configs(directory: Path):
    from transformers import AutoConfig, GenerationConfig

    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; pass a checkpoint directory (config.json + safetensors files)")
    try:
        config = AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: cannot read the model config: {exc}") from None
    generation = None
    if (directory / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(str(directory))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{directory / 'generation_config.json'}: cannot read it: {exc}") from None
    return config, generation


def _resolve(plan: ParallelPlan, meta: nn.Module, directory: Path, config) -> ResolvedPlan:
    try:
        return resolve(plan, meta, world_size=dist.get_world_size())
    except PlanError as exc:
        fields = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
        desc = ", ".join(f"{f}={getattr(config, f)}" for f in fields if hasattr(config, f))
        raise CheckpointError(
            f"{directory / 'config.json'} ({type(meta).__name__}: {desc}) does not fit the plan; "
            f"change the plan or load another checkpoint:\n{exc}"
        ) from None


def _check_sources(
    directory: Path, weight_map: dict[str, str], entries: list[Entry], stored: dict
) -> tuple[dict[str, Source], list[str]]:
    """Where each entry is stored (`stored`: `disk_layout.stored_names`, for those stored under other names);
    problems for anything missing, unreadable or misshapen."""
    problems, wanted, sources = [], {}, {}
    for e in entries:
        key = e.canonical if e.canonical in weight_map else e.name
        if key not in weight_map:
            if e.name in stored and stored[e.name] is None:
                continue  # stored in a layout not read: reported by stored_names
            key = stored.get(e.name, stored.get(e.canonical))
            if isinstance(key, Stacked):
                found = key.problems(e.name, e.full_shape, e.dim)
                problems += found
                if not found:
                    sources[e.name] = key
                continue
        if key not in weight_map:
            problems.append(
                f"{directory}: tensor {e.name!r} is not in the checkpoint; it does not hold this config's model"
            )
            continue
        wanted.setdefault(weight_map[key], []).append((e, key))
    shapes_off = []
    for file, pairs in wanted.items():
        path = directory / file
        if not path.is_file():
            names = [key for _, key in pairs]
            problems.append(
                f"{path}: shard file missing (the index maps {len(names)} tensors this rank needs to it, "
                f"e.g. {names[0]!r}); copy the complete checkpoint"
            )
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                shapes = {key: tuple(f.get_slice(key).get_shape()) for _, key in pairs if key in keys}
        except Exception as exc:  # SafetensorError or OSError
            problems.append(f"{path}: unreadable ({exc}); the file is corrupted or truncated, re-save it")
            continue
        for e, key in pairs:
            if key not in keys:
                problems.append(f"{path}: no tensor {key!r}, though {INDEX} maps it there; re-save the checkpoint")
            elif shapes[key] != e.full_shape:
                shapes_off.append(
                    f"{path}: tensor {key!r} has shape {list(shapes[key])}, but config.json implies {list(e.full_shape)}"
                )
            else:
                sources[e.name] = (path, key)
    if shapes_off:
        more = f" (and {len(shapes_off) - 2} more tensors)" if len(shapes_off) > 2 else ""
        problems.append("; ".join(shapes_off[:2]) + more + "; the config and the weights do not belong together")
    return sources, problems
