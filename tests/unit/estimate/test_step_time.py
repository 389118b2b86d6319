"""The step-time model on hand-computed cases, and `rewrite show --hardware`."""

from __future__ import annotations

import json

import pytest

import rewrite
from rewrite.estimate.collectives import all_gather_s, all_reduce_s, p2p_s
from rewrite.estimate.hardware import Efficiency, Hardware, Link
from rewrite.estimate.stage_time import stage_times, unsplit_stages
from rewrite.estimate.step_time import model_flops, predict_step
from rewrite.models.flops import layer_flop_parts, layer_flops
from rewrite.run.presets import build_model
from rewrite.run.show.data import show_data
from rewrite.run.show.report import render_text
from rewrite.schedules import build_table, bubble, simulate
from tests.paths import PLANS
from tests.unit.run.test_cli import rewrite_cmd

TP_RULES = dict(rewrite.load_plan(PLANS / "llama-tp2.yaml").tensor_parallel)
# A device whose memory traffic costs nothing: times are FLOPs / 1e9 and the collectives' formula.
UNIT = Hardware(
    name="unit", memory_gib=1, peak_flops={"float32": 1e9}, memory_bandwidth=1e30, devices_per_node=8,
    intra_node=Link(bandwidth=1e9, latency=1e-3), inter_node=Link(bandwidth=1e8, latency=1e-2),
    efficiency=Efficiency(matmul=1.0, collective=1.0),
)


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", device="meta")  # h 64, 8 / 4 heads of 8, i 128, V 256, 4 layers


def _resolved(llama, *, pp=1, tp=1, dp=1, schedule="afab", m=1, seq_len=16, **extra):
    plan = {"mesh": {"dp": dp, "pp": pp, "tp": tp}, "tensor_parallel": TP_RULES if tp > 1 else {},
            "pipeline": {"schedule": schedule, "microbatches": m, "seq_len": seq_len}, **extra}
    return rewrite.resolve(plan, llama)


def test_one_layer_flops_by_hand(llama):
    parts = layer_flop_parts(llama.config, seq_len=16)
    assert parts == {
        "q_o": 2 * 16 * 64 * 8 * (2 * 8),  # 2 s h d (2 a)
        "k_v": 2 * 16 * 64 * 8 * (2 * 4),  # 2 s h d (2 kv)
        "scores": 4 * 16 * 16 * 8 * 8,  # 4 s s a d
        "mlp": 6 * 16 * 64 * 128,  # 6 s h i
        "norms": 2 * 4 * 16 * 64,
    }
    assert layer_flops(llama.config, seq_len=16) == 1253376 == sum(parts.values())


def test_stage_times_are_flops_at_the_peak(llama):
    (t,) = stage_times(_resolved(llama), llama, UNIT)
    layer_f, layer_i, layer_w = 1253376, 1253376 + 65536 + 8192, 262144 + 131072 + 786432
    head = 2 * 16 * 64 * 256  # the LM head's product; the loss 5 s V; the final norm 4 s h
    assert t.forward == pytest.approx((4 * layer_f + head + 5 * 16 * 256 + 4 * 16 * 64) / 1e9)
    assert t.input_backward == pytest.approx((4 * layer_i + head + 5 * 16 * 256 + 2 * 4 * 16 * 64) / 1e9)
    assert t.weight_backward == pytest.approx((4 * layer_w + head) / 1e9)
    assert t.tp_comm == 0
    assert t.flops == pytest.approx(3 * 4 * layer_f + 3 * head + 2 * 5 * 16 * 256 + 3 * 4 * 16 * 64)
    # Recompute adds each checkpointed layer's forward to its input backward, which then runs the whole backward
    # (the runner does not split a backward that recomputes: W is empty).
    (ckpt,) = stage_times(_resolved(llama, activation_checkpointing={"model.layers.*": "full"}), llama, UNIT)
    assert ckpt.input_backward - t.input_backward == pytest.approx(4 * layer_f / 1e9 + t.weight_backward)
    assert ckpt.weight_backward == 0 and ckpt.backward - t.backward == pytest.approx(4 * layer_f / 1e9)


def test_a_rank_that_recomputes_runs_its_backward_whole_in_i(llama):
    """Split schedules: a pp rank holding a checkpointed module does not split its backward (the runner's rule:
    a split backward would recompute once per weight group), so its stages' W is empty and I carries it."""
    zbv = {"schedule": "zbv", "virtual_stages": 2}
    plain = stage_times(_resolved(llama, pp=2, pipeline={**zbv, "microbatches": 4}), llama, UNIT)
    for rules, whole in (({}, set()), ({"model.layers.*": "full"}, {0, 1, 2, 3}),
                         ({"model.layers.0": "full"}, {0, 3}),  # stage 0 is rank 0's, as is stage 3 (zbv's V)
                         ({"model.layers.3.mlp": "selective"}, {0, 3}), ({"model.layers.1": "full"}, {1, 2})):
        resolved = _resolved(llama, pp=2, activation_checkpointing=rules, pipeline={**zbv, "microbatches": 4})
        assert unsplit_stages(resolved) == whole, rules
        for s, t in enumerate(stage_times(resolved, llama, UNIT)):
            assert (t.weight_backward == 0) == (s in whole), (rules, s)
            assert t.backward >= plain[s].backward - 1e-12  # nothing lost: moved, recompute added


def test_a_layer_overhead_costs_each_layer_a_third_in_each_of_f_i_w(llama):
    (t,) = stage_times(_resolved(llama), llama, UNIT)
    slow = UNIT.model_copy(update={"layer_overhead_s": 0.003})
    (o,) = stage_times(_resolved(llama), llama, slow)
    for part in ("forward", "input_backward", "weight_backward"):
        assert getattr(o, part) - getattr(t, part) == pytest.approx(4 * 0.001)  # 4 layers, a third each
    assert o.flops == t.flops  # FLOPs (and so MFU's numerator) do not change
    # A checkpointed layer dispatches its forward again in the backward, which its I runs whole (W's third too).
    ckpt = _resolved(llama, activation_checkpointing={"model.layers.*": "full"})
    (c,), (co,) = stage_times(ckpt, llama, UNIT), stage_times(ckpt, llama, slow)
    assert co.input_backward - c.input_backward == pytest.approx(4 * 0.003) and co.weight_backward == 0
    # Eight microbatches of one sequence pay it eight times; one of eight sequences once.
    many = predict_step(_resolved(llama, m=8), llama, slow).step_s - predict_step(_resolved(llama, m=8), llama, UNIT).step_s
    one = predict_step(_resolved(llama, m=1), llama, slow, batch_size=8).step_s
    assert many == pytest.approx(8 * 4 * 0.003)
    assert one - predict_step(_resolved(llama, m=1), llama, UNIT, batch_size=8).step_s == pytest.approx(4 * 0.003)


def test_activations_move_at_their_own_bandwidth_and_a_microbatch_costs_its_calls(llama):
    from rewrite.estimate.activations import plan_sizes
    from rewrite.estimate.head_activations import end_bytes
    from rewrite.estimate.layer_activations import layer_bytes

    resolved = _resolved(llama)
    (t,) = stage_times(resolved, llama, UNIT)
    slow = UNIT.model_copy(update={"activation_bandwidth": 1e9})  # activations at 1 GB/s, weights still free
    (a,) = stage_times(resolved, llama, slow)
    z = plan_sizes(resolved, llama)
    kept = [layer_bytes(z, attention_split=False, mlp_split=False, first=i == 0)[0] for i in range(4)]
    embed, end = z.tokens * z.dtype_bytes * z.hidden, end_bytes(z, has_head=True, loss_parallel=False)
    # Each layer writes what it keeps in F (2x: written, read back) and reads it in I (3x); the embedding's
    # output twice each way; the head's kept bytes twice in F and in I.
    assert a.forward - t.forward == pytest.approx((2 * sum(kept) + 2 * embed + 2 * end) / 1e9)
    assert a.input_backward - t.input_backward == pytest.approx((3 * sum(kept) + 2 * end) / 1e9)
    assert a.weight_backward - t.weight_backward == pytest.approx(2 * embed / 1e9)
    called = UNIT.model_copy(update={"microbatch_overhead_s": 0.004})
    (c,) = stage_times(resolved, llama, called)
    assert (c.forward - t.forward, c.input_backward - t.input_backward) == pytest.approx((0.002, 0.002))
    assert c.weight_backward == t.weight_backward and c.flops == t.flops
    # Paid by every stage, on every microbatch: 8 microbatches over 2 stages cost 8 x 4 ms more in all,
    # the pipeline's fill and drain adding one stage's share.
    two = _resolved(llama, pp=2, m=8)
    extra = predict_step(two, llama, called).step_s - predict_step(two, llama, UNIT).step_s
    assert extra == pytest.approx((8 + 1) * 0.004)


def test_one_all_reduce_and_the_tp_collectives_of_a_layer(llama):
    link = Link(bandwidth=1e9, latency=1e-3)
    assert all_reduce_s(1e9, 4, link, 0.5) == pytest.approx(2 * 3 * 1e-3 + 2 * 3 / 4 * 1e9 / 0.5e9)
    assert all_gather_s(1e9, 4, link, 1.0) == pytest.approx(3 * 1e-3 + 3 / 4)
    assert p2p_s(1e6, link, 1.0) == pytest.approx(1e-3 + 1e-3) and all_reduce_s(1e9, 1, link, 1.0) == 0
    block = 16 * 64 * 4  # T h B: one block's output, float32
    (plain,) = stage_times(_resolved(llama, tp=2), llama, UNIT)
    # Per layer: a row all-reduce after attention and after the MLP, a column one before each in backward.
    assert plain.tp_comm == pytest.approx(4 * 4 * all_reduce_s(block, 2, UNIT.intra_node, 1.0))
    (sp,) = stage_times(_resolved(llama, tp=2, sequence_parallel=True), llama, UNIT)
    assert sp.tp_comm == pytest.approx(4 * 8 * all_gather_s(block, 2, UNIT.intra_node, 1.0))
    # A tp group split over two nodes talks over the network.
    (far,) = stage_times(_resolved(llama, tp=2), llama, UNIT, gpus_per_node=1)
    assert far.tp_comm == pytest.approx(4 * 4 * all_reduce_s(block, 2, UNIT.inter_node, 1.0))


def test_a_1f1b_table_with_equal_forward_and_backward_idles_pp_minus_1_of_m_plus_pp_minus_1():
    for pp, m in ((2, 4), (4, 8), (4, 1)):
        table = build_table("1f1b", pp, m)
        times, stuck = simulate(table, cost={"F": 1.0, "B": 1.0})
        assert not stuck and max(e for _, e in times.values()) == 2 * (m + pp - 1)
        assert bubble(table, times) == pytest.approx((pp - 1) / (m + pp - 1))
    times, _ = simulate(build_table("1f1b", 2, 1), cost={"F": 1.0, "B": 1.0}, delay=lambda need, action: 0.5)
    assert max(e for _, e in times.values()) == 4 + 2 * 0.5  # one hop forward, one back


def test_predict_step_adds_up(llama):
    got = predict_step(_resolved(llama, pp=2, schedule="1f1b", m=4), llama, UNIT, batch_size=2)
    tokens = 4 * 2 * 16
    assert got.step_s >= got.pipeline_s > 0 and got.dp_s == 0
    # The step's three all-reduces of a few bytes over both ranks (inputs and tokens, loss, gradient norm).
    assert got.sync_s == pytest.approx(3 * all_reduce_s(64, 2, UNIT.intra_node, 1.0))
    assert got.step_s == pytest.approx(got.pipeline_s + got.optimizer_s + got.sync_s)
    assert got.tokens_per_s == pytest.approx(tokens / got.step_s / 2)
    flops = model_flops(llama.config, seq_len=16, num_layers=4) * 4 * 2
    assert got.mfu == pytest.approx(flops / (got.step_s * 2 * 1e9))
    assert 0 < got.bubble < 0.5
    more = predict_step(_resolved(llama, pp=2, schedule="1f1b", m=8), llama, UNIT, batch_size=1)
    assert more.bubble < got.bubble  # more microbatches, the same tokens: a smaller bubble
    dp = predict_step(_resolved(llama, dp=2, data_parallel={"sharding": "replicate"}), llama, UNIT)
    full = predict_step(_resolved(llama, dp=2, data_parallel={"sharding": "full"}), llama, UNIT)
    assert dp.dp_s > 0 and full.pipeline_s > dp.pipeline_s  # full gathers layers for every microbatch
    with pytest.raises(ValueError, match="step time is predicted for Hugging Face LLaMA-family"):
        from tests.models import ToyNet

        toy = ToyNet()
        predict_step(rewrite.resolve({"mesh": {"pp": 2}}, toy), toy, UNIT)


def test_reducing_per_microbatch_puts_each_units_reduce_beside_every_backward(llama):
    """grad_op over dp 2, one stage, 4 microbatches: per step, one reduce-scatter of every unit beside the
    last backward; per microbatch, every backward lasts max(its compute, its units' reduces) + the
    smallest unit's reduce, and nothing waits after the last."""
    from rewrite.estimate.collectives import reduce_scatter_s
    from rewrite.estimate.step_time import stage_parameters

    plans = {r: _resolved(llama, dp=2, m=4, data_parallel={"sharding": "grad_op", "reduce": r})
             for r in ("step", "microbatch")}
    step, each = (predict_step(plans[r], llama, UNIT) for r in ("step", "microbatch"))
    (t,) = stage_times(plans["step"], llama, UNIT)
    units = stage_parameters(plans["step"], llama)[0][0]  # unit -> bytes on a rank
    reduces = [reduce_scatter_s(b, 2, UNIT.intra_node, 1.0) for b in units.values()]
    assert step.pipeline_s == pytest.approx(4 * t.forward + 4 * t.backward)
    assert each.pipeline_s == pytest.approx(4 * t.forward + 4 * (max(t.backward, sum(reduces)) + min(reduces)))
    assert each.dp_s < step.dp_s  # the step's one reduce no longer waits after the last backward
    assert each.step_s > step.step_s  # four times the traffic on this slow link


def test_show_predicts_on_a_hardware_profile(llama):
    data = show_data(_resolved(llama, tp=2), llama, hardware="h100-sxm", batch_size=2)
    p = data["predicted"]
    assert p["hardware"] == "h100-sxm" and {"step_s", "tokens_per_s", "mfu", "bubble"} <= set(p)
    assert "Predicted step on h100-sxm (2 sequences of 16 tokens)" in render_text(data)
    out = rewrite_cmd("show", "plans/llama-tp2-pp2.yaml", "--model", "tiny-llama", "--hardware", "a100-80g", "--json")
    assert out.returncode == 0, out.stderr
    predicted = json.loads(out.stdout)["predicted"]
    assert predicted["hardware"] == "a100-80g" and 0 < predicted["mfu"] < 1 and predicted["step_s"] > 0
    bad = rewrite_cmd("show", "plans/llama-tp2.yaml", "--model", "tiny-llama", "--hardware", "h1000")
    assert bad.returncode == 1 and "unknown hardware 'h1000'" in bad.stderr and "Traceback" not in bad.stderr
