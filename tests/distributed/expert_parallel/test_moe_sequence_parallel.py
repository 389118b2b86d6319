"""Sequence parallelism with a mixture of experts: between the tp blocks each rank holds its part of the
sequence, and the MoE block runs on it token by token (router, gates and experts kept whole summing their
gradients over tp; shared experts split over tp gathering the sequence and scattering it again; experts
split by expert (ep over the tp ranks) sending only the rank's part; each expert split over tp gathering
every part and reduce-scattering the partial outputs). A step equals one process (loss, then every gradient
and the gradient norm, fp32, 1e-5), with 15 tokens a row so that the last part carries padding: Qwen3-MoE
with the routers' loss (the padding left out of it), Ernie-4.5-MoE and Llama 4 (shared experts split over tp),
Qwen2-MoE (a gated shared expert kept whole)."""

from __future__ import annotations

import pytest

import rewrite
from tests.families import tiny_moe_model
from tests.multiproc import run
from tests.reference import assert_step_and_norm

LAYOUTS = {
    "tp2 ep2 x dp2": ({"tp": 2, "ep": 2, "dp": 2}, {}),
    "tp2 x dp2, experts over tp": ({"tp": 2, "dp": 2}, {}),
    "tp4, experts whole": ({"tp": 4}, {}),
    "tp2 ep2 x pp2 1f1b, recompute": ({"tp": 2, "ep": 2, "pp": 2, "schedule": "1f1b"},
                                      {"activation_checkpointing": {"model.layers.*": "full"}}),
}


def _plan(name: str, model) -> dict:
    mesh, extra = LAYOUTS[name]
    plan = rewrite.plan_from_hf(model, microbatches=2, **mesh).model_dump()
    if "experts whole" in name:  # on every tp rank, each running its part of the tokens through them
        plan["tensor_parallel"] = {k: ("expert_parallel" if v == "expert_tensor_parallel" else v)
                                   for k, v in plan["tensor_parallel"].items()}
    return {**plan, **extra, "sequence_parallel": True}


def _steps(rank: int, world: int, family: str, overrides: dict, names: list[str]) -> list[str]:
    out = []
    for name in names:
        model = tiny_moe_model(family, **overrides)
        _, _, loss = assert_step_and_norm(model, _plan(name, model), 15, f"{family} {name} rank {rank}")
        out.append(f"{name}: {float(loss):.5f}")
    return out


AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


@pytest.mark.parametrize(("family", "overrides", "names"), [
    ("qwen3_moe", AUX, ["tp2 ep2 x dp2", "tp2 x dp2, experts over tp", "tp4, experts whole"]),
    ("qwen3_moe", AUX, ["tp2 ep2 x pp2 1f1b, recompute"]),
    ("ernie4_5_moe", {}, ["tp2 ep2 x dp2", "tp2 x dp2, experts over tp"]),
    ("llama4_text", {}, ["tp2 ep2 x dp2", "tp2 x dp2, experts over tp"]),
    ("qwen2_moe", {}, ["tp2 ep2 x dp2", "tp4, experts whole"]),
])
def test_sequence_parallel_with_experts_equals_one_process(family, overrides, names):
    print(run(_steps, 4, family, overrides, names, timeout_s=300)[0])
