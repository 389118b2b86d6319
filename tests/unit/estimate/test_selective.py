"""'selective' activation checkpointing against what a layer really holds: the bytes a tiny LLaMA layer keeps
from its forward to its backward (every allocation of the forward still alive, from the profiler) under no
checkpointing, 'full' and 'selective', the whole layer or one part, in float32 and bfloat16; the estimate's
products kept are exactly what 'selective' keeps beyond 'full'. The search offers it where it is estimated."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import rewrite
from rewrite.estimate.layer_activations import Sizes, layer_bytes
from rewrite.estimate.plan_parts import selective_problem
from rewrite.rewriter import _checkpointed
from rewrite.run.presets import build_model

TOKENS = (2, 64)  # sequences, tokens each


def _held(model, path: str, mode: str, dtype) -> int:
    """Bytes layer 1's forward leaves allocated for its backward (its output left out), with `path` ('': the
    layer) checkpointed in `mode`."""
    layer = model.model.layers[1]
    module = model.get_submodule(path) if path else layer
    original = module.forward
    if mode != "none":
        module.forward = _checkpointed(original, selective=mode == "selective")
    x = torch.randn(*TOKENS, model.config.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, torch.arange(TOKENS[1])[None])
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = layer(x, position_embeddings=(cos, sin), attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        held = sum(e.nbytes() for e in events) - out.numel() * out.element_size()
        if not path and mode != "none":  # the checkpoint keeps the layer's input, allocated before
            held += x.numel() * x.element_size()
        out.sum().backward()  # the recompute runs: the policy's counts agree between forward and recompute
    finally:
        module.forward = original
    return held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_keeps_the_products_the_estimate_counts(dtype):
    model = build_model("tiny-llama").to(dtype)
    z = Sizes.of(model.config, seq_len=TOKENS[1], batch_size=TOKENS[0], dtype_bytes=dtype.itemsize)
    splits = {"attention_split": False, "mlp_split": False}
    for path, part in (("", ""), ("model.layers.1.self_attn", "self_attn"), ("model.layers.1.mlp", "mlp")):
        none, full, selective = (_held(model, path, mode, dtype) for mode in ("none", "full", "selective"))
        est_full = layer_bytes(z, **splits, recomputed=[part])[0]
        est_selective = layer_bytes(z, **splits, recomputed=["~" + part])[0]
        assert full < selective < none, (path, full, selective, none)
        # What selective keeps beyond full, to the byte: q, v, gate, down (each counted in its call) and the
        # attention kernel's output and log-sum-exp.
        assert selective - full == est_selective - est_full, (path, dtype, selective - full, est_selective - est_full)
        if not path:  # the whole layer: its input and those products, and nothing else
            assert abs(est_selective / selective - 1) < 0.05, (dtype, est_selective, selective)


def test_the_search_offers_selective_where_it_is_estimated():
    assert selective_problem(build_model("tiny-llama", device="meta")) is None
    problem = selective_problem(build_model("tiny-qwen3-moe", device="meta"))
    assert "estimated for layers of q/k/v/o and gate/up/down projections alone" in problem
    assert "no linear mlp.gate_proj, mlp.up_proj, mlp.down_proj" in problem
    assert "context parallelism" in selective_problem(build_model("tiny-llama", device="meta"), cp=2)
    model = build_model("tiny-llama", device="meta")
    found = rewrite.suggest_plans(model, world=2, device_memory=0.006, seq_len=256, global_batch=2, hardware="cpu")
    modes = {c.plan.mesh.shape_text(): c.checkpointing for c in found}
    # Where the activations do not fit whole: op by op before layer by layer, but not under cp (not estimated).
    assert modes["dp=2 x pp=1 x tp=1"] == modes["pp=1 x tp=2"] == "selective", modes
    assert modes["pp=1 x cp=2 x tp=1"] == "every layer", modes
    pick = next(c for c in found if c.checkpointing == "selective")
    assert set(pick.plan.activation_checkpointing.values()) == {"selective"}
    resolved = rewrite.resolve(pick.plan, model)
    assert resolved.selective == resolved.recomputed and resolved.recomputed
    with pytest.raises(ValueError, match="'selective' checkpointing are estimated"):
        rewrite.predict_step(rewrite.resolve({"activation_checkpointing": {"model.layers.*": "selective"}},
                                             build_model("tiny-qwen3-moe", device="meta")),
                             build_model("tiny-qwen3-moe", device="meta"), "cpu")
