"""What the expert checkpoint tests share: a rewritten model's weights against a saved checkpoint's, and a
training state resumed under other plans with the loss of one process on the saved weights."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

import rewrite
from rewrite.checkpoint.training_state import load_training_state, save_training_state
from tests.asserts import assert_close
from tests.families import TINY, tiny_moe_model
from tests.reference import expected_shard


def matches(tag: str, model, weights: dict) -> None:
    """Every parameter of the rewritten `model` is exactly its share of `weights` (a whole model's)."""
    for name, param in model.named_parameters():
        whole = param.data.full_tensor() if hasattr(param.data, "full_tensor") else param.data
        assert torch.equal(whole, expected_shard(model, name, weights[name])), f"{tag}: {name}"


def mine(stage, inputs: list, targets: list) -> tuple[list, list]:
    """This replica's equal share of the microbatches."""
    per = len(inputs) // stage.dp
    return inputs[stage.dp_rank * per:(stage.dp_rank + 1) * per], targets[stage.dp_rank * per:(stage.dp_rank + 1) * per]


def resumes(root: str, names: tuple[str, ...], plan_of: Callable, batch: tuple[list, list]) -> list[str]:
    """The training state at `root`/state loaded into a fresh Qwen3-MoE under each plan `plan_of(name, model)`:
    exactly the weights of the Hugging Face save at `root`/hf, and one process's loss on them over `batch`."""
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32)
    weights, (inputs, targets) = dict(saved.named_parameters()), batch
    expected = sum(F.cross_entropy(saved(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
                   for x, y in zip(inputs, targets)) / len(inputs)
    out = []
    for name in names:
        model = tiny_moe_model("qwen3_moe", seed=5)
        other = rewrite.apply_plan(model, plan_of(name, model))
        fresh = torch.optim.AdamW(other.parameters(), lr=1e-2)
        assert load_training_state(f"{root}/state", other, fresh) == {"step": 2}
        matches(f"the training state under {name}", other.model, weights)
        loss = rewrite.run_schedule(other, *mine(other, inputs, targets))
        assert_close(f"{name} loss on the loaded weights", loss, expected.detach())
        out.append(f"{name}: {float(loss):.5f}")
    return out


def batch(seed: int, rows: int = 8) -> tuple[list, list]:
    """4 microbatches of `rows` random rows of 16 tokens."""
    ids = torch.randint(0, TINY["vocab_size"], (rows, 16), generator=torch.Generator().manual_seed(seed))
    return rewrite.microbatches(ids, 4)


def saved_weights(root: str) -> dict:
    """The parameters of the Hugging Face save at `root`/hf, as plain transformers loads them."""
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32).named_parameters())


def train_and_save(root: str, plan) -> tuple:
    """A Qwen3-MoE stage under `plan` trained two steps (AdamW), its training state saved at `root`/state and
    its Hugging Face checkpoint at `root`/hf, which plain transformers loads as exactly its weights. Returns
    the stage and those weights."""
    stage = rewrite.apply_plan(tiny_moe_model("qwen3_moe"), plan)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for step in range(2):
        rewrite.run_schedule(stage, *mine(stage, *batch(step)))
        optimizer.step()
        optimizer.zero_grad()
    save_training_state(f"{root}/state", stage, optimizer, extra={"step": 2})
    rewrite.save_pretrained(stage, plan, f"{root}/hf")
    weights = saved_weights(root)
    matches("the Hugging Face save", stage.model, weights)
    return stage, weights
