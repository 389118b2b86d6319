"""What `from_pretrained` reads and checks on each rank before any tensor: the configs, the plan bound to a
meta model, the index and every safetensors header (where each tensor is, which save wrote each file, the
stored dtypes: every rank reads every header, so all decide alike), and every file and tensor this rank needs.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..binding.resolve import ResolvedPlan, resolve
from ..errors import CheckpointError
from ..models.names import canonical_names
from ..binding.lora_targets import is_adapter
from ..lora.apply import apply_lora
from ..plan.ranks import expert_place
from ..plan.schema import ParallelPlan, PlanError
from ..plan.wording import first_few
from . import swap
from .adapter_read import adapter_sources
from .disk_layout import Source, Stacked, Stored, stored_keys, stored_names
from .layout import INDEX, SAVE_ID, SINGLE, Entry, meta_model, stage_entries

__all__ = ["ReadPlan", "plan_read", "load_dtype"]

_FLOATS = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


def weight_map_of(directory: Path) -> tuple[dict[str, str], str | None]:
    """Tensor name -> file name, from the index or the single `model.safetensors`; the index's save id."""
    index = directory / INDEX
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            weight_map, save_id = data["weight_map"], (data.get("metadata") or {}).get(SAVE_ID)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); "
                                  "re-save the checkpoint") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' is not a mapping of tensor names to files; re-save the checkpoint")
        return weight_map, save_id
    single = directory / SINGLE
    if not single.is_file():
        raise CheckpointError(f"{directory}: neither {SINGLE} nor {INDEX} found; pass a safetensors checkpoint directory")
    try:
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE), None
    except Exception as exc:  # safetensors raises its own SafetensorError, or OSError
        raise CheckpointError(f"{single}: unreadable ({exc}); the file is corrupted or truncated, re-save it") from None


def model_keys(meta: nn.Module, weight_map: dict[str, str]) -> dict[str, str]:
    """Checkpoint tensor name -> file, for every tensor the whole model reads (any stage)."""
    canonical = canonical_names(meta)
    keys = [k if (k := canonical.get(name, name)) in weight_map else name for name in meta.state_dict(keep_vars=True)]
    return {key: weight_map[key] for key in keys if key in weight_map}


def read_headers(directory: Path, files) -> dict[str, dict]:
    """File name -> its parsed safetensors header; files that cannot be read are left out
    (the ranks that read tensors from them report it)."""
    out = {}
    for file in sorted(set(files)):
        try:
            with open(directory / file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > _MAX_HEADER:
                    continue
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            continue
        if isinstance(header, dict):
            out[file] = header
    return out


def save_id_problems(directory: Path, headers: dict[str, dict], index_id: str | None) -> list[str]:
    """A problem when the files were not all written by one save: every shard must carry the same save id,
    and the index's when it has one; files written without ids (transformers) are fine when none has one."""
    ids = {file: (h.get("__metadata__") or {}).get(SAVE_ID) for file, h in headers.items()}
    if index_id is not None:
        ids[INDEX] = index_id
    if len(set(ids.values())) <= 1:
        return []
    # The reference is the index's id, else the most common one; the files differing from it are named.
    ref = index_id if index_id is not None else Counter(ids.values()).most_common(1)[0][0]
    same = [f for f, i in ids.items() if i == ref]
    odd = [f"{f} ({'no save id' if i is None else f'save id {i}'})" for f, i in sorted(ids.items()) if i != ref]
    return [
        f"{directory}: files from different saves: {', '.join(odd)}, but {', '.join(same)} "
        f"{'has' if len(same) == 1 else 'have'} {'no save id' if ref is None else f'save id {ref}'}; "
        "a shard was copied in from another checkpoint: copy one save's whole directory, or save again"
    ]


def load_dtype(headers: dict[str, dict], keys: dict[str, str], config, dtype: torch.dtype | None):
    """The dtype every floating tensor is cast to on load (None: keep the stored dtype), and a note naming
    the tensors stored in another dtype (None when there are none).

    `keys`: checkpoint tensor name -> file, for the tensors the model reads. A `dtype` asked for is used;
    else one stored floating dtype is kept, several are cast to the config's `dtype` (`torch_dtype`), else
    to the one holding most elements.
    """
    if dtype is not None:
        return dtype, None
    stored, sizes = _stored_floats(headers, keys)
    if len(sizes) <= 1:
        return None, None
    target = _config_dtype(config) or max(sizes, key=lambda d: (sizes[d], d.itemsize))
    off = sorted(k for k, d in stored.items() if d != target)
    counts = ", ".join(f"{n} in {str(d).removeprefix('torch.')}" for d, n in sorted(
        Counter(stored.values()).items(), key=lambda x: -x[1]))
    return target, (f"the checkpoint's floating tensors have {len(sizes)} dtypes ({counts} tensors); "
                   f"all are cast to {target}, e.g. {first_few(off)}")


def _stored_floats(headers: dict[str, dict], keys: dict[str, str]) -> tuple[dict[str, torch.dtype], Counter]:
    """Checkpoint tensor name -> its stored floating dtype; elements stored in each floating dtype."""
    stored: dict[str, torch.dtype] = {}
    sizes = Counter()
    for key, file in keys.items():
        info = headers.get(file, {}).get(key)
        kind = _FLOATS.get(info.get("dtype")) if isinstance(info, dict) else None
        if kind is not None:
            stored[key] = kind
            sizes[kind] += math.prod(info.get("shape") or [1])
    return stored, sizes


def _config_dtype(config) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


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


def plan_read(read: ReadPlan, directory: Path, plan: ParallelPlan, dtype: torch.dtype | None,
              adapter: Path | None = None) -> None:
    """Fill `read` as it goes (what was found before an exception is kept): the configs, the plan bound to a
    meta model, and every file and tensor this rank needs checked; a LoRA plan's adapters from `adapter` (a
    PEFT adapter directory), else drawn fresh."""
    if adapter is not None and plan.lora is None:
        raise CheckpointError(f"adapter={str(adapter)!r}: the plan has no lora section to train or run it under; "
                              "add one of the adapter's rank and alpha")
    at = plan.mesh.shape.coords(dist.get_rank())
    directory = swap.current(directory)  # the old checkpoint, if a save was killed mid-swap
    config, read.generation = _read_configs(directory)
    read.meta = meta = meta_model(config)
    resolved = _resolve(plan, meta, directory, config)
    weight_map, index_id = weight_map_of(directory)
    stored, read.problems = stored_names(meta, weight_map, directory)  # transformers' on-disk layout
    apply_lora(meta, resolved)  # on the meta device: the adapters get their tensors as the weights do
    read.entries = stage_entries(meta, resolved, at.pp, at.tp, expert_place(plan.mesh.shape, at)[0])
    base = [e for e in read.entries if not is_adapter(e.name)]
    read.sources, found = _check_sources(directory, weight_map, base, stored)
    read.problems += found
    if plan.lora is not None:
        adapters, found = adapter_sources(plan, resolved, read.entries, adapter)
        read.sources.update(adapters)
        read.problems += found
    headers = read_headers(directory, weight_map.values())  # every file: all ranks decide alike
    read.problems += save_id_problems(directory, headers, index_id)
    keys = {**model_keys(meta, weight_map), **{k: weight_map[k] for k in stored_keys(stored)}}
    read.dtype, read.note = load_dtype(headers, keys, config, dtype)
    # The one floating dtype the model holds once loaded: the cast's, else the one stored (None: none stored).
    read.floats = read.dtype if read.dtype is not None else next(iter(_stored_floats(headers, keys)[1]), None)
    for name, source in read.sources.items():  # adapters in the base's dtype
        if is_adapter(name):
            read.sources[name] = replace(source, dtype=read.floats)


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
        raise CheckpointError(f"{directory / 'config.json'} ({type(meta).__name__}: {desc}) does not fit the plan; "
                              f"change the plan or load another checkpoint:\n{exc}") from None


def _check_sources(directory: Path, weight_map: dict[str, str], entries: list[Entry], stored: dict
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
                found = key.problems(e.name, e.full_shape)
                problems += found
                if not found:
                    sources[e.name] = key
                continue
        if key not in weight_map:
            problems.append(f"{directory}: tensor {e.name!r} is not in the checkpoint; it does not hold this config's model")
            continue
        wanted.setdefault(weight_map[key], []).append((e, key))
    shapes_off = []
    for file, pairs in wanted.items():
        path = directory / file
        if not path.is_file():
            problems.append(f"{path}: shard file missing (the index maps {len(pairs)} tensors this rank needs to it, "
                            f"e.g. {pairs[0][1]!r}); copy the complete checkpoint")
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
                shapes_off.append(f"{path}: tensor {key!r} has shape {list(shapes[key])}, "
                                  f"but config.json implies {list(e.full_shape)}")
            else:
                sources[e.name] = Stored(path, key)
    if shapes_off:
        problems.append(first_few(shapes_off, 2, "; ") + "; the config and the weights do not belong together")
    return sources, problems
