"""`rewrite train` in a process of its own: the process group around a run (its timeout, its
store under torchrun's restarts), made before `train` and torn down after it.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import RewriteError, first_line
from ..plan.schema import PlanError
from .byte_data import TrainConfigError
from .guard import TrainStopped
from .stall_report import run_store, settle, stall_being_reported, stall_report
from .stores import local_store, restart_hazard, restart_store
from .train import TrainConfig, train
from .train_setup import pick_device

__all__ = ["PeerTimeout", "build_init_kwargs", "train_main"]


_TIMED_OUT = re.compile(r"timed? ?out", re.IGNORECASE)
_PEER_LEFT = re.compile(r"Connection (closed|reset) by peer")  # gloo, when a peer that failed has exited


class PeerTimeout(RewriteError, RuntimeError):
    """A collective waited `--timeout` seconds for a peer that never answered (stuck, stopped or gone).

    `quiet`: another rank prints the report (the lowest one that timed out); this one exits without a word,
    after `settle`.
    """

    def __init__(self, message: str, *, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet
        # Kept past the process group's teardown, for `settle`.
        self._store = run_store() if dist.is_initialized() else None
        self._world = dist.get_world_size() if dist.is_initialized() else 0

    def settle(self) -> None:
        """Called once this rank has printed its message (or, quiet, would have): the quiet ranks wait until the
        report is out, so that a launcher stopping every rank when one exits does not cut it short."""
        settle(self._store, self._world, printed=not self.quiet)


def build_init_kwargs(config: TrainConfig) -> dict:
    """The keyword arguments `train_main` passes to `dist.init_process_group`.

    Raises:
        TrainConfigError: `config.timeout_s` is not a positive, finite number of seconds, or
            `config.device` names a device this machine does not have.

    Example:
        >>> build_init_kwargs(TrainConfig("plans/llama-tp2.yaml", timeout_s=60))
        {'backend': 'gloo', 'timeout': datetime.timedelta(seconds=60)}
    """
    timeout_s = config.timeout_s
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise TrainConfigError(
            f"rewrite train: --timeout is {timeout_s!r}; use a positive number of seconds, e.g. --timeout 300: "
            "how long a rank may wait in a collective for a stuck or lost peer before the run fails"
        )
    _, backend = pick_device(config.device)
    return {"backend": backend, "timeout": timedelta(seconds=timeout_s)}


def train_main(config: TrainConfig) -> dict:
    """`train` in a process of its own: sets one torch thread (and its GPU), joins the group, leaves it.

    Under torchrun the rendezvous comes from its environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); run directly, it is a world of one process. The group
    it creates has `config.timeout_s` as its timeout, so a stuck rank fails the run
    within that time instead of holding every rank for torch's default 30 minutes. A
    group the caller already created is used as it is, with its own timeout.

    Raises:
        TrainConfigError: a bad `timeout_s`, on every rank, before any collective.
    """
    init_kwargs = build_init_kwargs(config)  # before the rendezvous: no rank is left waiting
    alone = "RANK" not in os.environ
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    device, _ = pick_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicators and every allocation on this rank's GPU
    else:
        torch.set_num_threads(1)  # the ranks share the machine's cores
    owns_group = not dist.is_initialized()
    if owns_group and os.environ.get("RANK") == "0" and (hazard := restart_hazard()):
        print(f"warning: {hazard}", file=sys.stderr, flush=True)
    cuda = device.type == "cuda"
    with _named_timeout(config.timeout_s, cuda=cuda):
        if owns_group:
            if alone:  # a world of one on a store of its own: no port to pick
                store = local_store(1, init_kwargs["timeout"])
                os.environ.setdefault("MASTER_PORT", str(store.port))
                dist.init_process_group(**init_kwargs, store=store, rank=0, world_size=1)
            else:
                dist.init_process_group(**init_kwargs, **restart_store(init_kwargs["timeout"]))
    try:
        with _named_timeout(config.timeout_s, cuda=cuda):  # inside: the group (and its store) still up to report
            result = train(config)
            if owns_group:
                # Every rank done before any tears down its connections: gloo aborts a process
                # whose peer closes a pair while its own threads still use it.
                dist.barrier()
        return result
    except (TrainConfigError, PlanError, TrainStopped) as exc:  # found alike on every rank: said by the first to
        exc.says = _first_to_say("refusal")  # find it (a launcher stops every rank once one exits: rank 0 may be last)
        raise
    except KeyboardInterrupt as exc:  # a second Ctrl-C: one rank says so, the first to get here
        exc.says = _first_to_say("interrupted")  # (rank 0 may be held in a wait its peers will never end)
        raise
    finally:
        if owns_group:
            dist.destroy_process_group()


def _first_to_say(what: str) -> bool:
    """Whether this rank is the first of the run to claim saying `what` (through the group's store); rank 0
    where the store does not answer."""
    store = run_store()
    try:
        return store.add(f"rewrite/says/{what}", 1) == 1
    except (AttributeError, RuntimeError, ValueError):  # no store, or its host gone
        return dist.get_rank() == 0 if dist.is_initialized() else True


@contextlib.contextmanager
def _named_timeout(timeout_s: float, *, cuda: bool):
    """A collective or rendezvous that waited `timeout_s` for a peer, said in the run's words: where every rank
    that still answers was (`stall_report`), printed by one of them."""
    try:
        yield
    except RuntimeError as exc:  # gloo: "Timed out waiting 10000ms for recv"; the store: "wait timeout after"
        if isinstance(exc, RewriteError) or not (_TIMED_OUT.search(str(exc)) or _PEER_LEFT.search(str(exc))):
            raise
        first = first_line(exc)
        if _PEER_LEFT.search(first) and dist.is_initialized() and not stall_being_reported():
            # A peer ended first (its error) and said why, or its launcher will: not again.
            raise PeerTimeout(f"a peer left the run ({first})", quiet=True) from None
        if not dist.is_initialized():  # the rendezvous itself: no store to report through
            raise PeerTimeout(f"no answer from a peer within --timeout {timeout_s:g} s (a rank stuck, stopped or gone) "
                              f"while the ranks met; this run stops. ({first})") from None
        report, speaks = stall_report(timeout_s, first, cuda=cuda)
        raise PeerTimeout(report, quiet=not speaks) from None
