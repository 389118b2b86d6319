"""Each expert split over tp (`expert_tensor_parallel`, what plan_from_hf gives at tp > 1 and ep 1): every tp rank
holds every expert's slice of the intermediate features and the partial outputs are summed, and a step equals one
process running the whole global batch (loss, then every gradient, fp32, 1e-5): tp 2 beside dp 2 (full and
replicate), tp 4, tp 2 x pp 2 (1f1b and zbv), activation checkpointing, the routers' auxiliary loss; Qwen3-MoE,
Mixtral, DeepSeek-V3 (shared experts), Llama 4 (every-token experts, features last) and Aria (features last)."""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from tests.asserts import assert_close
from tests.families import TINY, tiny_moe_model
from tests.multiproc import run
from tests.reference import assert_counted_once, assert_replica_step

LAYOUTS = {
    "tp2 x dp2 full": ({"tp": 2, "dp": 2}, {}),
    "tp2 x dp2 replicate, recompute": ({"tp": 2, "dp": 2}, {"data_parallel": {"sharding": "replicate"},
                                                            "activation_checkpointing": {"model.layers.*": "full"}}),
    "tp4": ({"tp": 4}, {}),
    "tp2 x pp2 1f1b": ({"tp": 2, "pp": 2, "schedule": "1f1b"}, {}),
    "tp2 x pp2 zbv": ({"tp": 2, "pp": 2, "schedule": "zbv", "virtual_stages": 2}, {}),
}


def _steps(rank: int, world: int, family: str, overrides: dict, names: list[str]) -> list[str]:
    out = []
    for name in names:
        model = tiny_moe_model(family, **overrides)
        mesh, extra = LAYOUTS[name]
        plan = rewrite.plan_from_hf(model, microbatches=2, **mesh).model_dump()
        experts = {k: v for k, v in plan["tensor_parallel"].items() if k.endswith(".experts")}
        assert experts and set(experts.values()) == {"expert_tensor_parallel"}, experts
        plan.update(extra)
        reference = copy.deepcopy(model)
        stage = rewrite.apply_plan(model, plan)
        gen = torch.Generator().manual_seed(5)
        ids = torch.randint(0, TINY["vocab_size"], (4 * stage.dp, 16), generator=gen)
        inputs, targets = rewrite.microbatches(ids, 2 * stage.dp)
        tag = f"{family} {name} rank {rank}"
        loss = assert_replica_step(stage, model, reference, inputs, targets, tag)
        total = rewrite.clip_grad_norm_(stage, None)  # each expert's slices counted once
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
        assert_close(f"{tag} gradient norm", total, norm)
        assert_counted_once(tag, stage, reference)
        whole = dict(reference.named_parameters())
        held = {n: (tuple(p.shape), tuple(whole[n].shape)) for n, p in model.named_parameters() if ".experts." in n}
        assert held and all(h != w and h[0] == w[0] for h, w in held.values()), f"{tag}: experts held {held}"
        out.append(f"{name}: {float(loss):.5f}")
    return out


@pytest.mark.parametrize(("family", "overrides", "names"), [
    ("qwen3_moe", {}, ["tp2 x dp2 full", "tp2 x dp2 replicate, recompute", "tp4"]),
    ("qwen3_moe", {"output_router_logits": True}, ["tp2 x pp2 1f1b", "tp2 x pp2 zbv"]),
    ("mixtral", {"output_router_logits": True, "router_aux_loss_coef": 0.5}, ["tp2 x dp2 full"]),
    ("deepseek_v3", {"n_group": 2, "topk_group": 1}, ["tp2 x dp2 full"]),
    ("llama4_text", {}, ["tp2 x dp2 full"]),
    ("aria_text", {}, ["tp2 x dp2 full"]),
])
def test_each_expert_split_over_tp_equals_one_process(family, overrides, names):
    print(run(_steps, 4, family, overrides, names, timeout_s=300)[0])
