"""Each rank's part of a training checkpoint as boxes of whole tensors, for torch.distributed.checkpoint.

Tensor-parallel slices, FSDP2's row shards of them and pipeline stages all come down to boxes,
so DCP writes each rank's own boxes (replicated ones once) and, on load, reads any box from
whatever boxes another plan wrote: that is the resharding between plans. The planners are DCP's
documented extension point taught about pieces; files, metadata, deduplication and the overlap
reads are DCP's own. Optimizer moments are boxed like their parameters, so they reshard with them.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..binding.lora_targets import is_adapter
from ..pipeline.stage import Stage
from ..errors import CheckpointError, InputError, first_line

__all__ = ["Piece", "PieceSavePlanner", "PieceLoadPlanner", "model_pieces", "piece_like", "optimizer_pieces",
           "fresh_optimizer_pieces", "fit_problems"]


@dataclass(frozen=True)
class Piece:
    """The box `tensor` this rank holds of a whole tensor of size `size`, starting at `offsets`.

    A packed layer's rows (a fused gate_up_proj keeps its slice of each part) are several boxes
    along `dim` (0; an experts tensor's features: 1 or 2), one per `rows` entry.
    """

    tensor: torch.Tensor  # this rank's data (a view into the live tensor: loads write through it)
    size: torch.Size  # the whole tensor's
    offsets: torch.Size
    rows: tuple[tuple[int, int, int], ...] = ()  # several boxes: (local start, length, whole start) each
    dim: int = 0  # the dim `rows` run along

    def boxes(self) -> list[tuple[torch.Tensor, torch.Size]]:
        """(data, offsets) of each box: views into `tensor`."""
        if not self.rows:
            return [(self.tensor, self.offsets)]
        before, after = tuple(self.offsets[:self.dim]), tuple(self.offsets[self.dim + 1:])
        return [(self.tensor.narrow(self.dim, a, n), torch.Size((*before, at, *after))) for a, n, at in self.rows]

    def box_at(self, offsets) -> torch.Tensor:
        """The data of the box that starts at `offsets`."""
        return next(t for t, o in self.boxes() if tuple(o) == tuple(offsets))

    @property
    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for t, o in self.boxes()]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def piece_like(value: torch.Tensor, box: Piece) -> Piece:
    """`value` (e.g. an optimizer moment of a parameter) in the same box as that parameter's."""
    return Piece(_local(value).detach(), box.size, box.offsets, box.rows, box.dim)


def _box(name: str, tensor: torch.Tensor, tp_dim: int | None, slices: int, slot: int, parts: int = 1) -> Piece:
    """Where this rank's `tensor` sits in the whole: tp slice `slot` of `slices` along `tp_dim`, then FSDP2's rows.

    `slices` is tp, or tp / replicas past the kv heads (`slot` = tp_rank // replicas): the replicas
    hold the same box, written once by DCP's deduplication. `parts` > 1: the tp slice is one slice of
    each of that many equal parts of the whole.
    """
    shape = list(tensor.shape)  # a DTensor's shape: its whole tp slice
    size, start, extent = list(shape), [0] * len(shape), list(shape)
    if tp_dim is not None:
        size[tp_dim] *= slices
        start[tp_dim] = slot * shape[tp_dim]
    local = _local(tensor).detach()
    if isinstance(tensor, DTensor):
        coordinate = tensor.device_mesh.get_coordinate() or []
        for mesh_dim, placement in enumerate(tensor.placements):
            if isinstance(placement, Replicate):
                continue
            if type(placement) is not Shard:
                raise InputError(f"{name}: a DTensor placed as {placement} cannot be checkpointed; only Shard and Replicate")
            d, n = placement.dim, extent[placement.dim]
            chunk = math.ceil(n / tensor.device_mesh.size(mesh_dim))  # torch.chunk's split, as FSDP2 makes it
            lo = min(coordinate[mesh_dim] * chunk, n)
            start[d] += lo
            extent[d] = min(lo + chunk, n) - lo
    if list(local.shape) != extent:
        raise InputError(f"{name}: the local shard has shape {list(local.shape)}, its placement gives {extent}")
    if parts == 1:
        return Piece(local, torch.Size(size), torch.Size(start))
    # Rows [lo, hi) of this rank's tp slice are held here; the slice's p-th length rows are part p's.
    d = tp_dim
    length, whole = shape[d] // parts, size[d] // parts
    lo = start[d] - slot * shape[d]
    hi = lo + extent[d]
    rows = tuple((a - lo, b - a, p * whole + slot * length + a - p * length) for p in range(parts)
                 for a, b in [(max(lo, p * length), min(hi, (p + 1) * length))] if b > a)
    return Piece(local, torch.Size(size), torch.Size(start), rows or ((0, 0, start[d]),), d)


def model_pieces(stage: Stage) -> dict[str, Piece]:
    """Every tensor of this rank's state dict (tied ones under each name), as a box of the whole model's; under a
    LoRA plan the adapters' only (the frozen base comes from the model the run starts from)."""
    tp_rank, ep_rank = stage.mesh.tp_rank, stage.mesh.ep_rank
    out = {}
    for name, tensor in stage.model.state_dict(keep_vars=True).items():
        if stage.resolved.plan.lora is not None and not is_adapter(name):
            continue
        split = stage.resolved.split_of(name)
        out[name] = _box(name, tensor, split.dim, split.slices, split.slot(split.holder(tp_rank, ep_rank)), split.parts)
    return out


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has (tied parameters have several)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def optimizer_pieces(stage: Stage, optimizer: torch.optim.Optimizer, boxes: dict[str, Piece]) -> tuple[dict, list[str]]:
    """Each parameter's optimizer state (moments in the parameter's box; 0-d values whole), under every name."""
    names, out, problems = parameter_names(stage.model), {}, []
    for param, state in optimizer.state.items():
        for name in names.get(id(param), []):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape):
                    out[f"optim/{name}/{key}"] = piece_like(value, boxes[name])
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    out[f"optim/{name}/{key}"] = Piece(value.detach(), torch.Size(), torch.Size())
                else:
                    problems.append(f"optimizer state {key!r} of {name} ({type(value).__name__}) is neither "
                                    "shaped like its parameter nor a scalar; it cannot be resharded")
    return out, problems


def fresh_optimizer_pieces(stage: Stage, optimizer, model_state: dict, stored: dict) -> tuple[dict, list]:
    """Zeroed optimizer state for every parameter the checkpoint has state for, boxed to be read into."""
    if optimizer.state:
        raise CheckpointError("the optimizer already has state; load into a fresh optimizer (before its first step)")
    names, pieces, fresh = parameter_names(stage.model), {}, []
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name in names.get(id(param), []):
                prefix = f"optim/{name}/"
                if not (keys := [k for k in stored if k.startswith(prefix)]):
                    continue
                values = {}
                for key in keys:
                    if not isinstance(md := stored[key], TensorStorageMetadata):
                        raise CheckpointError(f"{key} is not a tensor in the checkpoint")
                    if len(md.size) == 0:
                        values[key[len(prefix):]] = value = torch.zeros((), dtype=md.properties.dtype)
                        pieces[key] = Piece(value, torch.Size(), torch.Size())
                    else:
                        values[key[len(prefix):]] = value = torch.zeros_like(param, dtype=md.properties.dtype)
                        pieces[key] = piece_like(value, model_state[f"model/{name}"])
                fresh.append((param, values))
                break  # a tied parameter's state is read once, under its first name
    return pieces, fresh


def fit_problems(state: dict, stored: dict) -> list[str]:
    """Tensors of `state` the checkpoint lacks, or holds with another whole shape (another model)."""
    missing = [k for k in state if isinstance(state[k], Piece) and k not in stored]
    shapes = [f"{k}: {list(stored[k].size)} in the checkpoint, {list(v.size)} here" for k, v in state.items()
              if isinstance(v, Piece) and k in stored and tuple(getattr(stored[k], "size", ())) != tuple(v.size)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors this model has are not in the checkpoint, e.g. {missing[:3]}; "
                        "was it written for another model?")
    if shapes:
        problems.append(f"{len(shapes)} tensors have other whole shapes than the checkpoint's, e.g. {shapes[:3]}; "
                        "was it written for another model config?")
    return problems


def own_cpu(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous on the CPU, sharing storage with nothing (a view would be saved with its whole storage)."""
    t = t.detach().to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def plain_data_problems(objects: dict[str, Any]) -> list[str]:
    """The objects (by name) a checkpoint could not load back as plain data (`weights_only`)."""
    problems = []
    for name, value in objects.items():
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except (pickle.PicklingError, pickle.UnpicklingError, TypeError, AttributeError) as exc:
            first = first_line(exc)
            problems.append(f"{name}: not plain data ({first}); keep it to dicts, lists, tuples, numbers, strings, "
                            "None and tensors, which a checkpoint loads without running code")
    return problems


class PieceSavePlanner(DefaultSavePlanner):
    """Writes each `Piece` as its box of the whole tensor; anything else as a pickled object."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if isinstance(value, Piece):
                for data, chunk in zip((t for t, _ in value.boxes()), value.chunks):
                    if data.numel() == 0:  # an FSDP2 rank past the end of a short tensor
                        continue
                    write = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(data), size=value.size)
                    items.append(WriteItem(index=MetadataIndex(key, chunk.offsets), type=WriteItemType.SHARD,
                                           tensor_data=write))
            else:
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return own_cpu(value.box_at(index.offset)) if isinstance(value, Piece) else value


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads into each `Piece` the parts of its box that the checkpoint's boxes hold; objects whole, as
    plain data (`weights_only`): one that would run code is refused, naming `source`. The caller checks
    beforehand, on every rank, that every key is in the checkpoint with the same whole size.
    """

    def __init__(self, source: str | Path = "the checkpoint") -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.source = source

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items, zero = [], torch.Size((0,))
        for key, value in self.state_dict.items():
            if isinstance(value, Piece):
                if chunks := [c for c in value.chunks if math.prod(c.sizes)]:
                    items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
            else:
                index = MetadataIndex(key)
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=zero,
                                      storage_index=index, storage_offsets=zero, lengths=zero))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = first_line(exc)
            raise CheckpointError(
                f"{self.source}: its {key!r} is not plain data ({first}); nothing of it was run. rewrite writes "
                "only tensors and plain values there: this checkpoint was altered or made by something else; "
                "load only checkpoints you or your team wrote"
            ) from None

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].box_at(index.offset)
