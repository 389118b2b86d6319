"""mesh.ep in a plan: each rank of an expert-parallel group holds E / ep experts of every MoE layer and
tokens reach them by all-to-all, and a step equals one process running the whole global batch (loss,
then every gradient, fp32, 1e-5; routing first): ep 2 (dp 2) under full and replicate sharding, ep 4,
ep 2 inside dp 4 (experts held by two replicas), with tp 2 (the attention split, the experts by ep),
with pp 2 under 1f1b and zbv, with activation checkpointing, with the routers' auxiliary loss;
Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE (gated shared expert) and DeepSeek-V3 (shared experts,
group-limited sigmoid router). An expert no token reaches has a gradient of exactly 0, and a
rank none of whose experts is chosen still takes part in every exchange."""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from tests.asserts import assert_close
from tests.families import TINY, tiny_moe_model
from tests.multiproc import run
from tests.reference import assert_counted_once, assert_replica_step, expected_shard

RULE = {"model.layers.*.mlp.experts": "expert_parallel"}
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
LAYOUTS = {
    "dp2 ep2 full": {"mesh": {"dp": 2, "ep": 2}},
    "dp2 ep2 replicate": {"mesh": {"dp": 2, "ep": 2}, "data_parallel": {"sharding": "replicate"}},
    "dp4 ep4": {"mesh": {"dp": 4, "ep": 4}},
    "dp4 ep2 grad_op, recompute": {"mesh": {"dp": 4, "ep": 2}, "data_parallel": {"sharding": "grad_op"},
                                   "activation_checkpointing": {"model.layers.*": "full"}},
    "pp2 x dp2 ep2 1f1b": {"mesh": {"pp": 2, "dp": 2, "ep": 2}, "pipeline": {"schedule": "1f1b"}},
    "pp2 x dp2 ep2 zbv": {"mesh": {"pp": 2, "dp": 2, "ep": 2}, "pipeline": {"schedule": "zbv", "virtual_stages": 2}},
    "dp2 ep2 x tp2": {"mesh": {"dp": 2, "ep": 2, "tp": 2}},  # the family's own tp plan for the rest
    "pp4 afab": {"mesh": {"pp": 4}, "pipeline": {"schedule": "afab"}},
    "cp2 x dp2 ep2": {"mesh": {"cp": 2, "dp": 2, "ep": 2}},
    "pp2 x cp2 1f1b, recompute": {"mesh": {"pp": 2, "cp": 2}, "pipeline": {"schedule": "1f1b"},
                                  "activation_checkpointing": {"model.layers.*": "full"}},
}


def _plan(name: str, model=None) -> dict:
    layout = copy.deepcopy(LAYOUTS[name])
    layout["pipeline"] = {"microbatches": 2, **layout.get("pipeline", {})}
    rules = RULE
    if layout["mesh"].get("tp", 1) > 1:
        rules = rewrite.plan_from_hf(model, tp=layout["mesh"]["tp"], ep=layout["mesh"]["ep"], dp=layout["mesh"]["dp"]
                                     ).tensor_parallel
        assert rules["model.layers.*.mlp.experts"] == "expert_parallel"
    return {**layout, "tensor_parallel": rules}


def _routing(reference, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's chosen experts on one process, `[tokens, k]`, from its router's own forward."""
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: chosen.append(args[1].detach().clone()))
             for n, m in reference.named_modules() if n.endswith("mlp.experts")]
    with torch.no_grad():
        reference(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return chosen


def _steps(rank: int, world: int, family: str, overrides: dict, names: list[str]) -> list[str]:
    out = []
    for name in names:
        model = tiny_moe_model(family, **overrides)
        plan = _plan(name, model)
        reference = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(5)
        stage = rewrite.apply_plan(model, plan)
        ids = torch.randint(0, TINY["vocab_size"], (4 * stage.dp, 16), generator=gen)
        inputs, targets = rewrite.microbatches(ids, 2 * stage.dp)
        tag = f"{family} {name} rank {rank}"
        if stage.mesh.pp == stage.mesh.cp == 1:  # the routing each replica's tokens get is one process's
            per = ids.shape[0] // stage.dp
            mine = ids[stage.dp_rank * per:(stage.dp_rank + 1) * per]
            for layer, (got, want) in enumerate(zip(_routing(model, mine), _routing(reference, mine))):
                assert torch.equal(got, want), f"{tag} layer {layer}: routing differs"
        loss = assert_replica_step(stage, model, reference, inputs, targets, tag)
        total = rewrite.clip_grad_norm_(stage, None)  # each expert counted once
        assert_counted_once(tag, stage, reference)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
        assert_close(f"{tag} gradient norm", total, norm)
        held = {n: p.shape[0] for n, p in model.named_parameters() if ".experts." in n}
        dense = bool(overrides.get("mlp_only_layers"))  # a stage may hold no MoE layer
        assert (held or dense) and set(held.values()) <= {4 // plan["mesh"].get("ep", 1)}, f"{tag}: experts held {held}"
        out.append(f"{name}: {float(loss):.5f}")
    return out


@pytest.mark.parametrize("names", [["dp2 ep2 full", "dp2 ep2 replicate"],
                                   ["dp4 ep4", "dp4 ep2 grad_op, recompute", "dp2 ep2 x tp2"],
                                   ["pp2 x dp2 ep2 1f1b", "pp2 x dp2 ep2 zbv"]])
def test_qwen3_moe_steps_equal_one_process(names):
    sizes = [LAYOUTS[n]["mesh"]["dp"] * LAYOUTS[n]["mesh"].get("pp", 1) * LAYOUTS[n]["mesh"].get("tp", 1) for n in names]
    assert len(set(sizes)) == 1
    print(run(_steps, sizes[0], "qwen3_moe", {}, names, timeout_s=300)[0])


@pytest.mark.parametrize(("family", "overrides", "names"), [
    ("mixtral", {}, ["dp4 ep2 grad_op, recompute", "pp2 x dp2 ep2 1f1b"]),
    ("olmoe", {}, ["dp4 ep2 grad_op, recompute", "pp2 x dp2 ep2 1f1b"]),
    ("qwen2_moe", {}, ["dp4 ep2 grad_op, recompute", "pp2 x dp2 ep2 1f1b"]),
    ("deepseek_v3", {"n_group": 2, "topk_group": 1}, ["dp4 ep2 grad_op, recompute", "pp2 x dp2 ep2 1f1b", "dp2 ep2 x tp2"]),
    # The routers' auxiliary loss on: each microbatch's, as one process running it counts it, recomputed
    # layers not counting twice; across pipeline stages (the sums travel with the activations, and back
    # with the gradients; zbv's split backward), over sequence shards (summed over cp), and with stages
    # holding no MoE layer (Qwen3-MoE's mlp_only_layers).
    ("mixtral", AUX, ["dp4 ep2 grad_op, recompute", "dp4 ep4"]),
    ("mixtral", AUX, ["pp2 x dp2 ep2 1f1b", "pp2 x dp2 ep2 zbv", "pp4 afab"]),
    ("mixtral", AUX, ["cp2 x dp2 ep2", "pp2 x cp2 1f1b, recompute"]),
    ("qwen3_moe", {**AUX, "mlp_only_layers": [0]}, ["pp2 x dp2 ep2 zbv", "pp4 afab"]),
])
def test_moe_families_at_ep2_with_pp_and_tp(family, overrides, names):
    print(run(_steps, 4, family, overrides, names, timeout_s=300)[0])


def _unreached(rank: int, world: int) -> str:
    # DeepSeek-V3 chooses experts by sigmoid score plus its correction bias: -100 on experts 2 and 3
    # (ep rank 1's) means no token reaches them, and rank 1 receives no row all step.
    model = tiny_moe_model("deepseek_v3")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer[2:] = -100.0
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, _plan("dp2 ep2 full"))
    ids = torch.randint(0, TINY["vocab_size"], (8, 16), generator=torch.Generator().manual_seed(6))
    inputs, targets = rewrite.microbatches(ids, 4)
    assert_replica_step(stage, model, reference, inputs, targets, f"rank {rank}")
    zeros = 0
    for name, param in model.named_parameters():
        if ".mlp.experts." in name and rank == 1:
            want = expected_shard(model, name, dict(reference.named_parameters())[name].grad)
            assert torch.count_nonzero(want) == 0, f"{name}: the reference reached experts 2 and 3"
            assert torch.count_nonzero(param.grad) == 0, f"{name}: an expert no token reached has a gradient"
            zeros += 1
    return f"rank {rank}: {zeros} expert tensors with gradient exactly 0"


def test_an_expert_no_token_reaches_and_a_rank_with_no_row():
    print(run(_unreached, 2, timeout_s=120))
