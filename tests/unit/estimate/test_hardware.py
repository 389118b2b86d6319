"""Hardware profiles: the shipped ones, files, bad input, and what `rewrite calibrate` writes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from rewrite.estimate.hardware import HARDWARE_NAMES, PROFILES, Hardware, load_hardware
from rewrite.run.calibrate import profile_yaml
from tests.paths import ROOT


def test_the_shipped_profiles_load_and_cite_a_source_for_every_number():
    assert set(HARDWARE_NAMES) == {"h100-sxm", "h100-96g", "h200", "a100-80g", "cpu"}
    for name in HARDWARE_NAMES:
        hw = load_hardware(name)
        assert isinstance(hw, Hardware) and hw.name == name
        assert hw.flops("float32") > 0 and 0 < hw.efficiency.matmul <= 1
        lines = (PROFILES / f"{name}.yaml").read_text().splitlines()
        for i, line in enumerate(lines):
            if not re.match(r"\s*\w+:\s*[0-9.]+(e[+-]?\d+)?\s*(#|$)", line):
                continue
            indent = len(line) - len(line.lstrip())
            parent = next((p for p in reversed(lines[:i]) if p.strip() and len(p) - len(p.lstrip()) < indent), "")
            assert "#" in line or (indent and "#" in parent), f"{name}: no source for {line.strip()!r}"
    assert all(load_hardware(n).layer_overhead_s == 0 for n in ("h100-sxm", "h100-96g", "h200", "a100-80g"))
    assert 0 < load_hardware("cpu").layer_overhead_s < 0.01  # eager dispatch, measured
    h100 = load_hardware("h100-sxm")
    assert h100.peak_flops["bfloat16"] == 989.4e12 and h100.devices_per_node == 8
    assert load_hardware("h200").memory_gib > load_hardware("h100-sxm").memory_gib


def test_a_device_leaves_tensors_its_memory_less_the_reserve_and_fragmentation(tmp_path):
    for name in ("h100-sxm", "h100-96g", "h200", "a100-80g"):  # a GPU keeps the runtime's context and NCCL's buffers apart
        hw = load_hardware(name)
        assert hw.memory_reserve_gib > 0 and 0 < hw.fragmentation < 1
        assert hw.usable_gib() == pytest.approx((hw.memory_gib - hw.memory_reserve_gib) * (1 - hw.fragmentation))
        assert hw.usable_gib(40) < hw.usable_gib() < hw.memory_gib
    assert load_hardware("h100-sxm").usable_text(80) == (
        "73.1 GiB usable on h100-sxm (80 GiB less 3 GiB reserved and 5% for the allocator)")
    cpu = load_hardware("cpu")
    assert cpu.usable_gib() == cpu.memory_gib and cpu.usable_text() == f"{cpu.memory_gib:.3g} GiB usable on cpu"
    assert load_hardware("h100-sxm").usable_gib(2) == 0.0  # all of it reserved
    path = tmp_path / "tight.yaml"
    path.write_text((PROFILES / "h100-sxm.yaml").read_text().replace("memory_reserve_gib: 3.0", "memory_reserve_gib: 90"))
    with pytest.raises(ValueError, match="memory_reserve_gib 90 leaves nothing of memory_gib 79.6"):
        load_hardware(path)
    path.write_text((PROFILES / "h100-sxm.yaml").read_text().replace("fragmentation: 0.05", "fragmentation: 1.0"))
    with pytest.raises(ValueError, match="fragmentation"):
        load_hardware(path)


def test_a_profile_file_works_where_a_name_does(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((PROFILES / "a100-80g.yaml").read_text().replace("name: a100-80g", "name: mine"))
    assert load_hardware(str(path)).name == "mine"
    assert load_hardware(path).intra_node.bandwidth == 300e9


def test_bad_profiles_and_names_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"unknown hardware 'h1000': use one of a100-80g, cpu, h100-96g, h100-sxm, h200"):
        load_hardware("h1000")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmemory_gib: -1\n")
    with pytest.raises(ValueError, match=r"bad.yaml: \d+ problem\(s\).*memory_gib: Input should be greater than 0"):
        load_hardware(bad)
    with pytest.raises(ValueError, match=r"gives no peak FLOP/s for float64 .*add peak_flops.float64"):
        load_hardware("cpu").flops("float64")


def test_a_calibrated_profile_reads_back():
    found = {
        "flops": {"float32": 5e10}, "memory_bandwidth": 2e10, "latency": 1e-4, "link": 2e9, "collective": 0.6,
        "memory_gib": 12.0, "world": 2, "measured": {"p2p": {4: 1e-4}, "all_reduce": {4: 2e-4}},
    }
    hw = Hardware.model_validate(__import__("yaml").safe_load(profile_yaml(found, name="here")))
    assert hw.name == "here" and hw.flops("float32") == 5e10 and hw.inter_node == hw.intra_node
    assert hw.layer_overhead_s == 0  # not measured: not modelled
    assert hw.activation_bandwidth is None and hw.microbatch_overhead_s == 0 and hw.memory_reserve_gib == 0
    assert hw.optimizer_bandwidth is None  # not measured: AdamW's traffic at memory_bandwidth
    assert hw.large_microbatch is None  # not measured: linear in the tokens
    found.update(layer_overhead_s=0.0025, activation_bandwidth=6e9, microbatch_overhead_s=0.004, optimizer_bandwidth=5e9,
                 large_microbatch={"tokens": 1024, "ratio": 1.25})
    measured = Hardware.model_validate(__import__("yaml").safe_load(profile_yaml(found)))
    assert (measured.layer_overhead_s, measured.activation_bandwidth, measured.microbatch_overhead_s) == (0.0025, 6e9, 0.004)
    assert measured.optimizer_bandwidth == 5e9 and measured.large_microbatch.model_dump() == {"tokens": 1024, "ratio": 1.25}
    found["gpu"] = True  # a GPU's profile keeps the runtime's reserve, as the shipped ones
    gpu = Hardware.model_validate(__import__("yaml").safe_load(profile_yaml(found)))
    assert (gpu.memory_reserve_gib, gpu.fragmentation) == (3.0, 0.05)


def test_rewrite_calibrate_measures_this_machine(tmp_path):
    out = tmp_path / "here.yaml"
    run = subprocess.run([sys.executable, "-m", "rewrite", "calibrate", "--world", "2", "--repeats", "3", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    hw = load_hardware(out)
    assert hw.devices_per_node == 2 and hw.flops("float32") > 1e8 and hw.intra_node.latency > 0
    # Eager CPU dispatch: milliseconds per layer and microbatch, not seconds. The two are fitted apart (a
    # layer's intercept, a microbatch's remainder) from 3 timings each, so on a busy machine either may come out 0,
    # and both did once (the suite's other worker beside it): of these and the compiled fit's two, one is not (below).
    assert 0 <= hw.layer_overhead_s < 1 and 0 <= hw.microbatch_overhead_s < 1 and hw.memory_reserve_gib == 0
    # The elementwise operators move activations slower than a large copy does (when the FLOPs leave any time).
    assert hw.activation_bandwidth is None or 0 < hw.activation_bandwidth < hw.memory_bandwidth
    # Past the fitted 1,024 tokens a microbatch, 2,048 tokens measured against the fitted time per token.
    assert hw.large_microbatch is not None and hw.large_microbatch.tokens == 1024 and 0 < hw.large_microbatch.ratio < 10
    # Selective checkpointing's policy beyond the recompute charged, per layer (0 where the noise leaves nothing).
    assert 0 <= hw.selective_overhead_s < 0.1
    # Each collective a run makes, timed over the 2 ranks at every size, never cheaper for more bytes.
    assert set(hw.collective_times) == {"sum", "gather", "scatter", "all_to_all", "all_reduce", "all_gather", "reduce_scatter"}
    for kind, by_n in hw.collective_times.items():
        times = list(by_n[2].values())
        assert list(by_n) == [2] and len(times) == 5 and 0 < times[0] and times == sorted(times), kind
    assert 0 <= hw.overlap <= 1  # gloo's threads share the ranks' cores: little or nothing hidden
    # A tp 2 layer's collectives and a MoE's all-to-alls (its experts over a dp pair, and over a tp pair) beyond
    # their time alone, per call (0 where the noise leaves nothing), and the cores.
    assert set(hw.call_overhead_s) == {"sum", "gather", "scatter", "all_to_all", "all_to_all_tp"}
    assert all(0 <= t < 0.1 for t in hw.call_overhead_s.values()) and hw.call_overhead_s["gather"] == hw.call_overhead_s["scatter"]
    assert hw.cores_per_node == len(os.sched_getaffinity(0))
    # A cp 2 layer's own work beyond what it is charged (its exchanges looped back), each part 0 where noise leaves
    # nothing: ~1 ms and ~0.5 ns a byte gathered here.
    work = hw.context_work
    assert work is not None and 0 <= work.layer_s < 0.1 and 0 <= work.per_byte_s < 1e-7
    # FSDP2's own work per unit beyond its collectives (a gather's copies: 2-7 ms on these CPU ranks run alone), each
    # a difference of steps: beside other tests on the same cores it may come out 0 (the fit: test_unit_overheads.py).
    assert set(hw.unit_overhead_s) == {"pass", "gather", "reduce", "all_reduce", "optimizer"}
    assert all(0 <= t < 0.1 for t in hw.unit_overhead_s.values())
    # A step's end (the gradients' norm and AdamW, an operator at a time) moves its counted bytes slower than a copy.
    assert hw.optimizer_bandwidth is not None and 0 < hw.optimizer_bandwidth < hw.memory_bandwidth
    # The same fit with the blocks compiled (inductor): its own terms, of the same order as eager's.
    compiled = hw.compiled
    assert compiled is not None and 0 <= compiled.layer_overhead_s < 1 and 0 <= compiled.microbatch_overhead_s < 1
    fixed = (hw.layer_overhead_s, hw.microbatch_overhead_s, compiled.layer_overhead_s, compiled.microbatch_overhead_s)
    assert any(t > 0 for t in fixed), fixed
    assert compiled.activation_bandwidth is None or 0 < compiled.activation_bandwidth < hw.memory_bandwidth
    bad = subprocess.run([sys.executable, "-m", "rewrite", "calibrate", "--world", "1", "--no-compile"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "at least 2" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "rewrite", "calibrate", "--repeats", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "at least 1 timing" in bad.stderr
