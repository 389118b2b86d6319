"""Start ranks from Python (a notebook, a script) without torchrun.

`launch(fn, nprocs, *args)` sends `fn` to fresh worker processes *by value*
(cloudpickle), so functions defined in a notebook work although plain pickle
cannot send them to spawned processes. Each worker gets torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), joins a gloo group
itself, and returns `fn`'s value. A failing rank fails the launch with its
traceback; a rank still running at the deadline fails it too. Either way every
rank is killed: nothing is left waiting in a collective.
"""

from __future__ import annotations

import os
import pickle
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

__all__ = ["launch", "LaunchError"]


class LaunchError(RuntimeError):
    """A launched rank failed or the launch timed out.

    Attributes:
        rank: the rank that failed first (None on a timeout).
        traceback: that rank's Python traceback, when it wrote one.
        alive: ranks still running when the launch was stopped (they were killed).
    """

    def __init__(self, message: str, *, rank: int | None = None, traceback: str = "", alive: list[int] | None = None):
        super().__init__(message)
        self.rank, self.traceback, self.alive = rank, traceback, list(alive or [])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What each worker runs: `python -c _BOOTSTRAP payload_dir`. Kept import-light until
# sys.path is set, so functions pickled by reference resolve as in the parent.
_BOOTSTRAP = "import sys; from rewrite.run.launch import _worker; _worker(sys.argv[1])"


def _worker(payload_dir: str) -> None:
    """Worker side: join the group, call the function, write its value or traceback."""
    import traceback
    from datetime import timedelta

    rank = int(os.environ["RANK"])
    folder = Path(payload_dir)
    try:
        with open(folder / "payload.pkl", "rb") as f:
            sys.path[:0] = [p for p in pickle.load(f) if p not in sys.path]
            fn, args, kwargs, init, timeout_s = pickle.load(f)  # cloudpickle output loads with pickle
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the machine's cores
        if init:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        result = fn(*args, **kwargs)
        if init and dist.is_initialized():
            dist.destroy_process_group()  # only on success: a failed rank's peers may be mid-collective
        import cloudpickle

        (folder / f"result{rank}.tmp").write_bytes(cloudpickle.dumps(result))
        os.replace(folder / f"result{rank}.tmp", folder / f"result{rank}.pkl")
    except BaseException:
        text = traceback.format_exc()
        (folder / f"error{rank}.txt").write_text(text)
        sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a peer may be stuck in a collective with us


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


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout_s: float = 300.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    echo: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nprocs` local ranks and return each rank's value.

    Each rank is a fresh Python process started with the environment torchrun would
    give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
    MASTER_PORT on a free port, OMP_NUM_THREADS=1). It sets one torch thread, calls
    `torch.distributed.init_process_group("gloo")`, runs `fn`, and leaves the group.

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

    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch needs nprocs >= 1 ranks, got {nprocs!r}")
    if not callable(fn):
        raise ValueError(f"launch needs a function to run on each rank, got {type(fn).__name__}")
    with tempfile.TemporaryDirectory(prefix="rewrite-launch-") as tmp:
        folder = Path(tmp)
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
        with open(folder / "payload.pkl", "wb") as f:
            pickle.dump(paths, f)
            f.write(payload)
        base = {
            **os.environ,
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "MPLBACKEND": "Agg",  # not the notebook's inline backend: workers have no display
            **(env or {}),
        }
        procs: list[subprocess.Popen] = []
        selector = selectors.DefaultSelector()
        tails = [deque(maxlen=40) for _ in range(nprocs)]
        try:
            for rank in range(nprocs):
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, tmp],
                    env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
                procs.append(proc)
                selector.register(proc.stdout, selectors.EVENT_READ, (rank, bytearray()))
            _wait(procs, selector, tails, folder, echo, time.monotonic() + timeout_s, timeout_s)
            return [cloudpickle.loads((folder / f"result{r}.pkl").read_bytes()) for r in range(nprocs)]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
                proc.stdout.close()
            selector.close()


def _wait(procs, selector, tails, folder: Path, echo: bool, deadline: float, timeout_s: float) -> None:
    while True:
        _stream(selector, tails, echo, wait=0.1)
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # The rank that raised first wrote its traceback; peers may just have lost it.
            _drain(selector, tails, echo)
            errors = {r: (folder / f"error{r}.txt") for r in range(len(procs))}
            written = [r for r in failed if errors[r].exists()]
            first = min(written, key=lambda r: errors[r].stat().st_mtime) if written else failed[0]
            trace = errors[first].read_text() if errors[first].exists() else "\n".join(tails[first])
            alive = [r for r, p in enumerate(procs) if p.poll() is None]
            raise LaunchError(
                f"rank {first} of {len(procs)} failed (exit code {codes[first]}); every rank was stopped.\n"
                f"--- rank {first} ---\n{trace.rstrip()}",
                rank=first,
                traceback=trace,
                alive=alive,
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
