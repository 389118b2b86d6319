"""What a checkpoint's index and safetensors headers say before any tensor is read: where
each tensor is, which save wrote each file, the stored dtypes. Every rank reads every
header, so all decide alike.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..models.names import canonical_names
from .layout import INDEX, SAVE_ID, SINGLE
from ..errors import CheckpointError

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
            raise CheckpointError(
                f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); re-save the checkpoint"
            ) from None
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
    canonical, keys = canonical_names(meta), {}
    for name in meta.state_dict(keep_vars=True):
        key = canonical.get(name, name)
        key = key if key in weight_map else name
        if key in weight_map:
            keys[key] = weight_map[key]
    return keys


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
    more = f" and {len(off) - 3} more" if len(off) > 3 else ""
    return target, (f"the checkpoint's floating tensors have {len(sizes)} dtypes ({counts} tensors); "
                   f"all are cast to {target}, e.g. {', '.join(off[:3])}{more}")


def model_dtype(headers: dict[str, dict], keys: dict[str, str], dtype: torch.dtype | None) -> torch.dtype | None:
    """The one floating dtype the model holds once loaded: `dtype` from `load_dtype`, else the
    one stored (None when the checkpoint stores no floating tensor)."""
    return dtype if dtype is not None else next(iter(_stored_floats(headers, keys)[1]), None)


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
