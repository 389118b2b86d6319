"""Checkpoints of an expert-parallel run: a dp 4 ep 2 stage of Qwen3-MoE trained two steps saves a
Hugging Face checkpoint that plain transformers loads as exactly the stage's weights (every expert from
the rank holding it), and a training state that loads under ep 4, ep 1 (dp 2, FSDP2 over every
parameter), pp 2 x dp 2 ep 2 and one process as exactly those weights, with the loss of one process on
them; `from_pretrained` reads the checkpoint into a dp 2 ep 2 replicate stage alike (each rank reading
only its experts)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

import rewrite
from rewrite.checkpoint.training_state import load_training_state, save_training_state
from tests.asserts import assert_close
from tests.families import TINY, tiny_moe_model
from tests.multiproc import run
from tests.reference import expected_shard

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


def _batch(seed: int, rows: int = 8):
    ids = torch.randint(0, TINY["vocab_size"], (rows, 16), generator=torch.Generator().manual_seed(seed))
    return rewrite.microbatches(ids, 4)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _matches(tag: str, model, weights: dict) -> None:
    for name, param in model.named_parameters():
        assert torch.equal(_whole(param.data), expected_shard(model, name, weights[name])), f"{tag}: {name}"


def _mine(stage, inputs: list, targets: list) -> tuple[list, list]:
    per = len(inputs) // stage.dp
    return inputs[stage.dp_rank * per:(stage.dp_rank + 1) * per], targets[stage.dp_rank * per:(stage.dp_rank + 1) * per]


def _checkpoints(rank: int, world: int, root: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    stage = rewrite.apply_plan(tiny_moe_model("qwen3_moe"), _plan("dp4 ep2"))
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for step in range(2):
        rewrite.run_schedule(stage, *_mine(stage, *_batch(step)))
        optimizer.step()
        optimizer.zero_grad()
    save_training_state(f"{root}/state", stage, optimizer, extra={"step": 2})
    rewrite.save_pretrained(stage, _plan("dp4 ep2"), f"{root}/hf")
    saved = AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32)
    weights = dict(saved.named_parameters())
    _matches("the Hugging Face save", stage.model, weights)
    inputs, targets = _batch(7)
    expected = sum(F.cross_entropy(saved(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
                   for x, y in zip(inputs, targets)) / len(inputs)
    out = []
    for name in ("dp4 ep4", "dp4 ep1", "pp2 x dp2 ep2"):
        other = rewrite.apply_plan(tiny_moe_model("qwen3_moe", seed=5), _plan(name))
        fresh = torch.optim.AdamW(other.parameters(), lr=1e-2)
        assert load_training_state(f"{root}/state", other, fresh) == {"step": 2}
        _matches(f"the training state under {name}", other.model, weights)
        loss = rewrite.run_schedule(other, *_mine(other, inputs, targets))
        assert_close(f"{name} loss on the loaded weights", loss, expected.detach())
        out.append(f"{name}: {float(loss):.5f}")
    return out


def _loads(rank: int, world: int, root: str) -> str:
    loaded = rewrite.from_pretrained(f"{root}/hf", _plan("dp2 ep2 replicate"))
    from transformers import AutoModelForCausalLM

    weights = dict(AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32).named_parameters())
    _matches("from_pretrained under dp2 ep2", loaded.model, weights)
    return f"rank {rank}: experts {loaded.model.model.layers[0].mlp.experts.gate_up_proj.shape[0]} of 4"


def _one_process(rank: int, world: int, root: str) -> float:
    from transformers import AutoModelForCausalLM

    stage = rewrite.apply_plan(tiny_moe_model("qwen3_moe", seed=5), _plan("one process"))
    fresh = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    assert load_training_state(f"{root}/state", stage, fresh) == {"step": 2}
    _matches("the training state on one process", stage.model,
             dict(AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32).named_parameters()))
    return float(rewrite.run_schedule(stage, *_batch(7)))


def test_expert_parallel_checkpoints_save_and_load_under_other_plans(tmp_path):
    print(run(_checkpoints, 4, str(tmp_path), timeout_s=300)[0])
    print(run(_loads, 2, str(tmp_path), timeout_s=120))
    print(run(_one_process, 1, str(tmp_path), timeout_s=120))
