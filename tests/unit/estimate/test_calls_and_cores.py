"""CPU terms `rewrite calibrate` measures: what a tensor-parallel layer's collective costs beyond its time alone
(`call_overhead_s`, per call), the cores a node's ranks share (`cores_per_node`) and the rate of a step's end
(`optimizer_bandwidth`), in the step model, the search's lower bound, `plan --measure`'s correction and the profile
file."""

from __future__ import annotations

import re

import pytest
import yaml

import rewrite
from rewrite.estimate.correction import Scales, prediction_parts, scaled_profile
from rewrite.estimate.hardware import Hardware
from rewrite.estimate.stage_time import stage_times
from rewrite.estimate.step_time import core_sharing, predict_step, world_sync_s
from rewrite.run.calibrate import profile_yaml
from rewrite.run.calibrate_experts import exchange_overheads
from rewrite.run.calibrate_layers import call_overheads
from rewrite.tensor_parallel.comm import all_to_all, loopback, swap
from tests.unit.estimate.test_step_time import UNIT, _resolved, llama  # noqa: F401 (a fixture)

CALLS = {"sum": 0.01, "gather": 0.02, "scatter": 0.04}


def _with(**update) -> Hardware:
    return Hardware.model_validate({**UNIT.model_dump(), **update})


def test_each_tp_collective_costs_its_kinds_call_overhead(llama):
    """tiny-llama, 4 layers: a plain tp layer sums twice in F and twice in I; under sequence parallelism each block
    gathers and reduce-scatters in F and again in I (their mean each); W calls nothing."""
    for extra, calls in (({}, {"F": 8 * CALLS["sum"], "I": 8 * CALLS["sum"]}),
                         ({"sequence_parallel": True}, {"F": 16 * 0.03, "I": 16 * 0.03})):
        resolved = _resolved(llama, tp=2, **extra)
        (base,), (priced,) = (stage_times(resolved, llama, hw) for hw in (UNIT, _with(call_overhead_s=CALLS)))
        assert priced.forward - base.forward == pytest.approx(calls["F"])
        assert priced.input_backward - base.input_backward == pytest.approx(calls["I"])
        assert priced.weight_backward == base.weight_backward
        assert priced.tp_comm - base.tp_comm == pytest.approx(calls["F"] + calls["I"])
    # Checkpointed layers call again in their recomputed forward.
    full = _resolved(llama, tp=2, activation_checkpointing={"model.layers.*": "full"})
    (base,), (priced,) = (stage_times(full, llama, hw) for hw in (UNIT, _with(call_overhead_s=CALLS)))
    assert priced.input_backward - base.input_backward == pytest.approx(16 * CALLS["sum"])
    # No tp, or compiled blocks (torch's functional collectives: not measured): nothing added.
    for resolved in (_resolved(llama), _resolved(llama, tp=2, compile=True)):
        assert stage_times(resolved, llama, _with(call_overhead_s=CALLS)) == stage_times(resolved, llama, UNIT)


def test_cp_gathers_cost_a_gather_call_each(llama):
    """cp 2: each layer gathers its keys and values in F and reduce-scatters their gradients in I, a call each (the
    same exchanges as tp's); compiled blocks (torch's functional collectives) get none."""
    plan = {"mesh": {"dp": 1, "pp": 1, "tp": 1, "cp": 2}, "pipeline": {"microbatches": 1, "seq_len": 16}}
    resolved = rewrite.resolve(plan, llama)
    (base,), (priced,) = (stage_times(resolved, llama, hw) for hw in (UNIT, _with(call_overhead_s=CALLS)))
    assert priced.forward - base.forward == pytest.approx(4 * 2 * CALLS["gather"])
    assert priced.input_backward - base.input_backward == pytest.approx(4 * 2 * CALLS["gather"])
    assert priced.cp_comm - base.cp_comm == pytest.approx(2 * 4 * 2 * CALLS["gather"])
    assert priced.tp_comm == base.tp_comm == 0
    compiled = rewrite.resolve({**plan, "compile": True}, llama)
    assert stage_times(compiled, llama, _with(call_overhead_s=CALLS)) == stage_times(compiled, llama, UNIT)


def test_the_step_end_runs_at_the_optimizer_bandwidth(llama):
    """AdamW's counted traffic, 3 x 4 + 16 bytes per float32 element a rank trains, at `optimizer_bandwidth` where
    calibrate measured it (else memory_bandwidth); `plan --measure` rescales it with the compute."""
    elements = sum(p.numel() for p in llama.parameters())
    resolved = _resolved(llama)
    base, slow = (predict_step(resolved, llama, hw) for hw in (UNIT, _with(optimizer_bandwidth=1e9)))
    assert slow.optimizer_s == pytest.approx(elements * 28 / 1e9) and base.optimizer_s == pytest.approx(0, abs=1e-12)
    assert slow.step_s - base.step_s == pytest.approx(slow.optimizer_s)
    two = predict_step(_resolved(llama, pp=2, schedule="1f1b", m=2), llama, _with(optimizer_bandwidth=1e9))
    assert two.optimizer_s < slow.optimizer_s  # a stage's parameters only
    assert scaled_profile(_with(optimizer_bandwidth=1e9), Scales(2.0, 1.0, "fitted")).optimizer_bandwidth == 5e8
    assert scaled_profile(UNIT, Scales(2.0, 1.0, "fitted")).optimizer_bandwidth is None
    with pytest.raises(ValueError, match="optimizer_bandwidth"):
        _with(optimizer_bandwidth=0)


def test_the_worlds_all_reduces_are_priced_as_the_profile_measured_them(llama):
    """Three all-reduces of a few bytes over every rank end a step wherever the plan's work lies: the measured
    curve's smallest size where calibrate timed the world on one node, the ring on the link it spans otherwise;
    the search's lower bound counts them too."""
    measured = _with(collective_times={"all_reduce": {4: {4096: 0.002, 65536: 0.004}}})
    assert world_sync_s(measured, 4, 8) == pytest.approx(3 * 0.002)
    assert world_sync_s(measured, 2, 8) == pytest.approx(3 * 2 * 1e-3, rel=1e-3)  # not measured at 2: the ring
    assert world_sync_s(measured, 4, 2) == pytest.approx(3 * 6 * 1e-2, rel=1e-3)  # across nodes: the network's
    assert world_sync_s(measured, 1, 8) == 0.0
    for mesh in ({"tp": 4}, {"pp": 4}, {"dp": 2, "tp": 2}):
        resolved = _resolved(llama, **mesh, **({"schedule": "1f1b", "m": 4} if "pp" in mesh else {}))
        base, priced = (predict_step(resolved, llama, hw) for hw in (UNIT, measured))
        assert priced.sync_s == pytest.approx(0.006) and base.sync_s == pytest.approx(world_sync_s(UNIT, 4, 8))
    found = rewrite.suggest_plans(llama, world=4, device_memory=1.0, hardware=measured, seq_len=16, global_batch=8)
    assert all(c.step_s > 0.006 for c in found)


def test_the_call_overhead_is_communication_to_plan_measure(llama):
    hw = _with(call_overhead_s=CALLS)
    parts, base = prediction_parts(_resolved(llama, tp=2), llama, hw), prediction_parts(_resolved(llama, tp=2), llama, UNIT)
    assert parts.compute == pytest.approx(base.compute) and parts.communication > base.communication
    assert scaled_profile(hw, Scales(1.0, 3.0, "fitted")).call_overhead_s == pytest.approx({k: 3 * t for k, t in CALLS.items()})
    assert scaled_profile(hw, Scales(1.0, 3.0, "fitted"), links=("inter_node",)).call_overhead_s == CALLS


def test_bad_terms_are_refused_by_name():
    for update, words in (({"call_overhead_s": {"all_reduce": 0.1}}, "call_overhead_s.all_reduce"),
                          ({"call_overhead_s": {"sum": -1.0}}, "greater than or equal to 0"),
                          ({"cores_per_node": 0}, "cores_per_node")):
        with pytest.raises(ValueError, match=re.escape(words)):
            _with(**update)


def test_ranks_sharing_cores_are_told_their_share():
    """4 ranks measured together on 2 cores: each at half a core. A table's rows run at what they get while running
    (`simulate_shared`); every rank busy at once (AdamW) at min(1, cores / ranks)."""
    hw = _with(devices_per_node=4, cores_per_node=2)
    assert core_sharing(hw, 4, 4) == ((0.5, 2, 1.0), 1.0)  # a row a rank
    assert core_sharing(hw, 4, 2) == ((0.5, 2, 2.0), 1.0)  # two rows of two ranks (dp 2 x pp 2)
    assert core_sharing(hw, 2, 1) == ((0.5, 2, 2.0), 0.5)  # 2 ranks of the 4 measured: a core each
    assert core_sharing(_with(devices_per_node=2, cores_per_node=2), 2, 2) == ((1.0, 2, 1.0), 1.0)  # a core each
    assert core_sharing(UNIT, 8, 4) == (None, 1.0)  # devices of their own


def test_a_pipeline_on_shared_cores_runs_its_rows_at_their_share(llama):
    hw = _with(devices_per_node=4, cores_per_node=2)
    pipeline = _resolved(llama, pp=4, m=16, schedule="1f1b")
    alone, shared = predict_step(pipeline, llama, UNIT.model_copy(update={"devices_per_node": 4})), predict_step(
        pipeline, llama, hw)
    assert 0 < alone.bubble < 0.5 and 0 < shared.bubble < 1
    # Faster than as measured (every rank at half a core: a row waiting lends its core to the others), slower than
    # its work spread over the 2 cores at once (what a pipeline's fill and drain cannot do: 1, 2, then 3 rows running).
    assert alone.pipeline_s * (1 - alone.bubble) < shared.pipeline_s < alone.pipeline_s
    assert shared.step_s < alone.step_s
    replicas = _resolved(llama, dp=4, data_parallel={"sharding": "replicate"})  # no bubble: as measured
    assert predict_step(replicas, llama, hw).step_s == pytest.approx(predict_step(replicas, llama, UNIT).step_s)


def test_a_microbatch_past_the_fitted_sizes_computes_slower(llama):
    """4 sequences of 16 tokens a microbatch: 64 tokens a rank (32 under cp 2). Past `tokens`, the time per token
    grows linearly to `ratio` times the fitted at twice `tokens`, and holds beyond; at or below `tokens`, linear."""
    from rewrite.estimate.hardware import LargeMicrobatch

    large = LargeMicrobatch(tokens=32, ratio=2.0)
    assert [large.scale(t) for t in (16, 32, 48, 64, 128)] == [1.0, 1.0, 1.5, 2.0, 2.0]
    resolved = _resolved(llama, tp=2)
    base = stage_times(resolved, llama, UNIT, batch_size=4)[0]
    twice = stage_times(resolved, llama, _with(large_microbatch={"tokens": 32, "ratio": 2.0}), batch_size=4)[0]
    compute = lambda t: (t.forward - t.tp_comm / 2, t.input_backward - t.tp_comm / 2, t.weight_backward)  # noqa: E731
    assert twice.tp_comm == base.tp_comm and compute(twice) == pytest.approx([2 * x for x in compute(base)])
    assert stage_times(resolved, llama, _with(large_microbatch={"tokens": 64, "ratio": 2.0}), batch_size=4) == [base]
    context = rewrite.resolve({"mesh": {"cp": 2}, "pipeline": {"microbatches": 1, "seq_len": 16}}, llama)
    assert (stage_times(context, llama, _with(large_microbatch={"tokens": 32, "ratio": 2.0}), batch_size=4)
            == stage_times(context, llama, UNIT, batch_size=4))  # 32 tokens a rank
    for bad, words in (({"tokens": 0, "ratio": 1.0}, "tokens"), ({"tokens": 8, "ratio": 0.0}, "ratio")):
        with pytest.raises(ValueError, match=words):
            _with(large_microbatch=bad)


def test_the_search_bound_holds_on_shared_cores(llama):
    """The search refuses (as a bug) any prediction below its lower bound: sharing cores lowers both."""
    hw = _with(devices_per_node=4, cores_per_node=2, memory_gib=64)
    picks = rewrite.suggest_plans(llama, world=4, seq_len=16, global_batch=8, hardware=hw)
    assert picks and all(p.step_s > 0 for p in picks)


def test_calibrate_prices_the_calls_beyond_their_time_alone():
    hw = _with(collective_times={"sum": {2: {1024: 0.001, 4096: 0.002}}})
    times = {"sum": {"real": 1.0, "free": 0.5, "swaps": [1024] * 100},  # 0.5 s more made, 0.1 s of it alone
             "gather": {"real": 0.6, "free": 0.59, "swaps": [4096] * 10}}  # less than alone: none
    assert call_overheads(hw, times) == pytest.approx({"sum": 0.004, "gather": 0.0, "scatter": 0.0})
    assert call_overheads(hw, {}) == {}
    # The experts' all-to-alls (made against looped back beside the tp collectives), each priced as an all-to-all.
    hw = _with(collective_times={"all_to_all": {2: {1024: 0.001, 4096: 0.002}}, "sum": {2: {1024: 0.5, 4096: 0.5}}})
    times = {"all_to_all": {"real": 1.0, "free": 0.8, "swaps": [4096] * 50},
             "all_to_all_tp": {"real": 1.0, "free": 0.99, "swaps": [1024] * 50}}  # less than alone: none
    assert exchange_overheads(hw, times) == pytest.approx({"all_to_all": 0.002, "all_to_all_tp": 0.0})


def test_the_profile_file_carries_both_or_says_why_not():
    found = {"flops": {"float32": 5e10}, "memory_bandwidth": 2e10, "latency": 1e-4, "link": 2e9, "collective": 0.6,
             "memory_gib": 12.0, "world": 4, "measured": {"p2p": {4: 1e-4}, "all_reduce": {4: 2e-4}}}
    hw = Hardware.model_validate(yaml.safe_load(profile_yaml(found)))
    assert hw.call_overhead_s == {} and hw.cores_per_node is None
    found.update(call_overhead_s=CALLS, cores=2)
    hw = Hardware.model_validate(yaml.safe_load(profile_yaml(found)))
    assert hw.call_overhead_s == CALLS and hw.cores_per_node == 2


def test_loopback_moves_nothing_and_counts_the_bytes():
    import torch

    send, recv = torch.arange(6.0), torch.zeros(6)
    with loopback() as swaps:  # no process group needed: nothing is sent
        swap(send, recv, 1, None)
        swap(send[:2], recv[:2], 1, None)
    assert torch.equal(recv, send) and swaps == [24, 8]
    out = torch.zeros(6)
    with loopback() as made:  # the experts' all-to-alls too: each rank keeps what it sends
        all_to_all(out, send, None, [3, 3], [3, 3])
    assert torch.equal(out, send) and made == [24]
    recv.zero_()
    with loopback(swaps=False) as made, pytest.raises(ValueError):  # the all-to-alls alone: a swap is made
        all_to_all(out, send + 1, None)
        swap(send, recv, 1, None)
    assert made == [24] and torch.equal(out, send + 1) and not recv.any()
    with pytest.raises(ValueError):  # outside it, a swap needs its process group again
        swap(send, recv, 1, None)
