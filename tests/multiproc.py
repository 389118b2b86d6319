"""Run a function on several local ranks (gloo, CPU) that fails instead of hanging.

`run(fn, world_size, *args)` starts one process per rank, rendezvous through a
file, and joins them under a hard deadline. A rank that raises fails the test
with its traceback and every other rank is killed; a rank still alive at the
deadline (a deadlock) is killed with the others and named in the failure.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import runpy
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Workers are forked from a server that imported these once: a spawn per rank would
# re-import torch and transformers (seconds each) in every test.
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_layers", "rewrite", "tests.multiproc",
            "tests.models"]


def _worker(rank: int, fn, world_size: int, init_file: str, out_dir: str, args: tuple) -> None:
    # The preloaded modules' objects (millions) stay put: left to the collector, each full collection
    # walks them all, a few seconds of a family's step spent in collections.
    gc.freeze()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    # On error the group is left up: tearing it down here would make the peers fail
    # (connection reset) before this rank's traceback is recorded as the first one.
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
    dist.destroy_process_group()


def run(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Call `fn(rank, world_size, *args)` on `world_size` ranks; return their results.

    `fn` must be defined at module level (it is pickled by reference).
    """
    with tempfile.TemporaryDirectory(prefix="rewrite-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        _spawn(_worker, (fn, world_size, init_file, tmp, args), world_size, timeout_s, getattr(fn, "__name__", fn))
        return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False) for r in range(world_size)]


def run_script(path: str, world_size: int, *, cwd: str, timeout_s: float = 120.0) -> None:
    """Run the script at `path` as `torchrun --nproc-per-node world_size path` would, from `cwd`: each rank
    with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), as `__main__`."""
    with socket.socket() as sock:  # a free port for the rank 0 store, as torchrun's --standalone picks one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _spawn(_script_worker, (path, world_size, port, cwd), world_size, timeout_s, path)


def _script_worker(rank: int, path: str, world_size: int, port: int, cwd: str) -> None:
    gc.freeze()
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    os.chdir(cwd)
    runpy.run_path(path, run_name="__main__")


def _spawn(worker, args: tuple, world_size: int, timeout_s: float, name) -> None:
    """`worker(rank, *args)` on `world_size` forked ranks, joined under a deadline (every rank killed at it)."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    ctx = mp.start_processes(worker, args=args, nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    try:
        while not _join(ctx, timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                raise AssertionError(
                    f"{name} timed out after {timeout_s:.0f}s on {world_size} ranks; ranks still running (killed): {alive}"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)


def _join(ctx, timeout: float) -> bool:
    """ctx.join, but a failure shows every failed rank's traceback, first failure first.

    When one rank raises, its peers often fail next inside a collective
    ("Connection reset by peer"); the rank that failed first is the cause.
    """
    try:
        return ctx.join(timeout=timeout)
    except mp.ProcessRaisedException as exc:
        time.sleep(0.5)  # let peers failing at the same moment finish writing their errors
        failed = [(os.path.getmtime(f), r, f) for r, f in enumerate(ctx.error_files) if os.path.exists(f)]
        traces, cut_short = [], []
        for _, rank, path in sorted(failed):
            try:
                with open(path, "rb") as fh:
                    traces.append(f"-- rank {rank} failed:\n{pickle.load(fh)}")
            except (EOFError, pickle.UnpicklingError):  # stopped while writing it: after the cause, whatever its time
                cut_short.append(f"-- rank {rank} failed (its traceback was not fully written)")
        raise AssertionError("\n".join(traces + cut_short) or str(exc)) from exc
