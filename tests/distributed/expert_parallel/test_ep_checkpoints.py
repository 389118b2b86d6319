"""Checkpoints of an expert-parallel run: a dp 4 ep 2 stage of Qwen3-MoE trained two steps saves a
Hugging Face checkpoint that plain transformers loads as exactly the stage's weights (every expert from
the rank holding it), and a training state that loads under ep 4, ep 1 (dp 2, FSDP2 over every
parameter), pp 2 x dp 2 ep 2 and one process as exactly those weights, with the loss of one process on
them; `from_pretrained` reads the checkpoint into a dp 2 ep 2 replicate stage alike (each rank reading
only its experts)."""

from __future__ import annotations

import torch

import rewrite
from rewrite.checkpoint.training_state import load_training_state
from tests.families import tiny_moe_model
from tests.multiproc import run
from tests.distributed.expert_parallel.resume import batch, matches, resumes, saved_weights, train_and_save

RULE = {"model.layers.*.mlp.experts": "expert_parallel"}
PLANS = {
    "dp4 ep2": {"mesh": {"dp": 4, "ep": 2}},
    "dp4 ep4": {"mesh": {"dp": 4, "ep": 4}},
    "dp4 ep1": {"mesh": {"dp": 4}},
    "pp2 x dp2 ep2": {"mesh": {"pp": 2, "dp": 2, "ep": 2}, "pipeline": {"schedule": "1f1b"}},
    "dp2 ep2 replicate": {"mesh": {"dp": 2, "ep": 2}, "data_parallel": {"sharding": "replicate"}},
    "one process": {},
}


def _plan(name: str) -> dict:
    return {**PLANS[name], "tensor_parallel": RULE, "pipeline": {"microbatches": 2, **PLANS[name].get("pipeline", {})}}


def _checkpoints(rank: int, world: int, root: str) -> list[str]:
    train_and_save(root, _plan("dp4 ep2"))
    return resumes(root, ("dp4 ep4", "dp4 ep1", "pp2 x dp2 ep2"), lambda name, model: _plan(name), batch(7))


def _loads(rank: int, world: int, root: str) -> str:
    loaded = rewrite.from_pretrained(f"{root}/hf", _plan("dp2 ep2 replicate"))
    matches("from_pretrained under dp2 ep2", loaded.model, saved_weights(root))
    return f"rank {rank}: experts {loaded.model.model.layers[0].mlp.experts.gate_up_proj.shape[0]} of 4"


def _one_process(rank: int, world: int, root: str) -> float:
    stage = rewrite.apply_plan(tiny_moe_model("qwen3_moe", seed=5), _plan("one process"))
    fresh = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    assert load_training_state(f"{root}/state", stage, fresh) == {"step": 2}
    matches("the training state on one process", stage.model, saved_weights(root))
    return float(rewrite.run_schedule(stage, *batch(7)))


def test_expert_parallel_checkpoints_save_and_load_under_other_plans(tmp_path):
    print(run(_checkpoints, 4, str(tmp_path), timeout_s=300)[0])
    print(run(_loads, 2, str(tmp_path), timeout_s=120))
    print(run(_one_process, 1, str(tmp_path), timeout_s=120))
