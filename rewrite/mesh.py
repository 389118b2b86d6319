"""This rank's coordinates in the dp x pp x cp x tp grid (`plan.ranks`) and its process groups.

Every group is a slice of that grid; this module is the only one that creates groups.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import InputError
from .plan.ranks import Shape, expert_groups, expert_place
from .values import is_count

__all__ = ["Mesh", "build_mesh", "check_world", "expert_groups", "release_groups", "calm_gloo_threads"]


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """This rank's place in the grid, with the groups it communicates in (None: not needed, or itself alone)."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # ranks of a stage's dp x tp splitting the experts (adds none)
    kv_replicas: int = 1  # tp ranks holding each kv head (tp / kv when tp passes the kv heads)
    rank: int  # global rank
    tp_group: ProcessGroup | None = None  # this stage's tensor-parallel ranks
    cp_group: ProcessGroup | None = None  # this stage's context-parallel ranks (cp > 1)
    dp_group: ProcessGroup | None = None  # the ranks holding the same part in every replica
    tied_group: ProcessGroup | None = None  # the first and last pipeline rank at this dp, cp and tp rank (pp > 1)
    kv_group: ProcessGroup | None = None  # the tp ranks holding this rank's kv head (kv_replicas > 1)
    replica_mesh: DeviceMesh | None = None  # dp x cp ranks holding the same parameters: what dp reduces over
    ep_group: ProcessGroup | None = None  # the ep ranks of this stage's dp x tp splitting the experts (ep > 1)
    expert_replica_group: ProcessGroup | None = None  # the ranks holding this rank's experts: (dp x tp / ep) x cp
    # The world on a backend taking host tensors, for agreements that must not wait on a device (None: the default is gloo)
    host_group: ProcessGroup | None = None
    device_mesh: DeviceMesh | None = None  # the grid, dims ("dp", "pp", "cp", "tp"), without "cp" when cp = 1

    shape = property(lambda self: Shape(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep))
    coords = property(lambda self: self.shape.coords(self.rank))
    dp_rank = property(lambda self: self.coords.dp)
    pp_rank = property(lambda self: self.coords.pp)
    cp_rank = property(lambda self: self.coords.cp)
    tp_rank = property(lambda self: self.coords.tp)
    # This rank's place in its expert-parallel group, and which of the stage's groups that is (0: the copy
    # of the experts that counts once, in the gradient norm and the HF save).
    ep_rank = property(lambda self: expert_place(self.shape, self.coords)[0])
    expert_copy = property(lambda self: expert_place(self.shape, self.coords)[1])
    replicas = property(lambda self: self.dp * self.cp, doc="Ranks holding the same parameters: dp x cp.")

    def rank_at(self, **coords: int) -> int:
        """The global rank at this rank's coordinates but `coords`: `rank_at(pp=0)` is its first pipeline rank."""
        return self.shape.rank(replace(self.coords, **coords))


def check_world(shape: Shape) -> None:
    """Raise InputError unless the default group exists and has `shape.world` ranks."""
    n = shape.world
    if not dist.is_available() or not dist.is_initialized():
        raise InputError(
            f"torch.distributed is not initialised: call torch.distributed.init_process_group() "
            f"on each of the {n} ranks ({shape.text()}) first, e.g. under torchrun"
        )
    if (world := dist.get_world_size()) != n:
        raise InputError(
            f"the plan's mesh needs {shape.text()} = {n} ranks, but the world size is {world}; "
            f"launch {n} processes (torchrun --nproc-per-node {n}, or --nnodes N with {n} in all) or change the mesh"
        )


def build_mesh(shape: Shape, *, kv_replicas: int = 1) -> Mesh:
    """Create the mesh's groups. Collective: every rank must call it, with the same arguments.

    `kv_replicas` > 1 (dividing tp) adds the groups of that many neighbouring tp ranks holding one kv head;
    `shape.ep` > 1 (dividing dp x tp) the expert-parallel groups (`expert_groups`).
    """
    check_world(shape)
    dp, pp, cp, tp, ep = shape.dp, shape.pp, shape.cp, shape.tp, shape.ep
    if not is_count(kv_replicas) or tp % kv_replicas:
        raise InputError(f"build_mesh: kv_replicas must be an int >= 1 dividing tp={tp}, got {kv_replicas!r}")
    if not is_count(ep) or dp * tp % ep:
        raise InputError(f"build_mesh: ep must be an int >= 1 dividing dp x tp = {dp * tp}, got {ep!r}")
    device = "cuda" if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available() else "cpu"
    rank = dist.get_rank()
    names = ("dp", "pp", "cp", "tp") if cp > 1 else ("dp", "pp", "tp")
    device_mesh = init_device_mesh(device, tuple(getattr(shape, n) for n in names), mesh_dim_names=names)
    group = device_mesh.get_group
    tied_group = group("pp") if pp == 2 else None  # the first and last pipeline rank are all of it
    if pp > 2:
        tied_group = _made([[g[0], g[-1]] for g in shape.along("pp")], rank)[0]
    kv_group = group("tp") if kv_replicas == tp > 1 else None
    if 1 < kv_replicas < tp:
        kv_group = _made([g[i:i + kv_replicas] for g in shape.along("tp") for i in range(0, tp, kv_replicas)], rank)[0]
    host_group = None if "gloo" in str(dist.get_backend()).lower() else dist.new_group(backend="gloo")
    replica_mesh = device_mesh["dp"] if dp > 1 and cp == 1 else None
    if cp > 1:
        replicas, ranks = _made(shape.along("dp", "cp"), rank)
        replica_mesh = DeviceMesh.from_group(replicas, device, mesh=ranks, mesh_dim_names=("replicas",))
    ep_group = expert_replica_group = None
    if ep > 1:
        ep_groups, expert_replicas = expert_groups(shape)
        ep_group, expert_replica_group = _made(ep_groups, rank)[0], _made(expert_replicas, rank)[0]
    calm_gloo_threads()
    return Mesh(**asdict(shape), kv_replicas=kv_replicas, rank=rank, tp_group=group("tp"),
                cp_group=group("cp") if cp > 1 else None, dp_group=group("dp"), tied_group=tied_group,
                kv_group=kv_group, replica_mesh=replica_mesh, ep_group=ep_group,
                expert_replica_group=expert_replica_group, host_group=host_group, device_mesh=device_mesh)


def _made(lists: list[list[int]], rank: int) -> tuple[ProcessGroup | None, list[int]]:
    """Make a group of each list of ranks (none of one rank alone) and return `rank`'s, with its list. Every
    rank makes every group, in the same order: new_group is collective over the whole world."""
    mine = None, []
    for ranks in lists:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = group, ranks
    return mine


def release_groups(mesh: Mesh) -> int:
    """Destroy the process groups `build_mesh` made for `mesh` (never the default group), once nothing uses
    them: a stage built on it and dropped, before the next plan is built in the same processes. Returns how
    many this rank destroyed.

    Each live group keeps its backend's threads, which wake about a hundred times a second even when idle
    (gloo); on ranks sharing CPU cores ten plans' groups alive made a step 5-10 % longer than its plan's alone.
    Every rank calls it, in the same order, as it called `build_mesh`.
    """
    default = dist.distributed_c10d._get_default_group()
    dims = mesh.device_mesh.get_all_groups() if mesh.device_mesh is not None else []
    replicas = [mesh.replica_mesh.get_group()] if mesh.replica_mesh is not None else []
    seen: dict[int, ProcessGroup] = {}
    for group in [*dims, *replicas, mesh.tp_group, mesh.cp_group, mesh.dp_group, mesh.tied_group, mesh.kv_group,
                  mesh.ep_group, mesh.expert_replica_group, mesh.host_group]:
        if group is not None and group is not default and group != dist.GroupMember.NON_GROUP_MEMBER:
            seen.setdefault(id(group), group)
    dist.barrier()  # no rank tears a group down while a peer may still be connecting or working in it
    for group in seen.values():
        dist.destroy_process_group(group)
    return len(seen)


_GLOO_IO = "gloo_tcp_loop"  # the name of gloo's TCP transport's I/O thread (one a process group)
_SEEN: list = [None, set()]  # the policy last applied, and the threads looked at under it (named ones)


def calm_gloo_threads() -> int:
    """Schedule this process's gloo I/O threads as batch threads (Linux's SCHED_BATCH); returns how many changed.

    Woken by a send or a receive, such a thread waits for a free core instead of preempting the rank's
    compute thread at once: where ranks fill the cores (2 ranks on 2 cores), an ordinary one preempted the
    caller inside the call that posted the exchange, 1.5-2.5 ms in a tenth of the calls, and the step of
    sequence parallelism at tp 2 took 1.2-1.3x plain tp's; scheduled so, 1.0-1.07x, and no layout slower
    (BENCHMARKS.md). On free cores nothing changes. `build_mesh` and every step call it (a thread is looked at once it has its name).
    `REWRITE_GLOO_THREADS=default` in the environment puts them back as the system schedules them.
    A no-op off Linux, and for threads whose policy this process may not change.
    """
    if not hasattr(os, "sched_setscheduler"):
        return 0
    policy = os.SCHED_OTHER if os.environ.get("REWRITE_GLOO_THREADS") == "default" else os.SCHED_BATCH
    if _SEEN[0] != policy:
        _SEEN[:] = [policy, set()]
    seen, changed = _SEEN[1], 0
    try:
        unnamed = _name("/proc/self/comm")  # what a thread is called until it names itself
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        if tid in seen:
            continue
        try:
            name = _name(f"/proc/self/task/{tid}/comm")
            if name == _GLOO_IO and os.sched_getscheduler(int(tid)) != policy:
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))
                changed += 1
        except OSError:  # the thread ended meanwhile, or its policy is not ours to change
            continue
        if name != unnamed:
            seen.add(tid)
    return changed


def _name(path: str) -> str:
    with open(path) as f:
        return f.read().strip()
