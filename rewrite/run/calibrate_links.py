"""The collectives a run makes, timed where it makes them: `rewrite calibrate`'s `collective_times`.

Each kind is timed through the function a run calls (`estimate.hardware.CollectiveKind`): the
tensor-parallel layers' own sum, gather and reduce-scatter (pairwise swaps on gloo, torch's collectives
elsewhere), the experts' all-to-all, and torch's all-reduce, all-gather and reduce-scatter as DDP and
FSDP2 make them. For every group size that divides the world, every group of consecutive ranks runs at
once, as a plan's tp or dp groups do, on messages from 4 KiB to 16 MiB; a time is the median of the
repeats, each started together after a barrier. A message is never charged more than a larger one took
(a slow median at a small size is this machine's noise: more bytes cannot cost less).
"""

from __future__ import annotations

import statistics
import time

__all__ = ["COLLECTIVE_BYTES", "collective_times", "collective_lines", "overlap_share"]

COLLECTIVE_BYTES = (4 * 1024, 64 * 1024, 512 * 1024, 4 * 1024**2, 16 * 1024**2)


def _ops(group, n: int, nbytes: int, device) -> dict:
    """Each kind's call on `nbytes` over `group` (of `n` ranks), its buffers made once."""
    import torch
    import torch.distributed as dist

    from ..tensor_parallel.comm import all_gather_into, all_reduce_sum, reduce_scatter_into

    whole = torch.zeros(max(nbytes // 4, n) // n * n, dtype=torch.float32, device=device)  # n equal parts
    part, scratch, out = whole[: whole.numel() // n].clone(), whole.clone(), torch.empty_like(whole)
    return {
        "sum": lambda: all_reduce_sum(whole, group),
        "gather": lambda: all_gather_into(out, part, group),
        "scatter": lambda: reduce_scatter_into(part, scratch, group),
        "all_to_all": lambda: dist.all_to_all_single(out, whole, group=group),
        "all_reduce": lambda: dist.all_reduce(whole, group=group),
        "all_gather": lambda: dist.all_gather_single(out, part, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, scratch, group=group),
    }


def collective_times(device, repeats: int, sizes: tuple[int, ...] = COLLECTIVE_BYTES) -> dict:
    """{kind: {group size: {bytes: seconds}}} on this rank (call on every rank of the world at once)."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {}
    for n in (d for d in range(2, world + 1) if world % d == 0):
        # Every rank makes every group, in the same order (torch's rule for new_group).
        groups = [dist.new_group(list(range(g * n, g * n + n))) for g in range(world // n)]
        mine = groups[rank // n]
        for nbytes in sizes:
            for kind, op in _ops(mine, n, nbytes, device).items():
                out.setdefault(kind, {}).setdefault(n, {})[nbytes] = _together(op, repeats, sync)
        dist.destroy_process_group(mine)  # its threads would slow what calibrate measures next
    return {kind: {n: _rising(curve) for n, curve in by_n.items()} for kind, by_n in out.items()}


def _together(fn, repeats: int, sync) -> float:
    """The median of `repeats` timings of `fn`, every rank starting each after a barrier (once untimed
    first: buffers and connections set up)."""
    import torch.distributed as dist

    fn()
    sync()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rising(curve: dict[int, float]) -> dict[int, float]:
    """`curve` ({bytes: seconds}, by growing size) with each time at most any larger size's.

    Example:
        >>> _rising({4: 3.0, 8: 1.0, 16: 2.0})
        {4: 1.0, 8: 1.0, 16: 2.0}
    """
    out, least = {}, float("inf")
    for nbytes in sorted(curve, reverse=True):
        least = min(least, curve[nbytes])
        out[nbytes] = least
    return dict(sorted(out.items()))


def overlap_share(device, repeats: int, nbytes: int = 16 * 1024**2) -> float:
    """The share of the shorter of a collective and compute beside it that running them together hides
    (`Hardware.overlap`): FSDP2's reduce-scatter of `nbytes` over the world, started asynchronously
    beside as many matmuls as take about as long, against each alone; in [0, 1]."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = dist.get_world_size()
    whole = torch.zeros(nbytes // 4 // n * n, dtype=torch.float32, device=device)
    part = torch.empty(whole.numel() // n, dtype=torch.float32, device=device)
    a, b = (torch.randn(512, 512, device=device) for _ in range(2))

    def timed(fn) -> float:
        return _together(fn, repeats, sync)

    collective = timed(lambda: dist.reduce_scatter_single(part, whole))
    one = timed(lambda: a @ b)
    count = max(1, round(collective / max(one, 1e-9)))
    count = _agreed(count, device)

    def compute():
        for _ in range(count):
            a @ b

    def both():
        work = dist.reduce_scatter_single(part, whole, async_op=True)
        compute()
        work.wait()

    alone, together = timed(compute), timed(both)
    return min(max((alone + collective - together) / min(alone, collective), 0.0), 1.0)


def _agreed(count: int, device) -> int:
    """The largest of the ranks' `count`s: every rank runs the same number of matmuls."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def collective_lines(tables: dict) -> str:
    """The `collective_times` block of a profile file: a line per kind and group size."""
    if not tables:
        return "collective_times: {}   # not measured: the ring formulas on the links"
    lines = ["collective_times:   # measured: seconds by group size and bytes, each kind as a run calls it, "
             "every group of that size at once"]
    for kind, by_n in tables.items():
        lines.append(f"  {kind}:")
        for n, curve in by_n.items():
            lines.append(f"    {n}: {{" + ", ".join(f"{b}: {t:.4g}" for b, t in curve.items()) + "}")
    return "\n".join(lines)
