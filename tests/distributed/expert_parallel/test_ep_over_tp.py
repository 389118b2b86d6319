"""ep borrowing tp ranks (ep dividing dp x tp, a stage's ranks numbered tp fastest): each tp rank sends only its
chunk of the tokens to their experts and the outputs are all-gathered over tp. A step equals one process running
the whole global batch (loss, then every gradient and the gradient norm, fp32, 1e-5) with the experts split over
a replica's tp ranks (tp 2 ep 2, tp 4 ep 2 and ep 4), over tp and dp together (tp 2 x dp 2 at ep 4), under pp
(zbv), context parallelism and activation checkpointing; token counts tp does not divide, and a tp rank left
with no token;
Qwen3-MoE, Mixtral with the routers' loss, Qwen2-MoE (gated shared expert), DeepSeek-V3 and Llama 4
(every-token experts). A training state saved at tp 2 x dp 2 ep 4 resumes at dp 4 ep 2, tp 4 ep 2 and
tp 2 ep 2 x pp 2; its Hugging Face save loads in plain transformers and into tp 4 ep 4."""

from __future__ import annotations

import pytest

import rewrite
from tests.families import tiny_moe_model
from tests.multiproc import run
from tests.reference import assert_step_and_norm
from tests.distributed.expert_parallel.resume import batch, matches, resumes, saved_weights, train_and_save

# name: (plan_from_hf's mesh, what the plan adds, tokens a microbatch row: 16, or 7 (tp 4: 2, 2, 2, 1 each),
# or 3 (tp 4: one rank with none))
LAYOUTS = {
    "tp2 ep2 x dp2": ({"tp": 2, "ep": 2, "dp": 2}, {}, 16),
    "tp2 x dp2 ep4": ({"tp": 2, "ep": 4, "dp": 2}, {}, 16),
    "tp4 ep2, 7 tokens": ({"tp": 4, "ep": 2, "dp": 1}, {}, 7),
    "tp4 ep4, 3 tokens, recompute": ({"tp": 4, "ep": 4, "dp": 1},
                                     {"activation_checkpointing": {"model.layers.*": "full"}}, 3),
    "tp2 ep2 x pp2 zbv": ({"tp": 2, "ep": 2, "dp": 1, "pp": 2, "schedule": "zbv", "virtual_stages": 2}, {}, 16),
    "cp2 x tp2 ep2": ({"tp": 2, "ep": 2, "dp": 1}, {"mesh": {"tp": 2, "ep": 2, "cp": 2}}, 16),
    "dp4 ep2": ({"tp": 1, "ep": 2, "dp": 4}, {}, 16),
    "tp4 ep4": ({"tp": 4, "ep": 4, "dp": 1}, {}, 16),
}


def _plan(name: str, model) -> dict:
    mesh, extra, _ = LAYOUTS[name]
    plan = rewrite.plan_from_hf(model, microbatches=2, **mesh).model_dump()
    experts = {k: v for k, v in plan["tensor_parallel"].items() if k.endswith(".experts")}
    assert experts and set(experts.values()) == {"expert_parallel"}, experts
    return {**plan, **extra}


def _steps(rank: int, world: int, family: str, overrides: dict, names: list[str]) -> list[str]:
    out = []
    for name in names:
        model = tiny_moe_model(family, **overrides)
        # The gradient norm counts each expert once, whichever tp rank holds it.
        stage, reference, loss = assert_step_and_norm(model, _plan(name, model), LAYOUTS[name][2],
                                                      f"{family} {name} rank {rank}")
        tag = f"{family} {name} rank {rank}"
        whole = dict(reference.named_parameters())
        held = {n: (p.shape[0], whole[n].shape[0]) for n, p in model.named_parameters() if ".experts." in n}
        ep = stage.mesh.ep
        assert held and all(h * ep == w for h, w in held.values()), f"{tag}: experts held {held}"
        out.append(f"{name}: {float(loss):.5f}")
    return out


AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


@pytest.mark.parametrize(("family", "overrides", "names"), [
    ("qwen3_moe", {}, ["tp2 ep2 x dp2", "tp2 x dp2 ep4", "tp4 ep2, 7 tokens", "tp4 ep4, 3 tokens, recompute"]),
    ("mixtral", AUX, ["tp2 x dp2 ep4", "tp2 ep2 x pp2 zbv", "cp2 x tp2 ep2"]),
    ("qwen2_moe", {}, ["tp2 x dp2 ep4"]),
    ("deepseek_v3", {"n_group": 2, "topk_group": 1}, ["tp4 ep2, 7 tokens"]),
    ("llama4_text", {}, ["tp2 x dp2 ep4", "tp4 ep2, 7 tokens"]),
])
def test_ep_over_tp_ranks_equals_one_process(family, overrides, names):
    print(run(_steps, 4, family, overrides, names, timeout_s=300)[0])


def _checkpoints(rank: int, world: int, root: str) -> list[str]:
    model = tiny_moe_model("qwen3_moe")
    train_and_save(root, _plan("tp2 x dp2 ep4", model))
    return resumes(root, ("dp4 ep2", "tp4 ep2, 7 tokens", "tp2 ep2 x pp2 zbv"), _plan, batch(7))


def _loads(rank: int, world: int, root: str) -> str:
    loaded = rewrite.from_pretrained(f"{root}/hf", _plan("tp4 ep4", tiny_moe_model("qwen3_moe")))
    matches("from_pretrained under tp4 ep4", loaded.model, saved_weights(root))
    return f"rank {rank}: experts {loaded.model.model.layers[0].mlp.experts.gate_up_proj.shape[0]} of 4"


def test_ep_over_tp_checkpoints_resume_under_other_splits(tmp_path):
    print(run(_checkpoints, 4, str(tmp_path), timeout_s=300)[0])
    print(run(_loads, 4, str(tmp_path), timeout_s=120)[0])
