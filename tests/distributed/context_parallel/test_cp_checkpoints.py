"""Checkpoints of a context-parallel run: a cp 2 x tp 2 stage trained two steps saves a Hugging Face
checkpoint that plain transformers loads as exactly the stage's weights, and a training state that
loads under cp 4, pp 2 x cp 2, dp 2 x cp 2 (full) and tp 4 (no cp) as exactly those weights, with the
loss of one process on them; `from_pretrained` reads the checkpoint into a dp 2 x cp 2 stage alike.
(Across plans only what involves no optimizer arithmetic is compared: see test_training_state.)"""

from __future__ import annotations

import torch
from torch.nn import functional as F

import rewrite
from rewrite.checkpoint.training_state import load_training_state, save_training_state
from tests.asserts import assert_close
from tests.families import TINY, tiny_family_model
from tests.multiproc import run
from tests.reference import expected_shard

SEQ = 16


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (4, SEQ), generator=gen)
    positions = torch.cat([torch.arange(6), torch.arange(10)]).expand(4, SEQ)
    return rewrite.microbatches(ids, 2, position_ids=positions)


def _plans(model) -> dict[str, dict]:
    tp2 = rewrite.plan_from_hf(model, tp=2).tensor_parallel
    tp4 = rewrite.plan_from_hf(model, tp=4).tensor_parallel
    return {
        "cp2 x tp2": {"mesh": {"cp": 2, "tp": 2}, "tensor_parallel": tp2, "pipeline": {"microbatches": 2}},
        "cp4": {"mesh": {"cp": 4}, "pipeline": {"microbatches": 2}},
        "pp2 x cp2": {"mesh": {"pp": 2, "cp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
        "dp2 x cp2 full": {"mesh": {"dp": 2, "cp": 2}, "data_parallel": {"sharding": "full"},
                           "pipeline": {"microbatches": 1}},
        "tp4": {"mesh": {"tp": 4}, "tensor_parallel": tp4, "pipeline": {"microbatches": 2}},
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _matches(tag: str, model, weights: dict) -> None:
    for name, param in model.named_parameters():
        assert torch.equal(_whole(param.data), expected_shard(model, name, weights[name])), f"{tag}: {name}"


def _checkpoints(rank: int, world: int, root: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    plans = _plans(tiny_family_model("llama"))
    stage = rewrite.apply_plan(tiny_family_model("llama"), plans["cp2 x tp2"])
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for step in range(2):
        rewrite.run_schedule(stage, *_batch(step))
        optimizer.step()
        optimizer.zero_grad()
    save_training_state(f"{root}/state", stage, optimizer, extra={"step": 2})
    rewrite.save_pretrained(stage, plans["cp2 x tp2"], f"{root}/hf")
    saved = AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32)
    weights = dict(saved.named_parameters())
    _matches("the Hugging Face save", stage.model, weights)
    inputs, targets = _batch(7)
    expected = sum(F.cross_entropy(saved(**x, use_cache=False).logits.flatten(0, 1), y.flatten(), ignore_index=-100)
                   for x, y in zip(inputs, targets)) / len(inputs)
    out = []
    for name in ("cp4", "pp2 x cp2", "dp2 x cp2 full", "tp4"):
        other = rewrite.apply_plan(tiny_family_model("llama", seed=5), plans[name])
        fresh = torch.optim.AdamW(other.parameters(), lr=1e-2)
        assert load_training_state(f"{root}/state", other, fresh) == {"step": 2}
        _matches(f"the training state under {name}", other.model, weights)
        per = len(inputs) // other.dp
        mine = slice(other.dp_rank * per, (other.dp_rank + 1) * per)
        loss = rewrite.run_schedule(other, inputs[mine], targets[mine])
        assert_close(f"{name} loss on the loaded weights", loss, expected.detach())
        out.append(f"{name}: {float(loss):.5f}")
    loaded = rewrite.from_pretrained(f"{root}/hf", plans["dp2 x cp2 full"])
    _matches("from_pretrained under dp2 x cp2", loaded.model, weights)
    return out


def test_context_parallel_checkpoints_save_and_load_under_other_plans(tmp_path):
    print(run(_checkpoints, 4, str(tmp_path), timeout_s=300)[0])
