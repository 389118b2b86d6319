"""FSDP2's own work per data-parallel unit (`Hardware.unit_overhead_s`: its hooks on each pass, the copies around
each gather, reduce-scatter and its replicate's all-reduce, AdamW through DTensor per parameter) in the step model, counted by hand on the tiny LLaMA (4 layers: 5 units, the
root's among them), in `plan --measure`'s correction, in the profile file, and as `rewrite calibrate` fits it."""

from __future__ import annotations

import re

import pytest
import yaml

import rewrite
from rewrite.estimate.collectives import collective_s
from rewrite.estimate.correction import Scales, prediction_parts, scaled_profile
from rewrite.estimate.hardware import Hardware
from rewrite.estimate.step_time import predict_step
from rewrite.run.calibrate import profile_yaml
from rewrite.run.calibrate_units import UNIT_MICROBATCHES, unit_overheads
from tests.unit.estimate.test_step_time import UNIT, _resolved, llama  # noqa: F401 (a fixture)

UNITS, LAYERS, M, PARAMETERS = 5, 4, 4, 39


def _with(**calls) -> Hardware:
    return Hardware.model_validate({**UNIT.model_dump(), "unit_overhead_s": calls})


def _added(resolved, model, **calls) -> float:
    """What the terms `calls` add to the predicted step."""
    return predict_step(resolved, model, _with(**calls)).step_s - predict_step(resolved, model, UNIT).step_s


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_each_unit_is_charged_by_hand(llama, schedule):
    """dp 2, 4 microbatches on one stage: the step is the sum of its actions and its end, so each term adds its
    count exactly, beside nothing (UNIT's overlap hides every collective beside compute, none of these)."""
    def plan(sharding, reduce="step"):
        return _resolved(llama, dp=2, m=M, schedule=schedule, data_parallel={"sharding": sharding, "reduce": reduce})

    full, grad_op, replicate = plan("full"), plan("grad_op"), plan("replicate")
    # full gathers every unit in each forward and the layers again in each backward; grad_op once a step
    assert _added(full, llama, gather=0.01) == pytest.approx(M * (UNITS + LAYERS) * 0.01)
    assert _added(grad_op, llama, gather=0.01) == pytest.approx(UNITS * 0.01)
    # the hooks run on every pass through a sharded unit, gathering or not
    for sharded in (full, grad_op):
        assert _added(sharded, llama, **{"pass": 0.01}) == pytest.approx(M * UNITS * 0.01)
        assert _added(sharded, llama, reduce=0.01) == pytest.approx(UNITS * 0.01)  # one reduce-scatter a unit a step
    assert _added(plan("full", "microbatch"), llama, reduce=0.01) == pytest.approx(M * UNITS * 0.01)  # each backward's
    # AdamW through DTensor: per parameter FSDP2 holds (4 layers of 9, the embedding, the final norm, the head)
    for sharded in (full, grad_op):
        assert _added(sharded, llama, optimizer=0.01) == pytest.approx(PARAMETERS * 0.01)
        assert _added(sharded, llama, all_reduce=0.01) == 0  # its replicate's term, not a reduce-scatter's
    # DDP and one rank: none of FSDP2's work
    for none in (replicate, _resolved(llama, m=M, schedule=schedule)):
        assert _added(none, llama, **{"pass": 0.01}, gather=0.01, reduce=0.01, all_reduce=0.01, optimizer=0.01) == 0


def test_fsdp2s_replicate_is_charged_where_ddp_does_not_fit(llama):
    """Two stages on the rank (interleaved, whole backwards): `replicate` runs on FSDP2's, not DDP; its hooks on
    every pass of each stage's units (3 and 3: the root on both), each unit's all-reduce, AdamW per parameter
    through DTensor; no gather, no reduce-scatter's term."""
    fsdp = rewrite.resolve({"mesh": {"dp": 2}, "data_parallel": {"sharding": "replicate"},
                            "pipeline": {"schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": M,
                                         "seq_len": 16}}, llama)
    assert _added(fsdp, llama, **{"pass": 0.01}) == pytest.approx(M * 6 * 0.01)
    assert _added(fsdp, llama, all_reduce=0.01) == pytest.approx(6 * 0.01)
    assert _added(fsdp, llama, optimizer=0.01) == pytest.approx(PARAMETERS * 0.01)
    assert _added(fsdp, llama, gather=0.01, reduce=0.01) == 0
    # Split backwards (zero bubble, one stage a rank): FSDP2's too, its 5 units reduced at the step's end.
    split = _resolved(llama, dp=2, m=M, schedule="zero-bubble", data_parallel={"sharding": "replicate"})
    assert _added(split, llama, all_reduce=0.01) == pytest.approx(UNITS * 0.01)


def test_a_split_backward_gathers_once_and_the_search_bound_holds(llama):
    """Under zero bubble `full` keeps its units gathered through the step: one gather a unit, as grad_op. The
    search refuses (as a bug) any prediction below its lower bound: the terms raise both."""
    calls = {"pass": 0.001, "gather": 0.002, "reduce": 0.003}
    split = _resolved(llama, dp=2, pp=2, m=4, schedule="zero-bubble", data_parallel={"sharding": "full"})
    whole = _resolved(llama, dp=2, pp=2, m=4, schedule="1f1b", data_parallel={"sharding": "full"})
    assert 0 < _added(split, llama, gather=0.01) <= UNITS * 0.01 + 1e-12 < _added(whole, llama, gather=0.01)
    picks = rewrite.suggest_plans(llama, world=4, seq_len=16, global_batch=8,
                                  hardware=_with(**calls).model_copy(update={"memory_gib": 64}))
    assert picks and all(p.step_s > 0 for p in picks)


def test_the_terms_are_communication_to_plan_measure(llama):
    calls = {"pass": 0.001, "gather": 0.002, "reduce": 0.003}
    resolved = _resolved(llama, dp=2, m=M, data_parallel={"sharding": "full"})
    parts, base = prediction_parts(resolved, llama, _with(**calls)), prediction_parts(resolved, llama, UNIT)
    assert parts.compute == pytest.approx(base.compute) and parts.communication > base.communication
    assert scaled_profile(_with(**calls), Scales(1.0, 2.0, "fitted")).unit_overhead_s == pytest.approx(
        {k: 2 * t for k, t in calls.items()})
    assert scaled_profile(_with(**calls), Scales(1.0, 2.0, "fitted"), links=("inter_node",)).unit_overhead_s == calls


def test_bad_terms_are_refused_by_name():
    for calls, words in (({"all_gather": 0.1}, "unit_overhead_s.all_gather"), ({"pass": -1.0}, "greater than or equal")):
        with pytest.raises(ValueError, match=re.escape(words)):
            _with(**calls)


def test_the_profile_file_carries_them_or_says_why_not():
    found = {"flops": {"float32": 5e10}, "memory_bandwidth": 2e10, "latency": 1e-4, "link": 2e9, "collective": 0.6,
             "memory_gib": 12.0, "world": 2, "measured": {"p2p": {4: 1e-4}, "all_reduce": {4: 2e-4}}}
    text = profile_yaml(found)
    assert "unit_overhead_s: {}" in text and "not measured here" in text
    assert Hardware.model_validate(yaml.safe_load(text)).unit_overhead_s == {}
    found["unit_overhead_s"] = {"pass": 0.001, "gather": 0.0025, "reduce": 0.0}
    assert Hardware.model_validate(yaml.safe_load(profile_yaml(found))).unit_overhead_s == found["unit_overhead_s"]


def test_calibrate_recovers_the_terms_it_was_timed_with():
    """Times made up from known terms on the profile's own collective prices (and a compute part any step
    shares): the fit gives the terms back; times that leave nothing give 0, never less."""
    world, units, link = 2, [3e6] * LAYERS + [8e6], UNIT.intra_node
    ag, rs = ([collective_s(UNIT, kind, b, world, link) for b in units] for kind in ("all_gather", "reduce_scatter"))
    ar = collective_s(UNIT, "all_reduce", sum(units), world, link)
    ars = [collective_s(UNIT, "all_reduce", b, world, link) for b in units]
    p, g, r, a, o, compute, end = 0.001, 0.003, 0.0005, 0.002, 0.0002, 0.02, 0.03

    def times(unit_pass, gather, reduce, all_reduce, optimizer):
        out = {}
        for m in UNIT_MICROBATCHES:
            once = sum(ag) + len(units) * gather + sum(rs) + len(units) * reduce
            out[f"replicate {m}"] = compute * m + ar
            out[f"grad_op {m}"] = compute * m + len(units) * unit_pass * m + once
            out[f"full {m}"] = out[f"grad_op {m}"] + m * (sum(ag) + sum(ag[:-1]) + (2 * len(units) - 1) * gather) \
                - sum(ag) - len(units) * gather
            out[f"fsdp_replicate {m}"] = compute * m + len(units) * unit_pass * m + sum(ars) + len(units) * all_reduce
        ends = {"replicate": end, "fsdp_replicate": end + PARAMETERS * optimizer}
        return {"times": out, "ends": ends, "units": units, "parameters": PARAMETERS}

    terms = {"pass": p, "gather": g, "reduce": r, "all_reduce": a, "optimizer": o}
    assert unit_overheads(UNIT, times(p, g, r, a, o), world) == pytest.approx(terms)
    assert unit_overheads(UNIT, times(-p, -g, -r, -a, -o), world) == dict.fromkeys(terms, 0.0)
    older = times(p, g, r, a, o)  # a calibration from before FSDP2's replicate was timed: the first three
    older["times"] = {k: t for k, t in older["times"].items() if not k.startswith("fsdp_")}
    assert unit_overheads(UNIT, older, world) == pytest.approx({"pass": p, "gather": g, "reduce": r})
