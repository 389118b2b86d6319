"""The multi-process helper itself: a deadlock fails fast, a rank's error is shown."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from tests.multiproc import run


def _rank0_never_arrives(rank: int, ws: int) -> None:
    if rank == 0:
        time.sleep(600)
    dist.barrier()


def _rank1_raises(rank: int, ws: int) -> None:
    if rank == 1:
        raise ValueError("bad plan on rank 1")
    dist.barrier()


def _returns(rank: int, ws: int) -> int:
    return rank


def test_deadlock_is_killed_and_named():
    assert run(_returns, 1) == [0]  # the ranks' server started (imports: seconds on a busy machine), before timing
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 3s on 2 ranks; ranks still running \(killed\): \[0, 1\]"):
        run(_rank0_never_arrives, 2, timeout_s=3)
    assert time.monotonic() - start < 20


def test_failing_rank_traceback_surfaces():
    with pytest.raises(AssertionError) as info:
        run(_rank1_raises, 2, timeout_s=30)
    message = str(info.value)
    assert message.startswith("-- rank 1 failed:") and "ValueError: bad plan on rank 1" in message
