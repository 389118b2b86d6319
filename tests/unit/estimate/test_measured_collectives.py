"""Collectives priced from the profile's measured times (`collective_times`): read where measured, the ring
formulas elsewhere, in every term that charges them, rescaled by `plan --measure`, and written by calibrate."""

from __future__ import annotations

import re

import pytest
import yaml

from rewrite.estimate.collectives import all_gather_s, all_reduce_s, all_to_all_s, collective_s, measured_s
from rewrite.estimate.correction import Scales, prediction_parts, scaled_profile
from rewrite.estimate.dp_time import DpTime
from rewrite.estimate.hardware import Hardware, load_hardware
from rewrite.estimate.stage_time import stage_times
from rewrite.estimate.step_time import predict_step, stage_parameters
from rewrite.run.calibrate import profile_yaml
from rewrite.run.calibrate_links import _rising, collective_lines
from tests.unit.estimate.test_step_time import UNIT, _resolved, llama  # noqa: F401 (a fixture)

BLOCK = 16 * 64 * 4  # one tiny-LLaMA block's output at 16 tokens, float32
CURVE = {1024: 0.01, 8192: 0.02, 65536: 0.1}  # seconds far from the unit link's formula: which one is read shows


def _timed(**kinds) -> Hardware:
    return UNIT.model_copy(update={"collective_times": Hardware.model_validate(
        {**UNIT.model_dump(), "collective_times": kinds}).collective_times})


def test_a_curve_is_read_between_below_and_beyond_its_sizes():
    assert measured_s(CURVE, 8192) == 0.02 and measured_s(CURVE, 100) == 0.01  # below: the smallest's time
    assert measured_s(CURVE, 4608) == pytest.approx(0.015)  # halfway from 1 KiB to 8 KiB
    assert measured_s(CURVE, 2 * 65536) == pytest.approx(0.1 + 0.08 / (65536 - 8192) * 65536)  # the last slope on
    hw = _timed(sum={2: CURVE})
    assert collective_s(hw, "sum", 8192, 2, hw.intra_node) == 0.02
    # Another kind, another group size, a group across nodes, one rank or no bytes: the formula, or nothing.
    assert collective_s(hw, "all_reduce", 8192, 2, hw.intra_node) == all_reduce_s(8192, 2, UNIT.intra_node, 1.0)
    assert collective_s(hw, "sum", 8192, 4, hw.intra_node) == all_reduce_s(8192, 4, UNIT.intra_node, 1.0)
    assert collective_s(hw, "sum", 8192, 2, hw.inter_node) == all_reduce_s(8192, 2, UNIT.inter_node, 1.0)
    assert collective_s(hw, "sum", 8192, 1, hw.intra_node) == 0 == collective_s(hw, "sum", 0, 2, hw.intra_node)
    assert collective_s(UNIT, "all_to_all", 8192, 2, UNIT.intra_node) == all_to_all_s(8192, 2, UNIT.intra_node, 1.0)


def test_bad_tables_are_refused_by_name():
    for tables, words in (({"sum": {2: {1024: 0.01}}}, "sum.2 holds 1 size(s): give at least two"),
                          ({"broadcast": {2: CURVE}}, "collective_times.broadcast"),
                          ({"sum": {1: CURVE}}, "greater than or equal to 2"),
                          ({"sum": {2: {1024: -1.0, 2048: 0.1}}}, "greater than or equal to 0")):
        with pytest.raises(ValueError, match=re.escape(words)):
            Hardware.model_validate({**UNIT.model_dump(), "collective_times": tables})
    unsorted = _timed(gather={2: {65536: 0.1, 1024: 0.01, 8192: 0.02}})
    assert list(unsorted.collective_times["gather"][2]) == [1024, 8192, 65536]


def test_each_term_reads_the_kind_its_runtime_calls(llama):
    # tp: the layers' sums (plain), gathers and reduce-scatters (sequence parallel: their mean).
    (plain,) = stage_times(_resolved(llama, tp=2), llama, _timed(sum={2: CURVE}))
    assert plain.tp_comm == pytest.approx(4 * 4 * measured_s(CURVE, BLOCK))
    halves = {1024: 0.03, 8192: 0.04, 65536: 0.2}
    (sp,) = stage_times(_resolved(llama, tp=2, sequence_parallel=True), llama, _timed(gather={2: CURVE}, scatter={2: halves}))
    assert sp.tp_comm == pytest.approx(4 * 8 * (measured_s(CURVE, BLOCK) + measured_s(halves, BLOCK)) / 2)
    (mixed,) = stage_times(_resolved(llama, tp=2, sequence_parallel=True), llama, _timed(gather={2: CURVE}))
    assert mixed.tp_comm == pytest.approx(4 * 8 * (measured_s(CURVE, BLOCK) + all_gather_s(BLOCK, 2, UNIT.intra_node, 1.0)) / 2)
    # dp: FSDP2's all-gathers and reduce-scatters, DDP's and replicate's all-reduce, by unit.
    for sharding, kind in (("full", "all_gather"), ("grad_op", "reduce_scatter"), ("replicate", "all_reduce")):
        resolved = _resolved(llama, dp=2, data_parallel={"sharding": sharding})
        units = stage_parameters(resolved, llama)[0]
        timed = DpTime(resolved, units, _timed(**{kind: {2: CURVE}}), 8)
        plain = DpTime(resolved, units, UNIT, 8)
        if kind == "all_gather":
            assert timed.gather[0] == pytest.approx([measured_s(CURVE, b) for b in units[0].values()])
        else:
            assert timed._reduce(BLOCK, sharding) == measured_s(CURVE, BLOCK) != plain._reduce(BLOCK, sharding)
    # The step the planner ranks moves with them.
    resolved = _resolved(llama, tp=2)
    assert (predict_step(resolved, llama, _timed(sum={2: CURVE})).step_s
            > predict_step(resolved, llama, UNIT).step_s + 4 * 4 * 0.009)


def test_plan_measure_sets_the_tables_free_and_scales_them(llama):
    hw = _timed(sum={2: CURVE})
    parts = prediction_parts(_resolved(llama, tp=2), llama, hw)
    free = prediction_parts(_resolved(llama, tp=2), llama, UNIT)
    assert parts.compute == pytest.approx(free.compute)  # communication, measured or not, is not compute
    assert parts.communication > free.communication > 0
    slower = scaled_profile(hw, Scales(1.0, 3.0, "fitted"))
    assert slower.collective_times["sum"][2] == pytest.approx({b: 3 * t for b, t in CURVE.items()})
    assert scaled_profile(hw, Scales(1.0, 3.0, "fitted"), links=("inter_node",)).collective_times == hw.collective_times


def test_a_calibrated_profile_carries_its_collectives_and_keeps_them_rising():
    assert _rising({4: 3.0, 8: 1.0, 16: 2.0}) == {4: 1.0, 8: 1.0, 16: 2.0}  # a slow small message is noise
    found = {"flops": {"float32": 5e10}, "memory_bandwidth": 2e10, "latency": 1e-4, "link": 2e9, "collective": 0.6,
             "memory_gib": 12.0, "world": 4, "measured": {"p2p": {4: 1e-4}, "all_reduce": {4: 2e-4}},
             "collective_times": {"sum": {2: CURVE, 4: {1024: 0.02, 65536: 0.3}}, "all_gather": {4: CURVE}}}
    hw = Hardware.model_validate(yaml.safe_load(profile_yaml(found, name="here")))
    assert hw.collective_times == found["collective_times"] and hw.overlap == 1.0  # not measured: hidden
    found["overlap"] = 0.04
    assert Hardware.model_validate(yaml.safe_load(profile_yaml(found))).overlap == 0.04
    assert collective_lines({}).startswith("collective_times: {}")
    assert load_hardware("h100-sxm").collective_times == {}  # the shipped GPU profiles: the formulas


def test_collectives_beside_compute_hide_the_profiles_overlap_of_it(llama):
    """grad_op over dp 2, 4 microbatches reduced per microbatch: each backward lasts its compute and its
    units' reduce-scatters side by side, b + r - overlap * min(b, r), plus the smallest unit's reduce."""
    from rewrite.estimate.collectives import reduce_scatter_s

    for overlap in (1.0, 0.5, 0.0):
        hw = UNIT.model_copy(update={"overlap": overlap})
        resolved = _resolved(llama, dp=2, m=4, data_parallel={"sharding": "grad_op", "reduce": "microbatch"})
        (t,) = stage_times(resolved, llama, hw)
        units = stage_parameters(resolved, llama)[0]
        reduces = [reduce_scatter_s(b, 2, UNIT.intra_node, 1.0) for b in units[0].values()]
        r = sum(reduces)
        each = t.backward + r - overlap * min(t.backward, r) + min(reduces)
        assert predict_step(resolved, llama, hw).pipeline_s == pytest.approx(4 * t.forward + 4 * each)
        dpt = DpTime(resolved, units, hw, 8)
        assert dpt.exposed(float("inf"), 2.0) == pytest.approx(2.0 * (1 - overlap))  # the least it adds: finite
        assert dpt.beside(3.0, 2.0) == pytest.approx(5.0 - 2.0 * overlap)
    # Once a step, beside the last backward: nothing hidden on a CPU-like profile, all of it on a GPU's.
    step = _resolved(llama, dp=2, data_parallel={"sharding": "grad_op"})
    hidden, none = (predict_step(step, llama, UNIT.model_copy(update={"overlap": f})) for f in (1.0, 0.0))
    assert none.dp_s > hidden.dp_s and none.step_s > hidden.step_s
    with pytest.raises(ValueError, match="less than or equal to 1"):
        Hardware.model_validate({**UNIT.model_dump(), "overlap": 1.5})
