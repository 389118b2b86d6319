"""SIGINT / SIGTERM in `rewrite train`: requests to stop after the step, a second Ctrl-C at once, one line."""

from __future__ import annotations

import os
import signal

import pytest

from rewrite.run.signals import StopRequests, stopped_by
from rewrite.run.train import TrainConfig


def test_a_first_signal_is_a_request_and_a_second_ctrl_c_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    with StopRequests() as stops:
        assert stops.agreed() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.agreed() == signal.SIGTERM  # no process group: this rank's own word
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM (torchrun forwarding a scheduler's): no more
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # handlers given back


def test_the_line_says_the_step_the_checkpoint_and_how_to_go_on(tmp_path):
    config = TrainConfig("plans/llama-pp2.yaml", steps=50, ckpt=str(tmp_path / "ckpt"))
    saved = tmp_path / "ckpt" / "step-00000012"
    assert stopped_by(signal.SIGINT, 12, config, saved) == (
        f"stopped by SIGINT after step 12 of 50: its training state is saved in {saved}; the same command with "
        "--resume continues from it")
    assert stopped_by(signal.SIGTERM, 3, TrainConfig("p.yaml", steps=50), None) == (
        "stopped by SIGTERM after step 3 of 50: nothing saved (no --ckpt), so a new run starts from step 1")
    quiet = TrainConfig("p.yaml", steps=50, ckpt=str(tmp_path / "none"), save_on_signal=False, resume=True)
    assert "nothing saved (--no-save-on-signal)" in stopped_by(signal.SIGINT, 3, quiet, None)
