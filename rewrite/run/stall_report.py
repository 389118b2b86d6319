"""When a peer stops answering: where every rank still running was, collected through the rendezvous store.

Each rank whose wait timed out writes what it was doing (`rewrite.doing`: the step, the action or
collective, the peer it waited for) under a key of its own, then reads the others' for a few
seconds. A rank that wrote nothing is named as the one that stopped (stopped, stuck outside a
collective, or gone). The lowest rank that reported prints the report; the others exit quietly, but
only once it has been printed (`settle`): a launcher stops every rank as soon as one exits, and
would otherwise stop the one about to print.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from ..agreement import describe_ranks
from ..doing import stalled
from ..torch_internals import default_store

__all__ = ["run_store", "settle", "stall_being_reported", "stall_report"]

_KEY = "rewrite/stalled/{rank}"
_SAID = "rewrite/stalled/said"  # counts the ranks that decided to print: the first one does
_PRINTED = "rewrite/stalled/printed"  # set once the report is out: the quiet ranks may leave
_WINDOW_S = 10.0  # how long a reporter waits for the others' reports (ranks in one collective time out together)
_STORE_S = 5.0  # each store call's own limit: the store's host may be the rank that stopped


def stall_report(timeout_s: float, cause: str, *, cuda: bool) -> tuple[str, bool]:
    """The report of a timed-out run (its first line names the timeout) and whether this rank prints it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = stalled()
    reports, first = {rank: None if mine is None else mine.describe()}, None
    window = min(_WINDOW_S, timeout_s)
    try:
        store = run_store()
        if store is None:
            raise RuntimeError("no store")
        store.set(_KEY.format(rank=rank), json.dumps(reports[rank]))
        deadline = time.monotonic() + window
        while len(reports) < world and time.monotonic() < deadline:
            for r in range(world):
                if r not in reports and store.check([_KEY.format(rank=r)]):
                    reports[r] = json.loads(store.get(_KEY.format(rank=r)))
            time.sleep(0.05)
        # The lowest rank heard from prints; a rank whose wait ended later (after the first printed) stays quiet.
        first = rank == min(reports) and store.add(_SAID, 1) == 1
    except (RuntimeError, ValueError, OSError):  # no store, or it stopped answering too: this rank's own view
        pass
    lines = [f"no answer from a peer within --timeout {timeout_s:g} s (a rank stuck, stopped or gone); this run stops:"]
    by_what: dict[str, list[int]] = {}
    for r in sorted(reports):
        by_what.setdefault(reports[r] or "outside any step", []).append(r)
    lines += [f"  {describe_ranks(ranks)} waited in {what}" for what, ranks in by_what.items()]
    silent = [r for r in range(world) if r not in reports]
    if silent:
        lines.append(f"  {describe_ranks(silent)} sent no report within {window:g} s: stopped, stuck elsewhere, or gone")
    lines.append("  --max-restarts (of rewrite train or torchrun) starts every rank again and --resume continues from the last "
                 f"checkpoint. ({cause})")
    if cuda:
        lines.append("  NCCL's flight recorder dumps each rank's collectives on a timeout: set "
                     "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and TORCH_NCCL_DUMP_ON_TIMEOUT=1 (docs/training.md)")
    return "\n".join(lines), first if first is not None else rank == min(reports)


def stall_being_reported(grace_s: float = 2.0) -> bool:
    """Whether a peer is reporting a stall, waiting up to `grace_s` for its first word: gloo closes a timed-out
    rank's connections, so its peers may see "connection closed" a moment before it writes its report."""
    store, world = run_store(), dist.get_world_size()
    if store is None:
        return False
    deadline = time.monotonic() + grace_s
    try:
        while not any(store.check([_KEY.format(rank=r)]) for r in range(world)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    except (RuntimeError, ValueError, OSError):
        return False
    return True


def settle(store, world: int, *, printed: bool) -> None:
    """After this rank's error: say the report is out (`printed`), or, when a report is being made by
    another rank, wait for it to be printed (at most the reporters' window and a margin) before leaving.

    `store` is the run's store, kept from before the process group was torn down (None: leave now).
    """
    if store is None:
        return
    try:
        if printed:
            store.set(_PRINTED, "1")
            return
        if not any(store.check([_KEY.format(rank=r)]) for r in range(world)):
            return  # no rank is reporting a stall: nothing to wait for
        deadline = time.monotonic() + _WINDOW_S + _STORE_S
        while not store.check([_PRINTED]) and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, ValueError, OSError):  # the store is gone (its host left): leave now
        pass


def run_store():
    """The default group's store with short calls (the store's host may be the rank that stopped), or None."""
    try:
        store = default_store()
        store.set_timeout(timedelta(seconds=_STORE_S))
        return store
    except (RuntimeError, ValueError):
        return None
