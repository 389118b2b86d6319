"""Loading a Hugging Face checkpoint straight into a parallel plan, each rank reading only its slices."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import agree
from ..mesh import check_world
from ..models.names import first_names
from ..pipeline.param_splits import apply_param_splits
from ..pipeline.stage import Stage
from ..plan.loading import load_plan
from ..plan.schema import ParallelPlan
from ..rewriter import apply_plan
from .layout import Entry
from .load_checks import ReadPlan, plan_read
from .shards import Source, file_order, fill_dp_shards, reading, rebuild_unstored, unstored_modules
from ..errors import CheckpointError

__all__ = ["from_pretrained"]

def from_pretrained(
    directory: str | Path,
    plan: ParallelPlan | str | Path | dict,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Stage:
    """Build a Hugging Face checkpoint's model already rewritten by `plan`, this rank's part only.

    Collective: every rank calls it with the same arguments. The model is built and the
    plan applied on the meta device; each rank reads only its stage's tensors and its
    tp slices (`get_slice`), under dp > 1 only its FSDP2 shard of each (DTensor's own
    split). Rotary frequencies are recomputed from the config; tensors in transformers'
    on-disk layout are read through the family's conversion mapping (`disk_layout`).
    Every rank reads every shard's header, so all decide alike: shards of different saves
    are refused; with `dtype=None` one stored floating dtype is kept, several are cast
    whole to the config's `dtype` (else the one holding most elements), rank 0 warning.
    A `directory` missing because a save was killed mid-swap is read from the old
    checkpoint beside it (`swap`). See docs/checkpoints.md.

    Args:
        directory: a checkpoint directory (`config.json` plus `model.safetensors` or
            `model.safetensors.index.json` and its shards), e.g. from `save_pretrained`
            or `transformers`' own `save_pretrained`.
        plan: a `ParallelPlan`, or a path / dict for `load_plan`.
        device: where this rank's tensors go.
        dtype: cast floating tensors to it; None keeps the stored dtype when there is one.
        compute_dtype: `apply_plan`'s: compute in it over the `dtype` master weights
            (float32 weights, torch.bfloat16 compute: the mixed-precision recipe).

    Returns:
        This rank's `Stage`, as `apply_plan` returns it.

    Raises:
        ValueError: on every rank, before any tensor is read, when the config does not
            fit the plan, the world size is not dp * pp * cp * tp, or a file or tensor this rank
            needs is missing, unreadable or of the wrong shape, or shards come from
            different saves (each named).

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
        plan_read(read, directory, plan, dtype)
    except ValueError as exc:
        read.problems.append(str(exc))
    except Exception as exc:  # anything else too: a rank that raised alone would leave the others waiting
        read.problems.append(f"{type(exc).__name__}: {exc}")
    agree(read.problems, what, error=CheckpointError)  # the first collective: every rank raises, or none does
    if read.note is not None and dist.get_rank() == 0:
        warnings.warn(f"{what}: {read.note}", stacklevel=2)
    if read.floats is not None:  # FSDP2 units keep the dtype their parameters had when made
        read.meta.to(read.floats)
    stage, problems = _load_stage(read.meta, plan, read, device, compute_dtype, what)
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


def _load_stage(meta: nn.Module, plan: ParallelPlan, read: ReadPlan, device, compute_dtype: torch.dtype | None,
                what: str) -> tuple[Stage, list[str]]:
    """The plan applied to the meta model and this rank's tensors read into it; and the problems found."""
    by_name, sources, dtype = {e.name: e for e in read.entries}, read.sources, read.dtype
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


def _materialise(
    model: nn.Module, by_name: dict[str, Entry], sources: dict[str, Source], device, dtype, *, only_tied: bool
) -> list[str]:
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
    problems = []
    for group in sorted(slots.values(), key=lambda g: file_order(sources[g[0][3]])):
        module, kind, leaf, name, old = group[0]
        (path, key), entry = file_order(sources[name]), by_name[name]
        try:
            with reading(sources[name], entry) as data:
                if tuple(data.shape) != tuple(old.shape):
                    problems.append(
                        f"{name}: read {list(data.shape)} from {path}, the rewritten model holds {list(old.shape)}"
                    )
                    continue
                data = _owned(data, device, dtype if dtype is not None and data.is_floating_point() else None)
        except Exception as exc:  # SafetensorError or OSError: the file changed since it was checked
            problems.append(f"{path}: reading {key!r} failed: {exc}")
            continue
        new = nn.Parameter(data, requires_grad=old.requires_grad) if kind == "_parameters" else data
        for module, kind, leaf, _, _ in group:
            getattr(module, kind)[leaf] = new
    return problems


