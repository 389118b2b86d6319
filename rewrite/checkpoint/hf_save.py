"""Saving a rewritten model as one standard Hugging Face checkpoint (config + safetensors),
from any plan; loading is in `hf_load`, the layout both share in `layout` (docs/checkpoints.md).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from ..agreement import agree, share
from ..lent import lend
from ..mesh import check_world
from ..pipeline.stage import Stage
from ..plan.loading import load_plan
from ..plan.schema import ParallelPlan
from . import swap
from ..plan.ranks import Coords, Shape, expert_place
from .disk_layout import on_disk
from .layout import INDEX, SAVE_ID, Entry, save_problems, shard_file
from .model_mark import model_class
from .pieces import own_cpu

__all__ = ["save_pretrained"]

def save_pretrained(model: nn.Module | Stage, plan: ParallelPlan | str | Path | dict, directory: str | Path) -> Path:
    """Write this rank's part of a rewritten model into one Hugging Face checkpoint directory.

    Collective. Under dp > 1 every replica gathers its FSDP2 shards (`full_tensor`, in the same
    order) and replica 0 alone writes, so the checkpoint is the same whatever the mesh. Each
    stage's tp_rank 0 gathers its tp shards and writes `model-0000{s+1}-of-0000{pp}.safetensors`
    (`model.safetensors` when pp == 1), in the family's on-disk layout when `from_pretrained` reads
    it back; rank 0 writes `config.json` and the index. Tied embeddings are written once. Every
    shard and the index carry the save's id (`rewrite_save_id`), so mixed saves are refused on load.
    All or nothing, even if killed at any instant: written beside `directory`, then swapped in
    one step once every rank succeeded (`swap`, docs/checkpoints.md).

    Args:
        model: this rank's rewritten model, or the `Stage` `apply_plan` returned.
        plan: the plan the model was rewritten with (a `ParallelPlan`, path or dict).
        directory: where the checkpoint goes; must be visible to every rank.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: on every rank, before anything is written, when any rank's model does not
            match the plan. RuntimeError: on every rank when writing or the swap failed on some
            rank; `directory` then holds the old checkpoint (or the new one, complete, when only
            what follows the swap failed).

    Example:
        >>> stage = rewrite.apply_plan(model, "plans/llama-tp2-pp2.yaml")
        >>> rewrite.run_schedule(stage, ids, targets); optimizer.step()
        >>> rewrite.save_pretrained(stage, "plans/llama-tp2-pp2.yaml", "ckpt/")
    """
    plan = load_plan(plan)
    check_world(plan.mesh.shape)
    stage = model if isinstance(model, Stage) else None
    model = stage.model if stage is not None else model
    directory, rank, shape = Path(directory), dist.get_rank(), plan.mesh.shape
    problems, entries = _save_problems(model, plan, stage, directory, rank)
    save_id = agree(problems, f"save_pretrained({str(directory)!r})", view=uuid.uuid4().hex)[0]  # first collective
    tmp = swap.temporary(directory, save_id)
    error, sizes = _write_stage(model, stage, entries, shape.coords(rank), shape, tmp, save_id)
    errors = _put_in_place(model, shape, tmp, directory, save_id, error, sizes)
    if rank == 0 and os.path.lexists(tmp):  # holds nothing needed: the unused new files, or the old ones
        shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        raise RuntimeError(f"save_pretrained({str(directory)!r}) failed:\n  " + "\n  ".join(errors))
    return directory


def _save_problems(model, plan: ParallelPlan, stage: Stage | None, directory: Path, rank: int
                   ) -> tuple[list[str], list[Entry]]:
    """This rank's problems with the model, the plan and the directory, and the entries it writes."""
    problems, entries = [], []
    if not isinstance(model, nn.Module):
        problems.append(f"save_pretrained needs a model or Stage, got {type(model).__name__}")
    elif stage is not None and stage.mesh.shape != plan.mesh.shape:
        problems.append(f"the stage was built with mesh {stage.mesh.shape.text()}, the plan says "
                        f"{plan.mesh.shape_text()}; pass the plan the model was rewritten with")
    else:
        try:
            problems, entries = save_problems(model, plan, rank, stage)
        except Exception as exc:  # a rank that raised alone would leave the others waiting
            problems.append(f"checking the model against the plan: {type(exc).__name__}: {exc}")
    if plan.lora is not None:
        problems.append(f"{plan.source}: {plan.where('lora')}lora: saving a Hugging Face checkpoint (merged, or the "
                        "adapters in PEFT's format) is not built yet for LoRA adapters (apply_plan, run_schedule and "
                        "clip_grad_norm_ train them; docs/lora.md says what comes next)")
    if directory.exists() and not directory.is_dir():
        problems.append(f"{directory} exists and is not a directory; pass a directory path")
    try:
        swap.current(directory)
    except ValueError as exc:
        problems.append(str(exc))
    return problems, entries


def _write_stage(model: nn.Module, stage: Stage | None, entries: list[Entry], at: Coords, shape: Shape, tmp: Path,
                 save_id: str) -> tuple[str | None, dict[str, int]]:
    """Gather this rank's entries (collective over dp, tp and ep) and, on a stage's writing rank, write its
    safetensors file into `tmp`; (this rank's error or None, bytes per tensor written)."""
    pp_rank, head = at.pp, shape.rank(Coords(pp=at.pp))  # the stage's first rank (dp 0, cp 0, tp 0) gathers
    first = at.dp == 0 and at.cp == 0  # the copy that writes: replica 0, cp rank 0
    local = model.state_dict()  # FSDP2 registers its sharded parameters first: DTensors under dp
    error, sizes = None, {}
    try:
        tensors = {}
        experts_group = expert_place(shape, at)[1] == 0 and at.cp == 0  # the stage's first ep group
        for e in entries:  # the same entries, in the same order, on every rank of a dp group
            # This rank's whole tp slice: a sharded DTensor's shards gathered over the dp group (collective;
            # `full_tensor` drops FSDP2's padding); a replicated one or a plain tensor as it is.
            whole = local[e.name].detach()
            whole = whole.full_tensor() if isinstance(whole, DTensor) else whole
            if e.split.over == "ep" and experts_group:  # the first ep group's experts, gathered to its first rank
                gathered = _gather_experts(model, whole, e, head)
                if gathered is not None:
                    tensors[e.canonical] = gathered
            elif first and e.split.over != "ep":  # one replica (and cp rank) writes; the others took part in the gathers
                tensors[e.canonical] = _gather(model, whole, e, stage, head)
        if first and at.tp == 0:
            tmp.mkdir(parents=True, exist_ok=True)
            tensors = on_disk(model.config, tensors)  # the family's stored layout: experts one by one
            tensors = {k: own_cpu(t) for k, t in tensors.items()}  # safetensors refuses shared storage
            save_file(tensors, str(tmp / shard_file(pp_rank, shape.pp)), metadata={"format": "pt", SAVE_ID: save_id})
            sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
        del tensors
    except Exception as exc:  # any rank's failure must reach every rank, or they would wait
        error = f"writing stage {pp_rank}: {type(exc).__name__}: {exc}"
    return error, sizes


def _put_in_place(model: nn.Module, shape: Shape, tmp: Path, directory: Path, save_id: str, error: str | None,
                  sizes: dict[str, int]) -> list[str]:
    """Collective: every rank's outcome shared; when all wrote, rank 0 adds config and index and swaps
    `tmp` in. The errors, the same on every rank (none: the checkpoint is in place)."""
    rank = dist.get_rank()
    results = share((error, sizes))
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(results) if e]
    if errors:
        errors.append(f"nothing in {directory} was changed")
    elif rank == 0:
        try:
            stored = {k: (shape.coords(r).pp, n)  # name: (stage, bytes)
                      for r, (_, s) in enumerate(results) for k, n in s.items()}
            _finish(model, tmp, directory, shape.pp, stored, save_id)
        except Exception as exc:
            errors = [f"rank 0: putting the checkpoint in place: {type(exc).__name__}: {exc}; "
                      f"{directory} holds the old checkpoint or the new one, never a mix: save again"]
    final = share(("\n  ".join(errors) if errors and rank == 0 else None, {}))
    return errors or [e for e, _ in final if e]


def _gather_to(local: torch.Tensor, group, dst: int) -> list[torch.Tensor] | None:
    """Every rank's `local` of `group`, in rank order, on global rank `dst`; None elsewhere."""
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))] if dist.get_rank() == dst else None
    dist.gather(local, parts, dst=dst, group=group)
    lend(local, *(parts or []))
    return parts


def _gather(model: nn.Module, local: torch.Tensor, entry: Entry, stage: Stage | None, dst: int) -> torch.Tensor | None:
    """The full tensor on the stage's tp_rank 0 of replica 0 (global rank `dst`; None elsewhere), gathered
    over the tp group. A slice held by `entry.split.replicas` neighbouring tp ranks (a kv head past the kv heads)
    arrives that many times, alike; the first of each is written."""
    if entry.dim is None:
        return local.detach()
    owner = model.get_submodule(entry.name.rpartition(".")[0])
    group = stage.mesh.tp_group if stage is not None else getattr(owner, "group", None) or owner.tp_group
    parts = _gather_to(local, group, dst)
    return None if parts is None else _joined(parts[:: entry.split.replicas], entry)  # tp ranks [j * r, (j + 1) * r) hold slice j


def _joined(slices: list[torch.Tensor], entry: Entry) -> torch.Tensor:
    """The whole tensor from its slices in rank order. Packed (gate_up_proj, experts read in blocks): each
    rank holds its slice of every part; the whole is part after part."""
    n = entry.split.parts
    return torch.cat([chunk for p in range(n) for chunk in (t.chunk(n, entry.dim)[p] for t in slices)], dim=entry.dim)


def _gather_experts(model: nn.Module, local: torch.Tensor, entry: Entry, dst: int) -> torch.Tensor | None:
    """The whole experts tensor on `dst` (the first ep group's ep rank 0: dp 0, tp 0), None elsewhere: gathered
    over the expert-parallel group, ep rank `r`'s experts at slice `r` of dim 0 (of each block)."""
    parts = _gather_to(local, model.get_submodule(entry.name.rpartition(".")[0]).expert_shard.group, dst)
    return None if parts is None else _joined(parts, entry)


def _finish(model: nn.Module, tmp: Path, directory: Path, pp: int, sizes: dict[str, tuple[int, int]],
            save_id: str) -> None:
    """Rank 0: add config and index to the new checkpoint in `tmp`, then swap it in."""
    config = copy.deepcopy(model.config)
    if dtypes := [p.dtype for p in model.parameters() if p.is_floating_point()]:
        config.dtype = dtypes[0]
    config.architectures = [model_class(model)]  # past FSDP2's class put over it
    config.to_json_file(str(tmp / "config.json"), use_diff=True)
    if (generation := getattr(model, "generation_config", None)) is not None:
        generation.save_pretrained(str(tmp))
    if pp > 1:
        index = {
            "metadata": {"total_size": sum(n for _, n in sizes.values()), SAVE_ID: save_id},
            "weight_map": {k: shard_file(s, pp) for k, (s, _) in sorted(sizes.items())},
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    swap.install(tmp, directory, save_id)
