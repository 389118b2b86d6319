"""Estimated activation memory per rank, and the tensor-parallel options table of `rewrite show`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import rewrite
from rewrite.estimate.activations import Sizes, end_bytes, layer_bytes, rank_activations
from rewrite.estimate.memory import rank_footprints
from rewrite.run.show.options import format_options, option_variants
from rewrite.run.presets import build_config, build_model
from tests.paths import PLANS, ROOT

TP_RULES = dict(rewrite.load_plan(PLANS / "llama-tp2.yaml").tensor_parallel)
VOCAB = {"model.embed_tokens": "vocab", "lm_head": "column"}


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", device="meta")  # float32, h 64, 8 heads (4 kv) of 8, i 128, V 256, 4 layers


def _acts(plan: dict, model) -> list:
    return rank_activations(rewrite.resolve(plan, model), model)


def test_hand_computed_figure(llama):
    # tiny-llama, one rank, one microbatch of s = 16 tokens, float32 (B = 4):
    norm = 16 * (4 * 64 + 4 * 64 + 4)  # float32 input, normalised values, 1/rms: 8,256
    attention = 16 * 4 * 64 + 16 * (4 * (8 + 2 * 4) * 8 + 2 * 4 * 8 * 8 + 4 * 8)  # input; q k v, out, o_proj in, lse
    mlp = 16 * 4 * 64 + 4 * 16 * 4 * 128  # input; gate, SiLU, up, product
    layer = 2 * norm + attention + mlp
    assert (norm, attention, mlp, layer) == (8256, 20992, 36864, 74368)
    end = norm + 16 * 4 * 64 + 4 * 16 * 256  # final norm, head input, float32 log-probabilities
    (rank,) = _acts({"pipeline": {"seq_len": 16}}, llama)
    assert (rank.in_flight, rank.recompute) == (1, 0)
    assert rank.peak == 4 * layer + end == 326208
    z = Sizes.of(llama.config, seq_len=16)
    assert layer_bytes(z) == (layer, 0) and end_bytes(z) == end
    # Half precision: the norms keep a float32 copy of their input, SDPA a float32 logsumexp.
    half = Sizes.of(llama.config, seq_len=16, dtype_bytes=2)
    half_attention = 16 * 2 * 64 + 16 * (2 * (8 + 2 * 4) * 8 + 2 * 2 * 8 * 8 + 4 * 8)
    assert layer_bytes(half)[0] == 2 * 16 * (4 * 64 + 2 * 64 + 4) + half_attention + mlp // 2


def test_replicated_kv_heads_count_once_a_rank():
    # tiny-llama with 2 kv heads at tp 4: each kv head held whole by 2 ranks, so a rank keeps
    # 8 / 4 = 2 query heads and 2 * 2 / 4 = 1 kv head (not 2 / 4 of one), s = 16, float32.
    model = build_model(build_config("tiny-llama", num_key_value_heads=2), device="meta")
    resolved = rewrite.resolve({"mesh": {"tp": 4}, "tensor_parallel": TP_RULES, "pipeline": {"seq_len": 16}}, model)
    k_proj = next(s for s in resolved.shards if s.fqn == "model.layers.0.self_attn.k_proj")
    assert resolved.kv_replicas == k_proj.replicas == 2 and k_proj.weight_shape == (8, 64)  # one head of 8
    norm = 16 * (4 * 64 + 4 * 64 + 4)
    attention = 16 * 4 * 64 + 16 * (4 * (2 + 2 * 1) * 8 + 2 * 4 * 2 * 8 + 4 * 2)  # input; q k v, out, o_proj in, lse
    mlp = 16 * 4 * 64 + 4 * 16 * 4 * 128 // 4
    layer = 2 * norm + attention + mlp
    assert (attention, layer) == (8320, 37120)
    end = norm + 16 * 4 * 64 + 4 * 16 * 256
    (rank,) = rank_activations(resolved, model)
    assert rank.peak == 4 * layer + end == 177216
    z = Sizes.of(model.config, seq_len=16, tp=4, kv_replicas=2)
    assert layer_bytes(z)[0] == layer and layer_bytes(z, attention_split=False)[0] > layer  # unsplit: no replicas


def test_sequence_parallel_lowers_activations(llama):
    plan = {"mesh": {"tp": 2}, "tensor_parallel": TP_RULES, "pipeline": {"seq_len": 16, "microbatches": 4}}
    (off,) = _acts(plan, llama)
    (on,) = _acts({**plan, "sequence_parallel": True}, llama)
    # 9 norms (2 per layer and the final one) run on 8 of the 16 tokens; 4 microbatches alive (afab).
    assert off.peak - on.peak == 4 * 9 * 8 * (4 * 64 + 4 * 64 + 4)
    assert on.in_flight == off.in_flight == 4


def test_vocab_and_loss_parallel_lower_parameters_and_logits(llama):
    plan = {"mesh": {"tp": 2}, "tensor_parallel": TP_RULES, "pipeline": {"seq_len": 16, "microbatches": 4}}
    sharded = {**plan, "tensor_parallel": {**TP_RULES, **VOCAB}, "loss_parallel": True}
    whole, split = (rewrite.resolve(p, llama) for p in (plan, sharded))
    embed_and_head = 2 * 256 * 64 * 4  # bytes, float32
    weights = [rank_footprints(r, llama)[0].weights for r in (whole, split)]
    assert weights[0] - weights[1] == embed_and_head // 2
    acts = [rank_activations(r, llama)[0].peak for r in (whole, split)]
    # float32 log-probabilities [16, 256] -> the logit shard [16, 128] and a float32 logsumexp [16].
    assert acts[0] - acts[1] == 4 * (4 * 16 * 256 - 16 * (4 * 128 + 4))


def test_activation_checkpointing_keeps_layer_inputs(llama):
    for plan in ({}, {"mesh": {"tp": 2}, "tensor_parallel": TP_RULES}):
        plan = {**plan, "pipeline": {"microbatches": 4}}
        (full,) = _acts(plan, llama)
        (ckpt,) = _acts({**plan, "activation_checkpointing": {"model.layers.*": "full"}}, llama)
        assert ckpt.peak < 0.5 * full.peak
        assert ckpt.recompute > 0 and full.recompute == 0
    # Only a layer's input is kept: 16 tokens x 64 float32 values; its forward rebuilt once.
    (one,) = _acts({"pipeline": {"seq_len": 16}, "activation_checkpointing": {"model.layers.1": "full"}}, llama)
    assert one.peak == 326208 - 74368 + 16 * 64 * 4 + 74368


def test_schedule_sets_microbatches_in_flight(llama):
    plan = {"mesh": {"pp": 2}, "pipeline": {"seq_len": 16, "microbatches": 4}}
    afab = _acts(plan, llama)
    onef = _acts({**plan, "pipeline": {**plan["pipeline"], "schedule": "1f1b"}}, llama)
    assert [a.in_flight for a in afab] == [4, 4] and [a.in_flight for a in onef] == [2, 1]
    assert onef[0].peak == 2 * onef[0].stage_bytes[0] and afab[1].peak == 4 * afab[1].stage_bytes[1]
    # Stage 0 holds layers 0-1 and its output for the backward; stage 1 layers 2-3 and the end.
    assert afab[0].stage_bytes[0] == 2 * 74368 + 16 * 64 * 4 and afab[1].stage_bytes[1] == 2 * 74368 + 28736


def test_variants_skip_what_the_model_cannot_take():
    odd = build_model(build_config("tiny-llama", vocab_size=255), device="meta")
    shown, skipped = option_variants(rewrite.resolve({"mesh": {"tp": 2}, "tensor_parallel": TP_RULES}, odd), odd)
    assert [label for label, _ in shown] == ["sequence_parallel on", "activation_checkpointing on (model.layers.*)"]
    assert skipped[0][0] == "vocab + loss_parallel on" and "not divisible by mesh.tp=2" in skipped[0][1]


def test_show_prints_the_options_table(llama):
    text = format_options(rewrite.resolve(PLANS / "llama-tp2-sp.yaml", llama), llama)
    assert text.startswith("Tensor-parallel options (per rank, estimated)")
    rows = {line.split("  ")[1].strip() for line in text.splitlines()[3:7]}
    assert rows == {"as planned", "vocab + loss_parallel off", "sequence_parallel off",
                    "activation_checkpointing on (model.layers.*)"}
    for plain in ({}, PLANS / "llama-pp2.yaml"):
        assert format_options(rewrite.resolve(plain, llama), llama) == ""
    ckpt = format_options(rewrite.resolve({"activation_checkpointing": {"model.layers.*": "full"}}, llama), llama)
    assert "activation_checkpointing off" in ckpt and "tp=1: nothing is split" in ckpt


def test_shipped_sequence_parallel_plan():
    plan = rewrite.load_plan(PLANS / "llama-tp2-sp.yaml")
    assert plan.loss_parallel and plan.sequence_parallel and not plan.activation_checkpointing
    assert plan.tensor_parallel == {**TP_RULES, **VOCAB}
    out = subprocess.run(
        [sys.executable, "-m", "rewrite", "show", "plans/llama-tp2-sp.yaml", "--model", "tiny-qwen3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "model.embed_tokens                 vocab           [256, 64] -> [128, 64]" in out.stdout
    assert "\n\nTensor-parallel options (per rank, estimated)" in out.stdout and "  as planned " in out.stdout
    plain = subprocess.run(
        [sys.executable, "-m", "rewrite", "show", "plans/llama-pp2.yaml", "--model", "tiny-llama"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert plain.returncode == 0 and "Tensor-parallel options" not in plain.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_peak_is_what_the_estimate_adds(dtype):
    """The runner's loss on [2, 256] tokens x 1,000 logits: the most bytes its forward and backward hold at once
    (the profiler's allocations) are the float32 log-probabilities it keeps and the two float32 gradients at its
    backward's peak (`loss_peak_bytes`); the logits themselves are the head's."""
    from torch.profiler import ProfilerActivity, profile

    from rewrite.estimate.head_activations import loss_peak_bytes
    from rewrite.estimate.layer_activations import F32
    from rewrite.pipeline.loss import causal_lm_loss

    z = Sizes(hidden=64, heads=8, kv_heads=4, head_dim=8, intermediate=128, vocab=1000, seq_len=256, batch_size=2)
    logits = torch.randn(2, 256, 1000, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 1000, (2, 256))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        causal_lm_loss(logits, targets).backward()
    live = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    assert peak == pytest.approx(F32 * z.tokens * z.vocab + loss_peak_bytes(z), rel=1e-3)
    assert loss_peak_bytes(z, loss_parallel=True) == loss_peak_bytes(z, has_head=False) == 0
