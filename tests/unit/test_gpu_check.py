"""`python -m bench.gpu_check` on the CPU at its tiny sizes: the command a GPU machine runs keeps working."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rewrite.estimate.hardware import load_hardware
from tests.paths import ROOT


def test_gpu_check_runs_on_the_cpu_and_says_everything_in_one_json(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout) == result  # printed and written alike
    hw = load_hardware(result["profile_file"])  # the measured profile is one `show --hardware` reads
    assert {"float32", "bfloat16"} <= set(hw.peak_flops) and hw.memory_bandwidth > 0
    ran = [s for s in result["switches"] if s["ran"]]
    assert len(ran) >= 5 and all(s["ok"] and s["by"] == "autocast" for s in ran), ran
    assert all(s["float32_grad_relative_max"] > 1e-4 for s in ran)  # computed in bfloat16 indeed
    refused = {s["switch"]: s["refused"] for s in result["switches"] if not s["ran"]}
    assert set(refused) == {"sequence_parallel", "loss_parallel"}  # they need tp > 1, and say so
    assert "lm_head" in refused["loss_parallel"]
    step = result["throughput"]
    assert step["tokens_per_s"] > 0 and step["predicted"]["tokens_per_s"] > 0 and 0 < step["mfu"] < 1
    assert step["predicted"]["memory_bytes"] > 0 and step["peak_memory_bytes"] is None  # no allocator stats on CPU
    assert step["losses"][-1] < step["losses"][0]  # it trains
    compiled = result["throughput_compiled"]
    assert compiled["compile"] == {"backend": "aot_eager"} and step["compile"] is None
    assert compiled["losses"][0] == pytest.approx(step["losses"][0], abs=1e-2)  # bfloat16 compute: its tolerance
    assert compiled["first_step_s"] > 0 and result["compiled_over_eager"] > 0
