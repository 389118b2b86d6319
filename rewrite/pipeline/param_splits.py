"""Each parameter of a stage marked with what it is on this rank (`binding.shard_layout.ParamSplit`): its split
over tp or ep, from the binding, and whether this rank's copy is the one that counts once over every rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..binding.shard_layout import ParamSplit, TensorSplit, mark_split
from ..mesh import Mesh
from .stage import Stage

__all__ = ["apply_param_splits"]


def apply_param_splits(stage: Stage) -> None:
    """Mark every parameter of `stage` with its `ParamSplit`, in place (`split_of` reads it).

    Called by `apply_plan` once data parallelism has put its DTensors in place, and again by the loaders
    that replace parameters with the tensors they read (`from_pretrained`). `stage.module`'s parameters are
    `stage.model`'s, named by their paths there.
    """
    mesh, not_mine = stage.mesh, {id(p) for p in stage.tied} if not stage.is_first else set()
    for name, param in stage.model.named_parameters():  # a tied object once, at its first path
        split = stage.resolved.split_of(name)
        # A tied embedding's two ends hold the same gradient (summed): it counts on the first stage.
        counts = _counts(param, split, mesh) and id(param) not in not_mine
        mark_split(param, ParamSplit(split, counts))


def _counts(param: nn.Parameter, split: TensorSplit, mesh: Mesh) -> bool:
    """Whether this rank's copy counts once over every rank.

    Experts: copy 0 of the stage's ep groups at cp rank 0 (every ep rank holds its own slice). Otherwise the
    first of the tp ranks holding its part (the first of a slice's `replicas`, tp rank 0 of a whole tensor),
    and among the copies dp and cp make: a plain tensor (dp x cp = 1, DDP), whole on every replica, at dp and
    cp rank 0; a DTensor (FSDP2, replicate), every shard, at coordinate 0 of each mesh dim it is replicated over.
    """
    if split.over == "ep":
        return mesh.expert_copy == 0 and mesh.cp_rank == 0
    if not (mesh.tp_rank == 0 if split.dim is None else split.counts_on(mesh.tp_rank)):
        return False
    if not isinstance(param, DTensor):
        return mesh.dp_rank == 0 and mesh.cp_rank == 0
    coordinate = param.device_mesh.get_coordinate()
    return coordinate is not None and all(
        c == 0 for c, placement in zip(coordinate, param.placements) if isinstance(placement, Replicate)
    )
