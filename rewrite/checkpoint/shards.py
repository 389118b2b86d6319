"""Reading checkpoint tensors for this rank: its slice of a file's tensor, its data-parallel
share of that slice, and the buffers a checkpoint does not store.
"""

from __future__ import annotations

from collections.abc import Container
from contextlib import contextmanager
from pathlib import Path
from typing import Union

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..pipeline.stage import Stage
from .disk_layout import Stacked
from .layout import Entry
from .pieces import parameter_names

__all__ = ["Source", "read_slice", "reading", "file_order", "fill_dp_shards", "unstored_modules", "rebuild_unstored"]

Source = Union[tuple[Path, str], Stacked]  # (safetensors file, tensor name in it), or pieces per expert


def file_order(source: Source) -> tuple[Path, str]:
    """Where `source` is read from first: reads sorted by it go through the files in order."""
    return source.first if isinstance(source, Stacked) else source


@contextmanager
def reading(source: Source, entry: Entry):
    """This rank's slice of the tensor `source` holds (a view of the file, valid inside the block)."""
    if isinstance(source, Stacked):
        yield source.read(entry)
        return
    path, key = source
    # A handle per tensor: safetensors maps the file, and the pages a read touched stay
    # resident until the mapping goes, so holding one open would keep them all.
    with safe_open(str(path), framework="pt") as f:
        yield read_slice(f, key, entry)


def read_slice(f, key: str, entry: Entry) -> torch.Tensor:
    """Only this rank's slice of `key`."""
    if entry.dim is None:
        return f.get_tensor(key)
    part = f.get_slice(key)
    pieces = [part[(slice(None),) * entry.dim + (s,)] for s in entry.slices()]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=entry.dim)


def fill_dp_shards(stage: Stage, by_name: dict[str, Entry], sources: dict[str, Source], device) -> list[str]:
    """Data parallelism: give the stage's meta tensors storage, then each its share of the checkpoint.

    `to_empty` allocates every tensor on `device`; FSDP2 re-registers each sharded
    parameter, padded as it pads them, and keeps the parameter objects. Each rank reads
    its tp slice of a tensor (as with dp = 1) and copies into the parameter's local shard
    the part of it `distribute_tensor` places on this rank (with no communication:
    `src_data_rank=None`): torch's split over dp, the same FSDP2 made (`Shard(0)`: its
    dp rows; `Replicate`: all of it).
    """
    model = stage.model
    unstored = unstored_modules(model, by_name)  # before to_empty gives their meta buffers storage (uninitialised)
    paths = parameter_names(model)  # a tied weight has several
    tied = [paths[id(p)][0] for p in stage.tied]
    model.to_empty(device=device)
    for first, *others in (p for p in paths.values() if len(p) > 1):  # to_empty gives each module its own copy
        param = model.get_parameter(first)  # (FSDP2 keeps the one object; DDP's plain parameters are re-tied here)
        for path in others:
            owner, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(owner), leaf, param)
    stage.tied = [model.get_parameter(n) for n in tied]
    slots: dict[int, list] = {}  # id(tensor) -> [(name, tensor)] for each of its names; tied ones share
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        slots.setdefault(id(t), []).append((name, t))
    reads, left = [], []
    for group in slots.values():
        held = [(n, t) for n, t in group if n in by_name]
        if held:
            reads.append((sources[held[0][0]], *held[0]))
        elif not any(n.startswith(m + ".") for n, _ in group for m in unstored):
            left.append(group[0][0])
    problems = []
    for source, name, target in sorted(reads, key=lambda r: (file_order(r[0]), r[1])):  # file order
        path, key = file_order(source)
        try:
            with reading(source, by_name[name]) as data:  # this rank's tp (or ep) slice
                mine, local = data, target
                if isinstance(target, DTensor):
                    mine = distribute_tensor(data, target.device_mesh, target.placements, src_data_rank=None)
                    mine, local = mine.to_local(), target.to_local()  # this dp rank's rows of the slice
                if tuple(mine.shape) != tuple(local.shape):
                    problems.append(f"{name}: this rank's share of the {list(data.shape)} read from {path} is "
                                    f"{list(mine.shape)}, the rewritten model holds {list(local.shape)}")
                    continue
                with torch.no_grad():
                    local.copy_(mine)  # casts to the model's dtype
        except Exception as exc:  # SafetensorError or OSError: the file changed since it was checked
            problems.append(f"{path}: reading {key!r} failed: {exc}")
    if left:
        problems.append(f"tensors the checkpoint does not hold: {left[:5]}; the checkpoint does not cover this model")
    return problems + rebuild_unstored(stage, unstored, device)


def unstored_modules(model: nn.Module, stored: Container[str] = ()) -> list[str]:
    """Modules holding buffers on the meta device that are not among the `stored` names: the checkpoint does
    not store them (rotary `inv_freq`), unlike a router's correction bias."""
    return [name for name, module in model.named_modules()
            if any(b is not None and b.is_meta and (f"{name}.{k}" if name else k) not in stored
                   for k, b in module._buffers.items())]


def rebuild_unstored(stage: Stage, unstored: list[str], device) -> list[str]:
    """Recompute buffers a checkpoint does not store (rotary `inv_freq`) by rebuilding their module."""
    problems = []
    roots = [stage.model] + ([stage.module] if stage.module is not stage.model else [])
    for name in unstored:
        module = stage.model.get_submodule(name)
        config = getattr(module, "config", None)
        if config is None or any(True for _ in module.parameters()) or not name:
            problems.append(f"{name}: unstored buffers {list(module._buffers)} cannot be recomputed")
            continue
        fresh = type(module)(config).to(device)  # built on the real device: computes the buffers
        parent, _, leaf = name.rpartition(".")
        for root in roots:
            try:
                setattr(root.get_submodule(parent), leaf, fresh)
            except AttributeError:
                pass  # an fx stage module need not hold every path
    return problems
