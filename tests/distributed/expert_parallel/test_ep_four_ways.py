"""The shipped mixture-of-experts plan on 8 ranks: data x pipeline x tensor parallelism with the experts
split over ep 2 (plans/qwen3-moe-dp2-ep2-tp2-pp2.yaml) trains a tiny Qwen3-MoE as one process does
(loss and every gradient, fp32, 1e-5), saves its training state, and resumes under dp 4 x ep 4 x tp 2
(another split of every kind) with exactly the saved weights and the loss of one process on them; its
Hugging Face save loads in plain transformers as those weights."""

from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

import rewrite
from rewrite.checkpoint.training_state import load_training_state, save_training_state
from tests.asserts import assert_close
from tests.families import TINY, tiny_moe_model
from tests.multiproc import run
from tests.paths import PLANS
from tests.reference import assert_replica_step, expected_shard

SHIPPED = rewrite.load_plan(PLANS / "qwen3-moe-dp2-ep2-tp2-pp2.yaml").model_dump(mode="json", exclude_none=True)
RESUMED = {**SHIPPED, "mesh": {"dp": 4, "ep": 4, "tp": 2}, "pipeline": {"microbatches": 2}}


def _batch(seed: int, rows: int):
    ids = torch.randint(0, TINY["vocab_size"], (rows, 16), generator=torch.Generator().manual_seed(seed))
    return rewrite.microbatches(ids, rows // 2)


def _mine(stage, inputs: list, targets: list) -> tuple[list, list]:
    per = len(inputs) // stage.dp
    return inputs[stage.dp_rank * per:(stage.dp_rank + 1) * per], targets[stage.dp_rank * per:(stage.dp_rank + 1) * per]


def _matches(tag: str, model, weights: dict) -> None:
    for name, param in model.named_parameters():
        whole = param.data.full_tensor() if hasattr(param.data, "full_tensor") else param.data
        assert torch.equal(whole, expected_shard(model, name, weights[name])), f"{tag}: {name}"


def _four_ways(rank: int, world: int, root: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    model = tiny_moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, SHIPPED)
    assert (stage.dp, stage.mesh.ep, stage.mesh.pp, stage.mesh.tp) == (2, 2, 2, 2)
    inputs, targets = _batch(3, 16)  # 8 microbatches: 4 a replica
    loss = assert_replica_step(stage, model, reference, inputs, targets, f"dp2 ep2 tp2 pp2 rank {rank}")
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    optimizer.step()
    optimizer.zero_grad()
    save_training_state(f"{root}/state", stage, optimizer, extra={"step": 1})
    rewrite.save_pretrained(stage, SHIPPED, f"{root}/hf")
    saved = AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32)
    weights = dict(saved.named_parameters())
    _matches("the Hugging Face save", stage.model, weights)

    other = rewrite.apply_plan(tiny_moe_model("qwen3_moe", seed=5), RESUMED)
    fresh = torch.optim.AdamW(other.parameters(), lr=1e-2)
    assert load_training_state(f"{root}/state", other, fresh) == {"step": 1}
    _matches("the training state under dp4 ep4 tp2", other.model, weights)
    inputs, targets = _batch(7, 8)
    expected = sum(F.cross_entropy(saved(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
                   for x, y in zip(inputs, targets)) / len(inputs)
    resumed = rewrite.run_schedule(other, *_mine(other, inputs, targets))
    assert_close("dp4 ep4 tp2 loss on the loaded weights", resumed, expected.detach())
    return [f"step {float(loss):.5f}", f"resumed {float(resumed):.5f}"]


def test_the_shipped_moe_plan_trains_saves_and_resumes_under_another_split(tmp_path):
    print(run(_four_ways, 8, str(tmp_path), timeout_s=420)[0])
