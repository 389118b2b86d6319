"""What a context-parallel layer computes beyond its FLOPs and exchanges (`context_work`: the gathered keys and
values reordered, the chunks merged, the gathered gradients filled and summed): charged per cp layer and
microbatch, a fixed part and a part per byte gathered, half in F and half in I, compiled or not; rescaled by
`plan --measure`; measured by `rewrite calibrate` against what the other terms charge; in the profile file."""

from __future__ import annotations

import pytest
import yaml

import rewrite
from rewrite.estimate.correction import Scales, scaled_profile
from rewrite.estimate.hardware import Hardware
from rewrite.estimate.memory import with_run
from rewrite.estimate.stage_time import stage_times
from rewrite.run.calibrate import profile_yaml
from rewrite.run.calibrate_cp import context_work
from rewrite.run.calibrate_layers import with_layers
from rewrite.run.presets import build_model, load_config
from tests.unit.estimate.test_step_time import TP_RULES, UNIT, llama  # noqa: F401 (a fixture)

WORK = {"layer_s": 0.5, "per_byte_s": 1e-6}  # far above the unit profile's compute, so a share shows


def _with(**update) -> Hardware:
    return Hardware.model_validate({**UNIT.model_dump(), **update})


def _cp(model, cp=2, tp=1, **extra):
    plan = {"mesh": {"cp": cp, "tp": tp}, "tensor_parallel": TP_RULES if tp > 1 else {},
            "pipeline": {"schedule": "afab", "microbatches": 1, "seq_len": 16}, **extra}
    return rewrite.resolve(plan, model)


def test_each_cp_layer_pays_its_work_half_in_the_forward_half_in_the_input_backward(llama):
    paid_hw = _with(context_work=WORK)
    # tiny-llama: 4 layers, 4 kv heads of 8; the whole sequence's k and v, float32: 2 x 16 x 4 x 8 x 4 bytes.
    for plan, batch, kv in ((_cp(llama), 1, 4096), (_cp(llama), 2, 8192), (_cp(llama, cp=4), 1, 4096),
                            (_cp(llama, tp=2), 1, 2048)):  # tp 2 beside: each rank gathers its half of the heads
        base, paid = (stage_times(plan, llama, hw, batch_size=batch)[0] for hw in (UNIT, paid_hw))
        half = 4 * (0.5 + 1e-6 * kv) / 2
        assert paid.forward - base.forward == pytest.approx(half), (plan.plan.mesh, batch)
        assert paid.input_backward - base.input_backward == pytest.approx(half)
        assert (paid.weight_backward, paid.cp_comm, paid.tp_comm) == (base.weight_backward, base.cp_comm, base.tp_comm)
    # Without cp there is none to pay.
    assert stage_times(_cp(llama, cp=1), llama, paid_hw) == stage_times(_cp(llama, cp=1), llama, UNIT)
    # A checkpointed layer runs its forward again in the backward: its half once more.
    full = _cp(llama, activation_checkpointing={"model.layers.*": "full"})
    base, paid = (stage_times(full, llama, hw)[0] for hw in (UNIT, paid_hw))
    assert paid.input_backward - base.input_backward == pytest.approx(2 * 4 * (0.5 + 1e-6 * 4096) / 2)


def test_compiled_steps_pay_it_too_and_measurement_rescales_it(llama):
    hw = _with(context_work=WORK, compiled={"layer_overhead_s": 0.0, "microbatch_overhead_s": 0.0})
    assert hw.stepping(True).context_work == hw.context_work  # not measured compiled: charged alike
    compiled = _cp(llama, compile=True)
    assert stage_times(compiled, llama, hw)[0].forward > stage_times(compiled, llama, _with(compiled=hw.compiled))[0].forward
    slower = scaled_profile(hw, Scales(compute=2.0, communication=1.0, how="by hand")).context_work
    assert (slower.layer_s, slower.per_byte_s) == (1.0, 2e-6)
    assert scaled_profile(UNIT, Scales(compute=2.0, communication=1.0, how="by hand")).context_work is None
    with pytest.raises(ValueError, match="context_work.layer_s"):
        _with(context_work={"layer_s": -1e-3, "per_byte_s": 0.0})
    with pytest.raises(ValueError, match="context_work"):
        _with(context_work={"layer_s": 1e-3})  # both parts, or none


def _charged(config, rows: int) -> float:
    """What the unit profile charges a cp 2 layer beyond a plain one on rows x 128 tokens a rank, no exchanges."""
    model = build_model(config, device="meta")
    one = stage_times(with_run(rewrite.resolve({}, model), seq_len=128), model, UNIT, batch_size=rows)[0]
    two = stage_times(with_run(rewrite.resolve({"mesh": {"cp": 2}}, model), seq_len=128), model, UNIT,
                      batch_size=2 * rows)[0]
    return (two.forward + two.backward - two.cp_comm - one.forward - one.backward) / config.num_hidden_layers


def test_calibrate_keeps_what_the_other_terms_do_not_charge_as_a_line_in_the_bytes():
    config = with_layers(load_config("tiny-llama"), 3)
    charged = {rows: _charged(config, rows) for rows in (1, 8)}
    assert charged[8] > charged[1] > 0  # cp's causal blocks compute more score pairs than one causal sequence
    kv = {rows: 2 * 2 * rows * 128 * 4 * 8 * 4 for rows in (1, 8)}  # bytes gathered: 2 x (2 rows) s g d B
    work = context_work(UNIT, config, {rows: charged[rows] + 2e-3 + 1e-9 * kv[rows] for rows in (1, 8)})
    assert work == pytest.approx({"layer_s": 2e-3, "per_byte_s": 1e-9})
    # Its own term is not counted as charged: measuring on a profile that already holds one gives the same.
    again = context_work(_with(context_work=WORK), config, {rows: charged[rows] + 2e-3 + 1e-9 * kv[rows] for rows in (1, 8)})
    assert again == pytest.approx(work)
    # The larger size cheaper (noise): the mean, nothing per byte; a negative fixed part: a line through 0.
    assert context_work(UNIT, config, {1: charged[1] + 3e-3, 8: charged[8] + 1e-3}) == pytest.approx(
        {"layer_s": 2e-3, "per_byte_s": 0.0})
    through = context_work(UNIT, config, {rows: charged[rows] - 1e-3 + 1e-8 * kv[rows] for rows in (1, 8)})
    assert through["layer_s"] == 0 and 0 < through["per_byte_s"] < 1e-8
    assert context_work(UNIT, config, {1: charged[1] - 1.0, 8: charged[8] - 1.0}) == {"layer_s": 0.0, "per_byte_s": 0.0}
    assert context_work(UNIT, config, {1: 1e-3}) is None  # one size: no line


def test_the_profile_file_says_whether_it_was_measured():
    found = {"flops": {"float32": 5e10}, "memory_bandwidth": 2e10, "latency": 1e-4, "link": 2e9, "collective": 0.6,
             "memory_gib": 12.0, "world": 2, "measured": {"p2p": {4: 1e-4}, "all_reduce": {4: 2e-4}}}
    text = profile_yaml(found)
    assert "context_work: null" in text and "cp's own work is not charged" in text
    assert Hardware.model_validate(yaml.safe_load(text)).context_work is None
    text = profile_yaml({**found, "context_work": {"layer_s": 0.000812345, "per_byte_s": 4.56789e-10}})
    assert "under cp 2, its exchanges looped back" in text and "128 and 1024 tokens" in text
    work = Hardware.model_validate(yaml.safe_load(text)).context_work
    assert (work.layer_s, work.per_byte_s) == (0.000812, 4.57e-10)
