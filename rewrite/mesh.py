"""The pp x tp process mesh: this rank's coordinates and its process groups.

Global rank = pp_rank * tp + tp_rank: a stage's tensor-parallel ranks are
contiguous (on one machine under torchrun), and pipeline neighbours share a tp_rank.
This module is the only caller of `torch.distributed.new_group`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Mesh", "build_mesh", "check_world"]


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a pp x tp mesh, with the groups it communicates in."""

    pp: int
    tp: int
    rank: int  # global rank
    tp_group: ProcessGroup  # this stage's tensor-parallel ranks
    tied_group: ProcessGroup | None  # first and last stage at this tp_rank (pp > 1)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    def global_rank(self, pp_rank: int, tp_rank: int | None = None) -> int:
        """Global rank of stage `pp_rank` at `tp_rank` (default: this rank's tp_rank)."""
        return pp_rank * self.tp + (self.tp_rank if tp_rank is None else tp_rank)

    @property
    def prev_rank(self) -> int | None:
        """Same tp_rank, previous stage; None on the first stage."""
        return self.global_rank(self.pp_rank - 1) if self.pp_rank > 0 else None

    @property
    def next_rank(self) -> int | None:
        """Same tp_rank, next stage; None on the last stage."""
        return self.global_rank(self.pp_rank + 1) if self.pp_rank < self.pp - 1 else None


def check_world(pp: int, tp: int) -> None:
    """Raise ValueError unless the default group exists and has pp * tp ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"torch.distributed is not initialised: call torch.distributed.init_process_group() "
            f"on each of the {pp * tp} ranks (pp={pp} x tp={tp}) first, e.g. under torchrun"
        )
    world = dist.get_world_size()
    if world != pp * tp:
        raise ValueError(
            f"the plan's mesh needs pp={pp} x tp={tp} = {pp * tp} ranks, but the world size is {world}; "
            f"launch {pp * tp} processes (torchrun --nproc-per-node {pp * tp}) or change the mesh"
        )


def build_mesh(pp: int, tp: int) -> Mesh:
    """Create the mesh's groups. Collective: every rank must call it, with the same sizes."""
    check_world(pp, tp)
    rank, tp_group, tied_group = dist.get_rank(), None, None
    # new_group is collective over the whole world: every rank creates every group.
    for p in range(pp):
        group = dist.new_group([p * tp + t for t in range(tp)])
        if rank // tp == p:
            tp_group = group
    if pp > 1:
        for t in range(tp):
            group = dist.new_group([t, (pp - 1) * tp + t])
            if rank % tp == t and rank // tp in (0, pp - 1):
                tied_group = group
    return Mesh(pp=pp, tp=tp, rank=rank, tp_group=tp_group, tied_group=tied_group)
