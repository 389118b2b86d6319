"""The activation estimate of a mixture-of-experts layer, against what autograd really keeps: the MLP of
tiny Qwen3-MoE, Mixtral, DeepSeek-V3 (shared experts), OLMoE and gpt-oss (clamped, sigmoid-gated experts)
in float32 and bfloat16, one process, transformers' default (grouped_mm) experts; and the rank's estimate
of a plan counts the experts a token runs through, not a dense MLP of intermediate_size."""

from __future__ import annotations

import pytest
import torch

import rewrite
from rewrite.estimate.activations import Sizes, layer_bytes, rank_activations
from tests.families import tiny_moe_model

TOKENS = 256


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the storages autograd saves in `module`'s forward on `x`, its parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(saved.values())


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
