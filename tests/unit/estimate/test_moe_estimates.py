"""The estimates of a mixture of experts. Activations, against what autograd really keeps: the MLP of
tiny Qwen3-MoE, Mixtral, DeepSeek-V3 (shared experts), OLMoE and gpt-oss (clamped, sigmoid-gated experts)
in float32 and bfloat16, one process, transformers' default (grouped_mm) experts; a plan's estimate
counts the experts a token runs through, not a dense MLP of intermediate_size; one tp rank of experts split
over tp keeps its slices' share. Step time, by hand: the exchanges of routed rows under ep, and the experts'
gradients all-reduced over their replicas instead of gathered and reduced with the dense ones; experts split
over tp halve the MLP's compute and add an all-reduce a layer."""

from __future__ import annotations

import pytest
import torch

import rewrite
from rewrite.estimate.activations import Sizes, layer_bytes, rank_activations
from rewrite.estimate.collectives import all_gather_s, all_reduce_s, all_to_all_s
from rewrite.estimate.dp_time import DDP_BUCKET, EXPERTS, DpTime
from rewrite.estimate.hardware import Efficiency, Hardware, Link
from rewrite.estimate.stage_time import stage_times
from rewrite.estimate.step_time import stage_parameters
from tests.families import tiny_moe_model
from tests.saved_bytes import saved_bytes

TOKENS = 256
RULE = {"model.layers.*.mlp.experts": "expert_parallel"}
TP_RULE = {"model.layers.*.mlp.experts": "expert_tensor_parallel"}
# A device whose memory traffic costs nothing: times are FLOPs / 1e9 and the collectives' formula.
UNIT = Hardware(
    name="unit", memory_gib=1, peak_flops={"float32": 1e9}, memory_bandwidth=1e30, devices_per_node=8,
    intra_node=Link(bandwidth=1e9, latency=1e-3), inter_node=Link(bandwidth=1e8, latency=1e-2),
    efficiency=Efficiency(matmul=1.0, collective=1.0),
)


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the storages autograd saves in `module`'s forward on `x`, its parameters left out."""
    return saved_bytes(lambda: module(x), module.parameters())


@pytest.mark.parametrize("family, dtype", [("qwen3_moe", torch.float32), ("qwen3_moe", torch.bfloat16),
                                           ("mixtral", torch.float32), ("deepseek_v3", torch.float32),
                                           ("olmoe", torch.bfloat16), ("gpt_oss", torch.float32)])
def test_a_moe_layer_keeps_what_the_estimate_says(family, dtype):
    model = tiny_moe_model(family).to(dtype)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, TOKENS // 2, model.config.hidden_size, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(mlp, x)
    z = Sizes.of(model.config, seq_len=TOKENS // 2, batch_size=2, dtype_bytes=dtype.itemsize)
    width = model.config.to_dict().get("moe_intermediate_size") or model.config.intermediate_size
    assert z.top_k == 2 and z.expert_width == width
    estimated = layer_bytes(z)[0] - layer_bytes(Sizes(**{**z.__dict__, "top_k": 0, "intermediate": 0}))[0]
    estimated += TOKENS * dtype.itemsize * z.hidden  # the MLP's input, counted with it
    assert abs(estimated / measured - 1) < 0.03, (family, dtype, estimated, measured)


def test_a_plans_estimate_counts_the_experts_a_token_runs_through():
    model = tiny_moe_model("qwen3_moe", moe_intermediate_size=64)
    plan = {"mesh": {"dp": 2, "ep": 2}, "tensor_parallel": {"model.layers.*.mlp.experts": "expert_parallel"},
            "pipeline": {"seq_len": 64}}
    moe = rank_activations(rewrite.resolve(plan, model), model)[0].peak
    z = Sizes.of(model.config, seq_len=64)
    dense = Sizes(**{**z.__dict__, "top_k": 0})  # a dense MLP of intermediate_size (128) instead
    per_layer = layer_bytes(z)[0] - layer_bytes(dense)[0]
    assert per_layer == 64 * (2 * (4 * 4 * 64 + 2 * 4 * 64 + 36) + 16 - 4 * 4 * 128)
    assert moe == rank_activations(rewrite.resolve({"pipeline": {"seq_len": 64}}, model), model)[0].peak


def test_the_step_time_counts_the_exchanges_and_the_experts_own_reduce():
    model = tiny_moe_model("qwen3_moe")  # h 64, 4 layers of 4 experts of width 32, k 2
    base = {"pipeline": {"seq_len": 16, "microbatches": 1}, "data_parallel": {"sharding": "replicate"}}
    split = rewrite.resolve({**base, "mesh": {"dp": 4, "ep": 2}, "tensor_parallel": RULE}, model)
    whole = rewrite.resolve({**base, "mesh": {"dp": 4}}, model)
    (ep,), (dense,) = stage_times(split, model, UNIT), stage_times(whole, model, UNIT)
    rows = 16 * 2 * 4  # T k B: a layer's routed rows, float32
    layer = all_to_all_s(rows * 65, 2, UNIT.intra_node, 1.0) + all_to_all_s(rows * 64, 2, UNIT.intra_node, 1.0)
    counts = all_to_all_s(16, 2, UNIT.intra_node, 1.0)  # F first exchanges the rows' counts per expert
    assert ep.ep_comm == pytest.approx(4 * (2 * layer + counts)) and dense.ep_comm == 0
    assert ep.forward == pytest.approx(dense.forward + 4 * (layer + counts))  # the same compute, and the exchanges
    assert ep.input_backward == pytest.approx(dense.input_backward + 4 * layer)
    assert ep.weight_backward == pytest.approx(dense.weight_backward)
    # Each exchange costs the profile's measured cost per all-to-all (a profile without one: a tp sum's), 3 in F
    # and 2 in I, compiled or not; the tp kinds' costs are not an exchange's.
    compiled = rewrite.resolve({**base, "mesh": {"dp": 4, "ep": 2}, "tensor_parallel": RULE, "compile": True}, model)
    for calls, each in (({"sum": 0.01}, 0.01), ({"sum": 0.01, "all_to_all": 0.002, "all_to_all_tp": 0.5}, 0.002),
                        ({"gather": 0.01, "scatter": 0.01}, 0.0)):
        hw = Hardware.model_validate({**UNIT.model_dump(), "call_overhead_s": calls})
        for resolved in (split, compiled):
            (plain,), (priced,) = stage_times(resolved, model, UNIT), stage_times(resolved, model, hw)
            assert priced.forward - plain.forward == pytest.approx(4 * 3 * each), calls
            assert priced.input_backward - plain.input_backward == pytest.approx(4 * 2 * each), calls
            assert priced.ep_comm - plain.ep_comm == pytest.approx(4 * 5 * each), calls
    # Experts over tp ranks: the exchanges sit between the tp group's collectives, `all_to_all_tp` each.
    over_tp = rewrite.resolve({**base, "mesh": {"tp": 2, "ep": 2}, "tensor_parallel": RULE}, model)
    for calls, each in (({"sum": 0.01, "all_to_all": 0.002, "all_to_all_tp": 0.001}, 0.001),
                        ({"sum": 0.01, "all_to_all": 0.002}, 0.002), ({"sum": 0.01}, 0.01)):
        hw = Hardware.model_validate({**UNIT.model_dump(), "call_overhead_s": calls})
        (plain,), (priced,) = stage_times(over_tp, model, UNIT), stage_times(over_tp, model, hw)
        assert priced.ep_comm - plain.ep_comm == pytest.approx(4 * 5 * each), calls
    # Across nodes (one device a node) the exchange takes the network.
    (far,) = stage_times(split, model, UNIT, gpus_per_node=1)
    assert far.ep_comm == pytest.approx(4 * (2 * (all_to_all_s(rows * 65, 2, UNIT.inter_node, 1.0)
                                                  + all_to_all_s(rows * 64, 2, UNIT.inter_node, 1.0))
                                             + all_to_all_s(16, 2, UNIT.inter_node, 1.0)))
    # The experts (2 of 4 a rank) leave FSDP2's units; their gradients are all-reduced over the 2 replicas
    # holding the same ones, after the dense reduce, and AdamW reads them whole.
    units = stage_parameters(split, model)[0]
    dpt = DpTime(split, units, UNIT, 8)
    experts = 4 * 2 * 3 * 64 * 32 * 4
    assert dpt.experts == [experts] and EXPERTS not in dpt.units[0] and dpt.expert_replicas == 2
    dense_held = sum(dpt.units[0].values())
    assert dense_held == sum(stage_parameters(whole, model)[0][0].values()) - 2 * experts
    exposed, adamw = dpt.tail((0,), [ep], "replicate", False, float("inf"), 4)
    assert exposed == pytest.approx(all_reduce_s(min(dense_held, DDP_BUCKET), 4, UNIT.intra_node, 1.0)
                                    + all_reduce_s(experts, 2, UNIT.intra_node, 1.0))
    assert adamw == pytest.approx((dense_held + experts) / 4 * (3 * 4 + 16) / 1e30)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_rank_of_experts_split_over_tp_keeps_what_the_estimate_says(family):
    # One tp rank's MoE block of tp 2: every expert's slice of the features (as `expert_tensor_parallel` cuts
    # them), its forward the partial output (the all-reduce keeps nothing).
    model = tiny_moe_model(family)
    resolved = rewrite.resolve({"mesh": {"tp": 2}, "tensor_parallel": TP_RULE}, model)
    mlp = model.model.layers[0].mlp
    for leaf, tensor in list(mlp.experts.named_parameters()):
        split = resolved.split_of(f"model.layers.0.mlp.experts.{leaf}")
        setattr(mlp.experts, leaf, torch.nn.Parameter(split.take(tensor.detach(), 0).clone()))
    x = torch.randn(2, TOKENS // 2, model.config.hidden_size, requires_grad=True)
    measured = _saved_bytes(mlp, x)
    z = Sizes.of(model.config, seq_len=TOKENS // 2, batch_size=2, tp=2)
    estimated = layer_bytes(z)[0] - layer_bytes(Sizes(**{**z.__dict__, "top_k": 0, "intermediate": 0}))[0]
    estimated += TOKENS * 4 * z.hidden
    assert abs(estimated / measured - 1) < 0.03, (family, estimated, measured)
    # A plan's estimate: the MoE layers' experts split (with the attention), less than with the experts whole.
    split = rank_activations(resolved, model)[0].peak
    whole = rank_activations(rewrite.resolve({"mesh": {"tp": 2}, "tensor_parallel": RULE}, model), model)[0].peak
    assert split < whole


def test_the_step_time_splits_the_experts_compute_over_tp():
    model = tiny_moe_model("qwen3_moe")
    base = {"pipeline": {"seq_len": 16, "microbatches": 1}, "mesh": {"tp": 2}}
    (split,) = stage_times(rewrite.resolve({**base, "tensor_parallel": TP_RULE}, model), model, UNIT)
    (whole,) = stage_times(rewrite.resolve({**base, "tensor_parallel": RULE}, model), model, UNIT)
    # The MLP's FLOPs halve, and each layer adds one all-reduce of its output each way.
    assert split.flops < whole.flops and split.tp_comm > whole.tp_comm
    block = 16 * 4 * 64  # T B h
    assert split.tp_comm - whole.tp_comm == pytest.approx(4 * 2 * all_reduce_s(block, 2, UNIT.intra_node, 1.0))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_rank_of_ep_borrowing_tp_keeps_its_chunks_routed_rows(family):
    # ep 2 over a tp pair: each tp rank sends half the tokens to their experts, and (balanced) its experts run
    # as many rows: what the experts keep halves; the split and gather keep nothing.
    model = tiny_moe_model(family)
    mlp = model.model.layers[0].mlp
    x = torch.randn(TOKENS, model.config.hidden_size)
    weights, index = torch.topk(torch.softmax(torch.randn(TOKENS, 4), dim=-1), 2, dim=-1)  # balanced, on average
    rows = x.clone().requires_grad_(True)
    experts = mlp.experts
    kept = {n: _saved_bytes(_Experts(experts, index[:n], weights[:n]), rows[:n]) for n in (TOKENS, TOKENS // 2)}
    z = Sizes.of(model.config, seq_len=TOKENS, tp=2)
    estimated = layer_bytes(z, mlp_split=False)[0] - layer_bytes(Sizes(**{**z.__dict__, "routed_split": 2}),
                                                                 mlp_split=False)[0]
    assert abs(estimated / (kept[TOKENS] - kept[TOKENS // 2]) - 1) < 0.03, (family, estimated, kept)
    resolved = rewrite.resolve({"mesh": {"tp": 2, "ep": 2}, "tensor_parallel": RULE}, model)
    assert rank_activations(resolved, model)[0].peak < rank_activations(
        rewrite.resolve({"mesh": {"tp": 2}, "tensor_parallel": {}}, model), model)[0].peak


class _Experts(torch.nn.Module):
    """An experts module called on fixed routing: what it keeps for its backward, alone."""

    def __init__(self, experts, index, weights):
        super().__init__()
        self.experts, self.index, self.weights = experts, index, weights.requires_grad_(True)

    def forward(self, x):
        return self.experts(x, self.index, self.weights)


def test_the_step_time_shares_the_tokens_out_when_ep_borrows_tp():
    model = tiny_moe_model("qwen3_moe")
    base = {"pipeline": {"seq_len": 16, "microbatches": 1}, "tensor_parallel": RULE}
    (over_tp,) = stage_times(rewrite.resolve({**base, "mesh": {"tp": 2, "ep": 2}}, model), model, UNIT)
    (over_dp,) = stage_times(rewrite.resolve({**base, "mesh": {"dp": 2, "ep": 2}}, model), model, UNIT)
    # The routed experts' FLOPs (6 T h k i_e a layer, 3 passes' worth: F, I and W) and rows halve ...
    routed = 6 * 16 * 64 * 2 * 32 * 4
    assert over_dp.flops - over_tp.flops == pytest.approx(3 * routed / 2)
    rows = 16 * 2 * 4 // 2  # T k B / t bytes, each row of h + 1 values out and h back, in F and in I
    exchanges = 4 * (2 * sum(all_to_all_s(rows * n, 2, UNIT.intra_node, 1.0) for n in (65, 64))
                     + all_to_all_s(16, 2, UNIT.intra_node, 1.0))  # and the counts per expert in F
    assert over_tp.ep_comm == pytest.approx(exchanges) and over_tp.ep_comm < over_dp.ep_comm
    # ... and each layer all-gathers its output (T h B) in F and its inputs' gradients (T (h + k) B) in I.
    gathers = 4 * (all_gather_s(16 * 4 * 64, 2, UNIT.intra_node, 1.0) + all_gather_s(16 * 4 * 66, 2, UNIT.intra_node, 1.0))
    assert over_tp.tp_comm == pytest.approx(gathers)


def test_under_sequence_parallelism_a_moe_block_runs_on_the_ranks_part():
    model = tiny_moe_model("qwen3_moe")
    plan = rewrite.plan_from_hf(model, tp=2, ep=2).model_dump()
    plan["pipeline"].update(seq_len=16, microbatches=1)
    plain, parts = (rewrite.resolve({**plan, "sequence_parallel": sp}, model) for sp in (False, True))
    (whole,), (split,) = stage_times(plain, model, UNIT), stage_times(parts, model, UNIT)
    # The same rows exchanged (each tp rank's half of the tokens), the router's FLOPs halved too, and the
    # block's input, router and experts kept for the rank's part only.
    assert split.ep_comm == pytest.approx(whole.ep_comm) and split.flops < whole.flops
    assert rank_activations(parts, model)[0].peak < rank_activations(plain, model)[0].peak


def test_shared_experts_split_over_tp_keep_and_compute_their_share():
    # One tp rank's slices of DeepSeek-V3's shared experts (gate and up rows, down columns): what they keep
    # drops by what the estimate says (their input, kept either way, cancels).
    model = tiny_moe_model("deepseek_v3")
    shared = model.model.layers[0].mlp.shared_experts
    x = torch.randn(2, TOKENS // 2, model.config.hidden_size, requires_grad=True)
    whole = _saved_bytes(shared, x)
    width = shared.gate_proj.out_features
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            getattr(shared, name).weight = torch.nn.Parameter(getattr(shared, name).weight[: width // 2].clone())
        shared.down_proj.weight = torch.nn.Parameter(shared.down_proj.weight[:, : width // 2].clone())
    measured = whole - _saved_bytes(shared, x)
    z = Sizes.of(model.config, seq_len=TOKENS // 2, batch_size=2, tp=2)
    assert z.shared_width == width
    estimated = (layer_bytes(z, mlp_split=False, shared_split=False)[0]
                 - layer_bytes(z, mlp_split=False, shared_split=True)[0])
    assert abs(estimated / measured - 1) < 0.03, (estimated, measured)
    # A plan's: plan_from_hf(tp=2, ep=2) splits them (experts by ep over the pair); without their rules whole.
    plan = rewrite.plan_from_hf(tiny_moe_model("deepseek_v3"), tp=2, ep=2).model_dump()
    plan["pipeline"].update(seq_len=16, microbatches=1)
    whole_plan = {**plan, "tensor_parallel": {k: v for k, v in plan["tensor_parallel"].items() if "shared" not in k}}
    split, kept = (rewrite.resolve(p, model) for p in (plan, whole_plan))
    assert rank_activations(split, model)[0].peak < rank_activations(kept, model)[0].peak
    (a,), (b,) = stage_times(split, model, UNIT), stage_times(kept, model, UNIT)
    # Their FLOPs (6 T h i_s a layer, in F, I and W) halve; each layer adds an all-reduce each way.
    assert b.flops - a.flops == pytest.approx(4 * 3 * 6 * 16 * 64 * width / 2)
    assert a.tp_comm - b.tp_comm == pytest.approx(4 * 2 * all_reduce_s(16 * 4 * 64, 2, UNIT.intra_node, 1.0))
