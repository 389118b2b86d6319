"""The dp x pp x cp x tp process mesh: this rank's coordinates and its process groups.

Global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank (`plan.ranks`): a stage's
tensor-parallel ranks are contiguous (on one machine under torchrun), then its context-parallel
ranks, pipeline neighbours share a cp_rank and tp_rank, and data-parallel replicas are the
outermost dimension (across machines). The groups come from a torch `DeviceMesh` with dimensions
("dp", "pp", "tp"), or ("dp", "pp", "cp", "tp") with context parallelism; this module is the only
one that creates groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .plan.ranks import coordinates, cp_rank_of, expert_groups, expert_place, global_rank, shape_text
from .values import is_count
from .errors import InputError

__all__ = ["Mesh", "build_mesh", "check_world", "expert_groups"]


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a dp x pp x cp x tp mesh, with the groups it communicates in."""

    pp: int
    tp: int
    rank: int  # global rank
    tp_group: ProcessGroup  # this stage's tensor-parallel ranks
    tied_group: ProcessGroup | None  # first and last pipeline rank of this replica at this tp_rank (pp > 1)
    dp: int = 1
    dp_group: ProcessGroup | None = None  # the ranks holding the same part in every replica
    device_mesh: DeviceMesh | None = None  # dims ("dp", "pp", "tp")
    kv_replicas: int = 1  # tp ranks holding each kv head (tp / kv when tp passes the kv heads)
    kv_group: ProcessGroup | None = None  # those of this rank's tp group holding its kv head (kv_replicas > 1)
    # The whole world on a backend that takes host tensors, for agreements that must not wait on a
    # device; None where the default group does (gloo, or "cpu:gloo,cuda:nccl").
    host_group: ProcessGroup | None = None
    cp: int = 1
    cp_group: ProcessGroup | None = None  # this stage's context-parallel ranks (cp > 1)
    # The ranks holding the same parameters: the dp replicas times the cp ranks (dp x cp), a 1-D
    # DeviceMesh that FSDP2 / replicate / DDP reduce gradients over; None when there is one.
    replica_mesh: DeviceMesh | None = None
    ep: int = 1
    ep_group: ProcessGroup | None = None  # the ep neighbouring ranks of dp x tp splitting the experts (ep > 1)
    # The ranks holding this rank's experts: same ep_rank in every ep group of the stage, times the cp
    # ranks ((dp x tp / ep) x cp); None when ep = 1 or there is one.
    expert_replica_group: ProcessGroup | None = None

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group: (dp_rank x tp + tp_rank) % ep (`expert_place`)."""
        return expert_place(self.dp_rank, self.tp_rank, tp=self.tp, ep=self.ep)[0]

    @property
    def expert_copy(self) -> int:
        """Which of the stage's expert-parallel groups (at this cp rank) this rank belongs to; 0 holds the
        experts' copy that counts once (gradient norm, HF save)."""
        return expert_place(self.dp_rank, self.tp_rank, tp=self.tp, ep=self.ep)[1]

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts, whose expert gradients are summed together: (dp x tp / ep) x cp."""
        return self.dp * self.tp // self.ep * self.cp

    @property
    def tp_rank(self) -> int:
        return coordinates(self.rank, pp=self.pp, tp=self.tp, cp=self.cp)[2]

    @property
    def pp_rank(self) -> int:
        return coordinates(self.rank, pp=self.pp, tp=self.tp, cp=self.cp)[1]

    @property
    def dp_rank(self) -> int:
        return coordinates(self.rank, pp=self.pp, tp=self.tp, cp=self.cp)[0]

    @property
    def cp_rank(self) -> int:
        return cp_rank_of(self.rank, tp=self.tp, cp=self.cp)

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, whose gradients are reduced together: dp x cp."""
        return self.dp * self.cp

    def global_rank(self, pp_rank: int, tp_rank: int | None = None) -> int:
        """Global rank of pipeline rank `pp_rank` at `tp_rank` (default: this rank's), in this replica,
        at this rank's cp_rank."""
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return global_rank(self.dp_rank, pp_rank, tp_rank, pp=self.pp, tp=self.tp, cp=self.cp, cp_rank=self.cp_rank)


def check_world(pp: int, tp: int, dp: int = 1, cp: int = 1) -> None:
    """Raise ValueError unless the default group exists and has dp * pp * cp * tp ranks."""
    n = dp * pp * cp * tp
    if not dist.is_available() or not dist.is_initialized():
        raise InputError(
            f"torch.distributed is not initialised: call torch.distributed.init_process_group() "
            f"on each of the {n} ranks ({shape_text(dp, pp, tp, cp)}) first, e.g. under torchrun"
        )
    world = dist.get_world_size()
    if world != n:
        raise InputError(
            f"the plan's mesh needs {shape_text(dp, pp, tp, cp)} = {n} ranks, but the world size is {world}; "
            f"launch {n} processes (torchrun --nproc-per-node {n}, or --nnodes N with {n} in all) or change the mesh"
        )


def _device_type() -> str:
    backend = str(dist.get_backend()).lower()
    return "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"


def build_mesh(pp: int, tp: int, dp: int = 1, *, kv_replicas: int = 1, cp: int = 1, ep: int = 1) -> Mesh:
    """Create the mesh's groups. Collective: every rank must call it, with the same sizes.

    `kv_replicas` > 1 (dividing tp) adds the groups of `kv_replicas` neighbouring tp ranks that
    hold the same key/value head: tp ranks `[j * r, (j + 1) * r)` of each tp group. `cp` > 1 adds
    the cp dimension and, for the gradients, the groups of dp x cp ranks holding the same parameters.
    `ep` > 1 (dividing dp x tp) adds the expert-parallel groups: `ep` consecutive ranks of a stage's
    dp x tp ranks, tp fastest, at one cp rank split the experts (`expert_groups`).
    """
    check_world(pp, tp, dp, cp)
    if not is_count(kv_replicas) or tp % kv_replicas:
        raise InputError(f"build_mesh: kv_replicas must be an int >= 1 dividing tp={tp}, got {kv_replicas!r}")
    if not is_count(ep) or dp * tp % ep:
        raise InputError(f"build_mesh: ep must be an int >= 1 dividing dp x tp = {dp * tp}, got {ep!r}")
    rank = dist.get_rank()
    sizes, names = ((dp, pp, cp, tp), ("dp", "pp", "cp", "tp")) if cp > 1 else ((dp, pp, tp), ("dp", "pp", "tp"))
    device_mesh = init_device_mesh(_device_type(), sizes, mesh_dim_names=names)

    def at(d: int, p: int, c: int, t: int) -> int:
        return global_rank(d, p, t, pp=pp, tp=tp, cp=cp, cp_rank=c)

    here = (*coordinates(rank, pp=pp, tp=tp, cp=cp), cp_rank_of(rank, tp=tp, cp=cp))  # (dp, pp, tp, cp)
    tied_group = None
    if pp == 2:
        tied_group = device_mesh.get_group("pp")  # the first and last pipeline rank are all of it
    elif pp > 2:
        # new_group is collective over the whole world: every rank creates every group, in order.
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    group = dist.new_group([at(d, 0, c, t), at(d, pp - 1, c, t)])
                    if here in ((d, 0, t, c), (d, pp - 1, t, c)):
                        tied_group = group
    kv_group = _kv_group(pp, tp, dp, cp, kv_replicas, device_mesh.get_group("tp"), at, here)
    host_group = None if "gloo" in str(dist.get_backend()).lower() else dist.new_group(backend="gloo")
    replica_mesh = device_mesh["dp"] if dp > 1 and cp == 1 else None
    if cp > 1:
        for p in range(pp):
            for t in range(tp):
                ranks = [at(d, p, c, t) for d in range(dp) for c in range(cp)]
                group = dist.new_group(ranks)
                if here[1:3] == (p, t):
                    replica_mesh = DeviceMesh.from_group(group, _device_type(), mesh=ranks, mesh_dim_names=("replicas",))
    ep_group, expert_replica_group = _expert_groups(pp, tp, dp, cp, ep, at, here)
    return Mesh(
        pp=pp,
        tp=tp,
        rank=rank,
        tp_group=device_mesh.get_group("tp"),
        kv_replicas=kv_replicas,
        kv_group=kv_group,
        tied_group=tied_group,
        dp=dp,
        dp_group=device_mesh.get_group("dp"),
        device_mesh=device_mesh,
        host_group=host_group,
        cp=cp,
        cp_group=device_mesh.get_group("cp") if cp > 1 else None,
        replica_mesh=replica_mesh,
        ep=ep,
        ep_group=ep_group,
        expert_replica_group=expert_replica_group,
    )


def _expert_groups(pp: int, tp: int, dp: int, cp: int, ep: int, at, here) -> tuple:
    """This rank's expert-parallel group and expert-replica group (None where ep = 1 or it has one rank)."""
    if ep == 1:
        return None, None
    rank, mine = at(here[0], here[1], here[3], here[2]), [None, None]
    for kind, lists in enumerate(expert_groups(pp, tp, dp, cp, ep)):
        for ranks in lists:  # new_group is collective over the world: every rank makes every group, in order
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = group
    return tuple(mine)


def _kv_group(pp: int, tp: int, dp: int, cp: int, r: int, tp_group: ProcessGroup, at, here) -> ProcessGroup | None:
    """This rank's group of `r` tp neighbours sharing a kv head; the tp group itself when r == tp."""
    if r == 1:
        return None
    if r == tp:
        return tp_group
    mine = None
    for d in range(dp):  # new_group is collective over the world: every rank makes every group, in order
        for p in range(pp):
            for c in range(cp):
                for slot in range(tp // r):
                    group = dist.new_group([at(d, p, c, slot * r + j) for j in range(r)])
                    if (here[0], here[1], here[3]) == (d, p, c) and here[2] // r == slot:
                        mine = group
    return mine
