"""`build_mesh` on real ranks: every group a rank is given holds exactly the ranks the documented layout
says, in order. The oracle numbers ranks by the formula itself, not by `plan.ranks`."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from rewrite.mesh import build_mesh, calm_gloo_threads, release_groups
from rewrite.plan.ranks import Coords, Shape
from tests.multiproc import run


def _ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _groups(rank: int, world: int, sizes: dict, kv_replicas: int) -> dict:
    mesh = build_mesh(Shape(**sizes), kv_replicas=kv_replicas)
    assert mesh.rank == rank
    return {
        "coords": mesh.coords, "first": mesh.rank_at(pp=0), "ep_rank": mesh.ep_rank, "copy": mesh.expert_copy,
        "tp": _ranks(mesh.tp_group), "cp": _ranks(mesh.cp_group), "dp": _ranks(mesh.dp_group),
        "tied": _ranks(mesh.tied_group), "kv": _ranks(mesh.kv_group), "ep": _ranks(mesh.ep_group),
        "experts": _ranks(mesh.expert_replica_group),
        "replicas": None if mesh.replica_mesh is None else mesh.replica_mesh.mesh.flatten().tolist(),
    }


def _expected(sizes: dict, kv_replicas: int) -> dict:
    """Each rank's groups, from global rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank."""
    dp, pp, cp, tp, ep = (sizes.get(k, 1) for k in ("dp", "pp", "cp", "tp", "ep"))
    every = list(itertools.product(range(dp), range(pp), range(cp), range(tp)))

    def rank(d, p, c, t):
        return ((d * pp + p) * cp + c) * tp + t

    def members(keep) -> list[int] | None:  # a group's ranks in rank order, as torch's new_group keeps them
        found = sorted(rank(*x) for x in every if keep(x))
        return found if len(found) > 1 else None

    out = {}
    for d, p, c, t in every:
        i = d * tp + t  # place in the stage's dp x tp, tp fastest
        out[rank(d, p, c, t)] = {
            "coords": Coords(dp=d, pp=p, cp=c, tp=t), "first": rank(d, 0, c, t), "ep_rank": i % ep, "copy": i // ep,
            "tp": list(range(rank(d, p, c, 0), rank(d, p, c, 0) + tp)),
            "cp": members(lambda x: (x[0], x[1], x[3]) == (d, p, t)) if cp > 1 else None,
            "dp": [rank(e, p, c, t) for e in range(dp)],
            "tied": [rank(d, 0, c, t), rank(d, pp - 1, c, t)] if pp > 1 and p in (0, pp - 1) else None,
            "kv": members(lambda x: x[:3] == (d, p, c) and x[3] // kv_replicas == t // kv_replicas)
            if kv_replicas > 1 else None,
            "ep": members(lambda x: (x[1], x[2]) == (p, c) and (x[0] * tp + x[3]) // ep == i // ep) if ep > 1 else None,
            "experts": members(lambda x: x[1] == p and (x[0] * tp + x[3]) % ep == i % ep) if ep > 1 else None,
            "replicas": members(lambda x: (x[1], x[3]) == (p, t)) if dp * cp > 1 else None,
        }
    return out


@pytest.mark.parametrize(
    ("sizes", "kv_replicas"),
    [
        ({"pp": 3, "cp": 2}, 1),  # tied groups past pp 2, at each cp rank; replicas over cp
        ({"dp": 2, "tp": 4, "ep": 2}, 2),  # kv heads on blocks of 2 tp ranks; ep halves of each tp group
        ({"dp": 2, "pp": 3, "ep": 2}, 1),  # ep across replicas; tied groups in each replica
    ],
    ids=["pp3-cp2", "dp2-tp4-kv2-ep2", "dp2-pp3-ep2"],
)
def test_every_group_is_the_documented_slice(sizes, kv_replicas):
    world = Shape(**sizes).world
    got = run(_groups, world, sizes, kv_replicas)
    want = _expected(sizes, kv_replicas)
    for rank in range(world):
        for name, ranks in want[rank].items():
            assert got[rank][name] == ranks, f"rank {rank} {name}: {got[rank][name]}, expected {ranks}"



def _released(rank: int, world: int) -> dict:
    import gc
    import os

    import torch

    from rewrite.mesh import release_groups

    tasks = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    before, out = tasks(), {}
    for sizes in ({"dp": 2, "tp": 2}, {"pp": 2, "cp": 2}, {"dp": 4}):
        mesh = build_mesh(Shape(**sizes), kv_replicas=1)
        for name in ("tp_group", "cp_group", "dp_group"):  # used, as a stage uses them (no reference kept here)
            if getattr(mesh, name) is not None:
                dist.all_reduce(torch.ones(1), group=getattr(mesh, name))
        grown = tasks()
        destroyed = release_groups(mesh)
        del mesh
        gc.collect()
        out[str(sizes)] = {"destroyed": destroyed, "grown": grown > before, "back": tasks() <= before}
    total = torch.ones(1)
    dist.all_reduce(total)  # the default group is never released
    out["world"] = total.item()
    return out


def test_release_groups_frees_a_meshs_groups_and_keeps_the_default():
    """Plans built one after another in the same processes (`rewrite plan --measure`) each release the groups
    their mesh made: once the mesh is dropped their backend's threads are gone; the default group still runs."""
    for got in run(_released, 4):
        assert got["world"] == 4.0
        for sizes in ("{'dp': 2, 'tp': 2}", "{'pp': 2, 'cp': 2}", "{'dp': 4}"):
            assert got[sizes]["destroyed"] >= 1 and got[sizes]["grown"] and got[sizes]["back"], (sizes, got[sizes])


def _policies() -> dict[int, int]:
    """The scheduling policy of each of this process's gloo I/O threads, by thread id."""
    import os

    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    out[int(tid)] = os.sched_getscheduler(int(tid))
        except OSError:
            continue
    return out


def _thread_policies(rank: int, world: int) -> dict:
    import os
    import threading
    import time

    mesh = build_mesh(Shape(tp=world))
    seen = {"built": _policies()}  # the default group's thread is named by now; a new group's may not be yet
    dist.barrier(group=mesh.tp_group)
    time.sleep(0.2)  # every group's thread started and named
    seen["step"], seen["stepped"] = calm_gloo_threads(), _policies()  # what each step does
    seen["again"], seen["main"] = calm_gloo_threads(), os.sched_getscheduler(threading.get_native_id())
    os.environ["REWRITE_GLOO_THREADS"] = "default"
    try:
        seen["put back"], seen["default"] = calm_gloo_threads(), _policies()
    finally:
        del os.environ["REWRITE_GLOO_THREADS"]
    seen["batch again"], seen["after"] = calm_gloo_threads(), _policies()
    release_groups(mesh)
    return seen


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setscheduler"), reason="thread policies are Linux's")
def test_gloo_io_threads_run_as_batch_threads_unless_asked_not_to():
    import os

    for seen in run(_thread_policies, 2):
        assert os.SCHED_BATCH in seen["built"].values(), seen  # build_mesh set those it found
        stepped = seen["stepped"]
        assert len(stepped) >= 2 and set(stepped.values()) == {os.SCHED_BATCH}, seen  # the world's and the tp group's
        assert seen["again"] == 0 and seen["main"] == os.SCHED_OTHER, seen  # nothing left to change; compute untouched
        assert seen["put back"] == len(stepped) and set(seen["default"].values()) == {os.SCHED_OTHER}, seen
        assert seen["batch again"] == len(stepped) and set(seen["after"].values()) == {os.SCHED_BATCH}, seen
