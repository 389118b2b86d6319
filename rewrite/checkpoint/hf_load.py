"""Loading a Hugging Face checkpoint straight into a parallel plan: each rank reads only its slices (its
dp share of them under dp > 1), and rebuilds the buffers a checkpoint does not store."""

from __future__ import annotations

import warnings
from collections.abc import Container
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..agreement import agree
from ..mesh import check_world
from ..models.names import first_names
from ..pipeline.param_splits import apply_param_splits
from ..pipeline.stage import Stage
from ..plan.loading import load_plan
from ..plan.schema import ParallelPlan
from ..rewriter import apply_plan
from .disk_layout import Source
from .headers import ReadPlan, plan_read
from .layout import Entry
from .pieces import parameter_names
from ..errors import CheckpointError

__all__ = ["from_pretrained"]

def from_pretrained(directory: str | Path, plan: ParallelPlan | str | Path | dict, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
                    adapter: str | Path | None = None) -> Stage:
    """Build a Hugging Face checkpoint's model already rewritten by `plan`, this rank's part only.

    Collective: every rank calls it with the same arguments. The model is built and the plan
    applied on the meta device; each rank reads only its stage's tensors and tp slices
    (`get_slice`), under dp > 1 only its FSDP2 shard of each. Rotary frequencies are recomputed;
    transformers' on-disk layout is read through the family's conversion mapping (`disk_layout`).
    Shards of different saves are refused; with `dtype=None` one stored floating dtype is kept,
    several are cast whole to the config's `dtype` (else the one holding most elements), rank 0
    warning. A save killed mid-swap is read from the old checkpoint beside it (docs/checkpoints.md).

    Args:
        directory: `config.json` plus `model.safetensors` or `model.safetensors.index.json` and its
            shards, from `save_pretrained` or transformers' own.
        plan: a `ParallelPlan`, or a path / dict for `load_plan`.
        device: where this rank's tensors go.
        dtype: cast floating tensors to it; None keeps the stored dtype when there is one.
        compute_dtype: `apply_plan`'s: compute in it over the `dtype` master weights
            (float32 weights, torch.bfloat16 compute: the mixed-precision recipe).
        adapter: a PEFT LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`) for a
            plan with `lora` of its rank and alpha: each rank reads its slices of the adapters. None with
            `lora`: adapters drawn fresh (docs/lora.md).

    Returns:
        This rank's `Stage`, as `apply_plan` returns it.

    Raises:
        ValueError: on every rank, before any tensor is read, when the config does not fit the
            plan, the world size is not dp * pp * cp * tp, or a file or tensor this rank needs is
            missing, unreadable or misshapen, or shards come from different saves (each named).

    Example:
        >>> dist.init_process_group("gloo")                  # under torchrun, 4 processes
        >>> stage = rewrite.from_pretrained("ckpt/", "plans/llama-tp2-pp2.yaml")
        >>> loss = rewrite.run_schedule(stage, ids, targets)
    """
    plan = load_plan(plan)
    check_world(plan.mesh.shape)
    directory = Path(directory)
    what = f"from_pretrained({str(directory)!r}, {plan.source})"
    read = ReadPlan()
    try:
        plan_read(read, directory, plan, dtype, None if adapter is None else Path(adapter))
    except ValueError as exc:
        read.problems.append(str(exc))
    except Exception as exc:  # anything else too: a rank that raised alone would leave the others waiting
        read.problems.append(f"{type(exc).__name__}: {exc}")
    agree(read.problems, what, error=CheckpointError)  # the first collective: every rank raises, or none does
    if read.note is not None and dist.get_rank() == 0:
        warnings.warn(f"{what}: {read.note}", stacklevel=2)
    if read.floats is not None:  # FSDP2 units keep the dtype their parameters had when made
        read.meta.to(read.floats)
    stage, problems = _load_stage(plan, read, device, compute_dtype, what)
    apply_param_splits(stage)  # the tensors read (or given storage) in place of the meta ones carry theirs too
    left = [n for n, t in [*stage.model.named_parameters(), *stage.model.named_buffers()] if t.is_meta]
    if left:
        problems.append(f"tensors left without storage: {left[:5]}; the checkpoint does not cover this model")
    agree(problems, what, error=CheckpointError)
    if floats := [p.dtype for p in stage.model.parameters() if p.is_floating_point()]:
        stage.model.config.dtype = floats[0]
    if read.generation is not None:
        stage.model.generation_config = read.generation
    return stage


def _load_stage(plan: ParallelPlan, read: ReadPlan, device, compute_dtype: torch.dtype | None, what: str
                ) -> tuple[Stage, list[str]]:
    """The plan applied to the meta model and this rank's tensors read into it; and the problems found."""
    meta, by_name, sources, dtype = read.meta, {e.name: e for e in read.entries}, read.sources, read.dtype
    if plan.mesh.dp * plan.mesh.cp > 1:
        # All meta, tied weights too: both ends of a tied pair read it from the checkpoint.
        stage = apply_plan(meta, plan, compute_dtype=compute_dtype)
        return stage, fill_dp_shards(stage, by_name, sources, device)
    # No data-parallel units: plain tensors, each rank's own. Whole tied weights first: apply_plan broadcasts
    # the first stage's copy to the last stage. Tied weights split along the vocabulary stay meta: each end
    # reads its rows.
    agree(_materialise(meta, by_name, sources, device, dtype, only_tied=True), what, error=CheckpointError)
    stage = apply_plan(meta, plan, compute_dtype=compute_dtype)
    names = first_names(stage.model)
    tied = [names[id(p)] for p in stage.tied]
    problems = _materialise(stage.model, by_name, sources, device, dtype, only_tied=False)
    stage.tied = [stage.model.get_parameter(n) for n in tied]  # the loaded tensors, not the meta ones
    problems += rebuild_unstored(stage, unstored_modules(stage.model), device)
    return stage, problems


def _owned(view: torch.Tensor, device, dtype) -> torch.Tensor:
    """A contiguous copy in memory of its own: safetensors hands out views of the memory-mapped file
    (a slice keeps the whole tensor's mapping alive, a row-parallel slice is strided)."""
    out = view.to(device=device, dtype=dtype)
    if out.data_ptr() == view.data_ptr():
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def _materialise(model: nn.Module, by_name: dict[str, Entry], sources: dict[str, Source], device, dtype, *,
                 only_tied: bool) -> list[str]:
    """Replace `model`'s meta tensors that this rank stores by their data (or slice), in file order."""
    slots: dict[int, list] = {}  # id(meta tensor) -> its [(module, kind, leaf, name)]; tied ones share
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for leaf, t in getattr(module, kind).items():
                if t is not None and t.is_meta:
                    name = f"{mod_name}.{leaf}" if mod_name else leaf
                    slots.setdefault(id(t), []).append((module, kind, leaf, name, t))
    # This rank reads a tensor when it holds one of its names; tied copies share the result.
    slots = {k: sorted(v, key=lambda s: s[3] not in by_name) for k, v in slots.items()
             if any(s[3] in by_name for s in v)}
    if only_tied:
        slots = {k: v for k, v in slots.items() if len(v) > 1 and by_name[v[0][3]].dim is None}

    def put(name: str, group: list, data: torch.Tensor, path: Path) -> str | None:
        old = group[0][4]
        if tuple(data.shape) != tuple(old.shape):
            return f"{name}: read {list(data.shape)} from {path}, the rewritten model holds {list(old.shape)}"
        data = _owned(data, device, dtype if dtype is not None and data.is_floating_point() else None)
        new = nn.Parameter(data, requires_grad=old.requires_grad) if group[0][1] == "_parameters" else data
        for module, kind, leaf, _, _ in group:
            getattr(module, kind)[leaf] = new

    return _read_each([(group[0][3], group) for group in slots.values()], by_name, sources, put)


def _read_each(reads: list[tuple[str, Any]], by_name: dict[str, Entry], sources: dict[str, Source], put) -> list[str]:
    """This rank's slice of each (name, target) read, in file order, and handed to `put(name, target, data, path)`,
    which returns a problem or None; the problems, a failed read's too."""
    problems = []
    for name, target in sorted(reads, key=lambda r: (sources[r[0]].order, r[0])):
        path, key = sources[name].order
        try:
            data = sources[name].read(by_name[name])  # this rank's tp (or ep) slice
            if (problem := put(name, target, data, path)) is not None:
                problems.append(problem)
        except Exception as exc:  # SafetensorError or OSError: the file changed since it was checked
            problems.append(f"{path}: reading {key!r} failed: {exc}")
    return problems


def fill_dp_shards(stage: Stage, by_name: dict[str, Entry], sources: dict[str, Source], device) -> list[str]:
    """Data parallelism: give the stage's meta tensors storage, then each its share of the checkpoint.

    `to_empty` allocates every tensor on `device` (FSDP2 re-registers each sharded parameter, padded,
    keeping the objects). Each rank reads its tp slice and copies into the local shard the part
    `distribute_tensor` places on this rank (no communication: `src_data_rank=None`), the split FSDP2 made.
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
        if held := next(((n, t) for n, t in group if n in by_name), None):
            reads.append(held)
        elif not any(n.startswith(m + ".") for n, _ in group for m in unstored):
            left.append(group[0][0])

    def put(name: str, target: torch.Tensor, data: torch.Tensor, path: Path) -> str | None:
        mine, local = data, target
        if isinstance(target, DTensor):
            mine = distribute_tensor(data, target.device_mesh, target.placements, src_data_rank=None)
            mine, local = mine.to_local(), target.to_local()  # this dp rank's rows of the slice
        if tuple(mine.shape) != tuple(local.shape):
            return (f"{name}: this rank's share of the {list(data.shape)} read from {path} is "
                    f"{list(mine.shape)}, the rewritten model holds {list(local.shape)}")
        with torch.no_grad():
            local.copy_(mine)  # casts to the model's dtype

    problems = _read_each(reads, by_name, sources, put)
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
