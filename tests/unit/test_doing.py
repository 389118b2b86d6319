"""What a rank is doing: named as it enters, the innermost name kept when a wait fails."""

from __future__ import annotations

import pytest

from rewrite.doing import Activity, at_step, doing, stalled


def test_the_innermost_activity_a_failure_left_is_kept_until_the_next_step():
    at_step(5)
    with doing("F0 of stage 0"):
        assert stalled() == Activity("F0 of stage 0", None, 5)
        with doing("recv F0 for stage 1 from rank 2", peer=2):
            pass
        assert stalled().what == "F0 of stage 0"  # left cleanly: the outer name again
    assert stalled() is None
    with pytest.raises(RuntimeError):
        with doing("B1 of stage 1"):
            with doing("recv B1 for stage 0 from rank 3", peer=3):
                raise RuntimeError("Timed out waiting 8000ms for recv")
    assert stalled() == Activity("recv B1 for stage 0 from rank 3", 3, 5)
    assert stalled().describe() == "step 5: recv B1 for stage 0 from rank 3"
    at_step(6)
    assert stalled() is None
    at_step(None)
    with doing("the step loss's all-reduce over every rank"):
        assert stalled().describe() == "the step loss's all-reduce over every rank"  # outside a training loop
