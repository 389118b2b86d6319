"""The worker side of `launch`: a fresh process that ties its life to the launcher's, joins the gloo group,
runs the function it was sent and leaves its value (or traceback) in its result file.
"""

from __future__ import annotations

import mmap
import os
import pickle
import sys
import threading
import time

__all__ = ["run_worker", "watch_parent"]


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this process once `parent_pid` is no longer its parent (it died; we were adopted).

    The portable fallback for where PR_SET_PDEATHSIG does not exist: a daemon thread,
    so it fires even while the main thread is blocked in a collective.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="rewrite-launch-watchdog", daemon=True).start()


def _put(fd: int, data: bytes) -> None:
    """Make `data` the whole content of this rank's result file."""
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "wb", closefd=False) as f:
        f.write(data)


def run_worker(parent_pid: int, payload_fd: int, result_fd: int) -> None:
    """Worker side: join the group, call the function, write its value or traceback.

    The payload's descriptor (and so its file offset) is shared by every rank: read
    it through a mapping of our own.
    """
    import traceback
    from datetime import timedelta

    watch_parent(parent_pid)
    try:
        with mmap.mmap(payload_fd, 0, access=mmap.ACCESS_READ) as payload:
            sys.path[:0] = [p for p in pickle.load(payload) if p not in sys.path]
            fn, args, kwargs, init, timeout_s = pickle.load(payload)  # cloudpickle output loads with pickle
        os.close(payload_fd)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the machine's cores
        if init:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        result = fn(*args, **kwargs)
        if init and dist.is_initialized():
            dist.destroy_process_group()  # only on success: a failed rank's peers may be mid-collective
        import cloudpickle

        _put(result_fd, cloudpickle.dumps(result))  # read by the parent only after we exit with 0
    except BaseException:
        text = traceback.format_exc()
        _put(result_fd, text.encode())
        sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a peer may be stuck in a collective with us
