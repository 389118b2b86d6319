"""`StateGuard`'s decisions and words, and metrics that stay strict JSON."""

from __future__ import annotations

import json
import math

import pytest

from rewrite.run.metrics import MetricsLog, strict_json
from rewrite.run.guard import StateGuard, TrainStopped


def test_finite_steps_apply_and_stop_ends_at_the_first_other():
    guard = StateGuard("stop", ckpt=None, lr=0.5)
    assert guard.applies(1, 2.0, 1.0) and guard.applies(2, 1.5, 0.0)
    with pytest.raises(TrainStopped) as stopped:
        guard.applies(3, math.nan, 1.0)
    said = str(stopped.value)
    assert said.startswith("rewrite train stopped at step 3: the loss is nan and the gradient norm 1; the step was "
                           "not applied and nothing of it was saved. The run saves no training state (no --ckpt)")
    assert "try a lower --lr (this run's: 0.5), --max-grad-norm 1.0, a longer --warmup, or --on-nonfinite skip" in said
    assert guard.skipped == 1


def test_skip_counts_and_stops_at_the_limit_in_a_row(tmp_path):
    guard = StateGuard("skip", limit=2, ckpt=str(tmp_path))
    assert not guard.applies(1, 1.0, math.inf)
    assert guard.applies(2, 1.0, 1.0) and guard.in_a_row == 0
    assert not guard.applies(3, -math.inf, 1.0)
    with pytest.raises(TrainStopped, match=r"at step 4: 2 steps in a row \(steps 3-4\) were not finite, the limit "
                                           r"--skip-limit 2; at the last, the loss is nan"):
        guard.applies(4, math.nan, math.nan)
    assert guard.skipped == 3
    assert f"{tmp_path} holds no checkpoint yet" in guard.where_good()
    assert "--on-nonfinite skip" not in guard.advice()


def test_metrics_write_null_for_nan_and_inf(tmp_path):
    log = MetricsLog(tmp_path, enabled=True)
    log.write(1, {"loss": math.nan, "grad_norm": math.inf, "lr": 0.1, "applied": False})
    log.close()
    line = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=pytest.fail)
    assert line == {"step": 1, "loss": None, "grad_norm": None, "lr": 0.1, "applied": False}
    assert strict_json({"a": [1.0, -math.inf, (math.nan, "x")], "b": None}) == {"a": [1.0, None, [None, "x"]], "b": None}
