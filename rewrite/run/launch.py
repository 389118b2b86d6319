"""Start ranks from Python (a notebook, a script) without torchrun.

`launch(fn, nprocs, *args)` sends `fn` to fresh worker processes *by value*
(cloudpickle), so functions defined in a notebook work although plain pickle
cannot send them to spawned processes. Each worker gets torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), joins a gloo group
itself, and returns `fn`'s value. A failing rank fails the launch with its
traceback; a rank still running at the deadline fails it too. Either way every
rank is killed: nothing is left waiting in a collective. Neither a worker nor a
file outlives the launching process, however that process ends.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import timedelta
from typing import Any, BinaryIO, Callable

from ..errors import RewriteError
from .stores import local_store

__all__ = ["launch", "LaunchError"]


class LaunchError(RewriteError, RuntimeError):
    """A launched rank failed or the launch timed out.

    Attributes:
        rank: the rank that failed first (None on a timeout).
        traceback: that rank's Python traceback, when it wrote one.
        alive: ranks still running when the launch was stopped (they were killed).
    """

    def __init__(self, message: str, *, rank: int | None = None, traceback: str = "", alive: list[int] | None = None):
        super().__init__(message)
        self.rank, self.traceback, self.alive = rank, traceback, list(alive or [])


# What each worker runs: `python -c _BOOTSTRAP parent_pid payload_fd result_fd`. Its
# first lines, standard library only, tie the worker to its parent before the slow
# `import rewrite` (torch): on Linux the kernel SIGKILLs it when the parent ends, however
# (PR_SET_PDEATHSIG = 1; it follows the thread that started the worker, which `launch`
# keeps waiting for the workers). A parent already gone is no longer getppid().
_BOOTSTRAP = """\
import os, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    try:
        import ctypes, signal
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # the watchdog thread of run_worker still stops us
if os.getppid() != parent:
    os._exit(1)
from rewrite.run.launch_worker import run_worker
run_worker(parent, int(sys.argv[2]), int(sys.argv[3]))
"""


def _stream(selector: selectors.BaseSelector, tails: list[deque], echo: bool, wait: float) -> None:
    """Copy whatever the workers printed to this process's stdout, one prefixed line at a time."""
    for key, _ in selector.select(timeout=wait):
        rank, buffer = key.data
        chunk = os.read(key.fd, 65536)
        if not chunk:
            selector.unregister(key.fileobj)
            lines, buffer[:] = bytes(buffer).splitlines(), b""
        else:
            buffer += chunk
            *lines, rest = bytes(buffer).split(b"\n")
            buffer[:] = rest
        for line in lines:
            text = line.decode(errors="replace").rstrip("\r")
            tails[rank].append(text)
            if echo:
                print(f"[rank {rank}] {text}", flush=True)


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 300.0, init_process_group: bool = True,
           env: dict[str, str] | None = None, echo: bool = True, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nprocs` local ranks and return each rank's value.

    Each rank is a fresh Python process started with the environment torchrun would
    give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
    MASTER_PORT of a store this process hosts, OMP_NUM_THREADS=1). It sets one torch thread, calls
    `torch.distributed.init_process_group("gloo")`, runs `fn`, and leaves the group.
    Ranks die with this process, even if it is SIGKILLed (Linux: at once; elsewhere
    within a second), and `fn` and the results pass through unnamed temporary files,
    so no process and no file outlives the launch.

    Args:
        fn: any function, including one defined in a notebook: it is serialised by
            value with cloudpickle, together with what it refers to.
        nprocs: number of ranks.
        *args, **kwargs: passed to `fn` on every rank (they must be picklable too).
        timeout_s: the whole launch's deadline; ranks still running then are killed.
        init_process_group: False to let `fn` create the group itself.
        env: extra environment variables for the workers.
        echo: print the workers' output here, each line prefixed `[rank r]`.

    Returns:
        `[value on rank 0, value on rank 1, ...]`.

    Raises:
        ValueError: `nprocs` < 1 or a `fn` that cannot be serialised.
        LaunchError: a rank failed (message: its rank and traceback) or the deadline
            passed (message: the ranks still running). Every rank is killed first.

    Example:
        >>> def step(scale):
        ...     import torch, torch.distributed as dist
        ...     x = torch.ones(1) * dist.get_rank() * scale
        ...     dist.all_reduce(x)
        ...     return float(x)
        >>> rewrite.launch(step, 2, 10.0)
        [10.0, 10.0]
    """
    import cloudpickle

    paths, payload = _payload(fn, nprocs, args, kwargs, init_process_group, timeout_s)
    store = local_store(nprocs, timedelta(seconds=timeout_s))  # held until the launch returns
    base = _worker_env(nprocs, store.port, env)
    # Unnamed files (O_TMPFILE on Linux, unlinked at once elsewhere), handed to the
    # workers as open descriptors: the kernel frees them when the last holder ends, so
    # nothing is left in the temp folder whoever dies first and however.
    with contextlib.ExitStack() as files:
        payload_file, *results = (
            files.enter_context(tempfile.TemporaryFile(prefix="rewrite-launch-")) for _ in range(nprocs + 1)
        )
        pickle.dump(paths, payload_file)
        payload_file.write(payload)
        payload_file.flush()
        procs: list[subprocess.Popen] = []
        selector = selectors.DefaultSelector()
        tails = [deque(maxlen=40) for _ in range(nprocs)]
        try:
            for rank in range(nprocs):
                fds = (payload_file.fileno(), results[rank].fileno())
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, str(os.getpid()), *map(str, fds)],
                    env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    pass_fds=fds,
                )
                procs.append(proc)
                selector.register(proc.stdout, selectors.EVENT_READ, (rank, bytearray()))
            _wait(procs, selector, tails, results, echo, time.monotonic() + timeout_s, timeout_s)
            return [cloudpickle.loads(_contents(f)) for f in results]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
                proc.stdout.close()
            selector.close()


def _payload(fn, nprocs, args: tuple, kwargs: dict, init_process_group: bool, timeout_s: float
             ) -> tuple[list[str], bytes]:
    """(the import paths the workers need, `fn` and its arguments serialised by value); ValueError for bad ones."""
    import cloudpickle

    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch needs nprocs >= 1 ranks, got {nprocs!r}")
    if not callable(fn):
        raise ValueError(f"launch needs a function to run on each rank, got {type(fn).__name__}")
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    if os.getcwd() not in paths:
        paths.insert(0, os.getcwd())
    try:
        payload = cloudpickle.dumps((fn, args, kwargs, init_process_group, timeout_s))
    except Exception as exc:  # cloudpickle raises many kinds
        raise ValueError(
            f"launch cannot serialise {getattr(fn, '__name__', fn)!r} or its arguments: {exc}; "
            "pass plain data (numbers, strings, paths, tensors) and open files or sockets inside fn"
        ) from None
    return paths, payload


def _worker_env(nprocs: int, port: int, env: dict[str, str] | None) -> dict[str, str]:
    """The environment every worker starts with, as torchrun's (its rank added per worker)."""
    return {
        **os.environ,
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # join the store above as clients
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "MPLBACKEND": "Agg",  # not the notebook's inline backend: workers have no display
        **(env or {}),
    }


def _contents(f: BinaryIO) -> bytes:
    """What an exited worker left in its result file."""
    f.seek(0)
    return f.read()


def _wait(procs, selector, tails, results: list[BinaryIO], echo: bool, deadline: float, timeout_s: float) -> None:
    while True:
        _stream(selector, tails, echo, wait=0.1)
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # The rank that raised first wrote its traceback; peers may just have lost it.
            _drain(selector, tails, echo)
            stats = {r: os.fstat(results[r].fileno()) for r in failed}
            written = [r for r in failed if stats[r].st_size]
            first = min(written, key=lambda r: stats[r].st_mtime_ns) if written else failed[0]
            trace = _contents(results[first]).decode(errors="replace") if written else "\n".join(tails[first])
            alive = [r for r, p in enumerate(procs) if p.poll() is None]
            raise LaunchError(
                f"rank {first} of {len(procs)} failed (exit code {codes[first]}); every rank was stopped.\n"
                f"--- rank {first} ---\n{trace.rstrip()}", rank=first, traceback=trace, alive=alive,
            )
        if all(c == 0 for c in codes):
            _drain(selector, tails, echo)
            return
        if time.monotonic() > deadline:
            alive = [r for r, c in enumerate(codes) if c is None]
            last = "".join(
                f"\n--- rank {r}, last lines ---\n" + "\n".join(list(tails[r])[-5:]) for r in alive if tails[r]
            )
            raise LaunchError(
                f"launch timed out after {timeout_s:.0f}s on {len(procs)} ranks; ranks still running "
                f"(killed): {alive}. A rank waiting in a collective that a peer never joined hangs like "
                f"this; raise timeout_s if the work is just slow.{last}",
                alive=alive,
            )


def _drain(selector, tails, echo: bool) -> None:
    """Read what exited workers left in their pipes."""
    end = time.monotonic() + 2.0
    while selector.get_map() and time.monotonic() < end:
        _stream(selector, tails, echo, wait=0.05)
