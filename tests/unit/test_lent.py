"""`lent`: tensors handed to a collective are waited for until whoever still holds them lets go.

A plain Python thread stands in for gloo's worker thread: it holds the only reference to a
lent tensor for a while, as the worker does between the caller's `wait()` and its own cleanup.
"""

from __future__ import annotations

import threading
import time

import torch

from rewrite import lent


def _hold(tensor_box: list, seconds: float, started: threading.Event) -> threading.Thread:
    def worker():
        held = tensor_box.pop()  # the only reference left, as in a collective's worker
        started.set()
        time.sleep(seconds)
        del held

    thread = threading.Thread(target=worker)
    thread.start()
    return thread


def test_settle_waits_for_the_last_holder_and_no_longer():
    lent.settle()
    box, started = [torch.ones(4)], threading.Event()
    lent.lend(box[0])
    thread = _hold(box, 0.3, started)
    started.wait()
    assert lent.outstanding() == 1
    begin = time.monotonic()
    assert lent.settle(timeout=10) == 0
    waited = time.monotonic() - begin
    thread.join()
    assert 0.2 < waited < 2.0, waited  # until the holder let go, not to the timeout
    assert lent.outstanding() == 0


def test_settle_returns_at_once_when_nothing_is_held_and_gives_up_at_its_timeout():
    lent.settle()
    lent.lend(torch.zeros(2), torch.zeros(3))  # dropped at once: nothing to wait for
    begin = time.monotonic()
    assert lent.settle(timeout=10) == 0
    assert time.monotonic() - begin < 1.0  # not its timeout of 10 s
    kept = torch.zeros(1)  # lent by mistake while still held: settle stops at its timeout, and says how many
    lent.lend(kept)
    begin = time.monotonic()
    assert lent.settle(timeout=0.2) == 1
    assert 0.15 < time.monotonic() - begin < 5.0
    del kept
    assert lent.settle(timeout=1) == 0


def test_lending_many_keeps_only_the_live_ones():
    lent.settle()
    alive = [torch.zeros(1) for _ in range(10)]
    lent.lend(*alive)
    for _ in range(3000):
        lent.lend(torch.zeros(1))
    assert len(lent._lent) < 600  # dead references are swept as the list grows
    assert lent.outstanding() == 10
    del alive
    assert lent.settle(timeout=1) == 0
