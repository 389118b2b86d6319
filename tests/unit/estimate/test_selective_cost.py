"""What selective checkpointing costs beyond the work its recompute repeats (`selective_overhead_s`: torch's policy
on each operator): charged in each selectively checkpointed layer's input backward, per microbatch, half for a
block alone, none for full or no checkpointing nor compiled blocks; rescaled by `plan --measure`; measured by
`rewrite calibrate` against what the other terms charge; written to and read from the profile file."""

from __future__ import annotations

import pytest
import yaml

from rewrite.estimate.correction import Scales, scaled_profile
from rewrite.estimate.hardware import Hardware
from rewrite.estimate.stage_time import stage_times
from rewrite.estimate.step_time import predict_step
from rewrite.run.calibrate import profile_yaml
from rewrite.run.calibrate_layers import with_layers
from rewrite.run.calibrate_selective import selective_overhead
from rewrite.run.presets import load_config
from tests.unit.estimate.test_step_time import UNIT, _resolved, llama  # noqa: F401 (a fixture)

POLICY = 0.25  # seconds a selective layer's policy costs a microbatch: far above the unit profile's compute


def _with(**update) -> Hardware:
    return Hardware.model_validate({**UNIT.model_dump(), **update})


def _checkpointed(llama, rules, **kw):
    return _resolved(llama, activation_checkpointing=rules, **kw)


def test_each_selective_layer_pays_the_policy_in_its_input_backward(llama):
    charged = _with(selective_overhead_s=POLICY)
    for rules, per_layer in (({"model.layers.*": "selective"}, POLICY),
                             ({"model.layers.*.self_attn": "selective"}, POLICY / 2),
                             ({"model.layers.*.mlp": "selective", "model.layers.*.self_attn": "selective"}, POLICY),
                             ({"model.layers.1": "selective"}, POLICY / 4)):  # one layer of 4, as a share of each
        resolved = _checkpointed(llama, rules)
        base, paid = stage_times(resolved, llama, UNIT, batch_size=2)[0], stage_times(resolved, llama, charged, batch_size=2)[0]
        assert (paid.forward, paid.weight_backward, paid.tp_comm) == (base.forward, base.weight_backward, base.tp_comm)
        assert paid.input_backward - base.input_backward == pytest.approx(4 * per_layer), rules
    for rules in ({}, {"model.layers.*": "full"}):  # no policy runs
        resolved = _checkpointed(llama, rules)
        assert stage_times(resolved, llama, charged) == stage_times(resolved, llama, UNIT)
    # Per microbatch: a 2-stage AFAB pipeline of 4 microbatches, 2 layers a stage (2 x POLICY more each backward),
    # the policy on its critical path in the last stage's 4 backwards and the first stage's last.
    piped = _checkpointed(llama, {"model.layers.*": "selective"}, pp=2, m=4)
    gap = predict_step(piped, llama, charged).pipeline_s - predict_step(piped, llama, UNIT).pipeline_s
    assert gap == pytest.approx((4 + 1) * 2 * POLICY, rel=0.01)


def test_compiled_blocks_pay_no_policy_and_measurement_rescales_it(llama):
    compiled = {"layer_overhead_s": 0.0, "microbatch_overhead_s": 0.0}
    hw = _with(selective_overhead_s=POLICY, compiled=compiled)
    assert hw.stepping(True).selective_overhead_s == 0.0 and hw.stepping(False).selective_overhead_s == POLICY
    assert _with(selective_overhead_s=POLICY).stepping(True).selective_overhead_s == POLICY  # compiled not measured
    resolved = _checkpointed(llama, {"model.layers.*": "selective"}, compile=True)
    assert stage_times(resolved, llama, hw) == stage_times(resolved, llama, _with(compiled=compiled))
    assert scaled_profile(hw, Scales(compute=2.0, communication=1.0, how="by hand")).selective_overhead_s == 2 * POLICY
    with pytest.raises(ValueError, match="selective_overhead_s"):
        _with(selective_overhead_s=-1e-3)


def test_calibrate_keeps_what_the_recompute_does_not_explain():
    """The measured extra per layer less what the profile's other terms charge a selective layer on one sequence
    of 128 tokens (the unit profile: 1 GFLOP/s, so its recompute alone is ~0.1 s a layer); never below 0."""
    config = with_layers(load_config("tiny-llama"), 3)
    charged = selective_overhead(UNIT, config, 0.0)
    assert charged == 0.0  # nothing measured: none left
    recompute = selective_overhead(UNIT, config, 10.0)
    assert 0 < 10.0 - recompute < 1.0  # the recompute's share of 10 s
    assert selective_overhead(UNIT, config, 10.0 + POLICY) == pytest.approx(recompute + POLICY)
    # Its own term is not counted as recompute: measuring on a profile that already holds one gives the same.
    assert selective_overhead(_with(selective_overhead_s=1.0), config, 10.0) == pytest.approx(recompute)


def test_the_profile_file_says_whether_it_was_measured():
    found = {"flops": {"float32": 5e10}, "memory_bandwidth": 2e10, "latency": 1e-4, "link": 2e9, "collective": 0.6,
             "memory_gib": 12.0, "world": 2, "measured": {"p2p": {4: 1e-4}, "all_reduce": {4: 2e-4}}}
    text = profile_yaml(found)
    assert "selective_overhead_s: 0.0" in text and "not measured (its layers are not estimated" in text
    assert Hardware.model_validate(yaml.safe_load(text)).selective_overhead_s == 0.0
    assert "not measured on a GPU" in profile_yaml({**found, "gpu": True})
    text = profile_yaml({**found, "selective_overhead_s": 0.004321})
    assert "checkpointed 'selective' against not" in text
    assert Hardware.model_validate(yaml.safe_load(text)).selective_overhead_s == 0.00432
