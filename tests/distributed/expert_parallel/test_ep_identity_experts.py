"""Experts with identity experts beside them (LongCat-Flash: 4 routed experts, then 2 that return the row
itself, weighted; its gate_up_proj holds rows for all 6, down_proj for the 4) split over ep 2: each rank
holds every other routed expert and one identity row (blocks of gcd(4, 2) = 2 experts), rows routed to an
identity expert stay on their rank, and a step equals one process (loss and every gradient, fp32, 1e-5)
under dp 4 ep 2 with checkpointed layers and under pp 2 x dp 2 ep 2; its Hugging Face save loads in plain
transformers as the stage's weights (the identity experts' rows included), and its training state
resumes with the experts whole (dp 4, ep 1) with the loss of one process on them, and `from_pretrained`
reads it back under ep 2."""

from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

import rewrite
from rewrite.checkpoint.training_state import load_training_state, save_training_state
from tests.asserts import assert_close
from tests.families import TINY, tiny_moe_model
from tests.multiproc import run
from tests.reference import assert_replica_step, assert_shares_of

RULE = {"model.layers.*.mlp.experts": "expert_parallel"}
PLANS = {
    "dp4 ep2 recompute": {"mesh": {"dp": 4, "ep": 2}, "activation_checkpointing": {"model.layers.*": "full"}},
    "pp2 x dp2 ep2": {"mesh": {"pp": 2, "dp": 2, "ep": 2}, "pipeline": {"schedule": "1f1b"}},
    "dp4 ep1": {"mesh": {"dp": 4}},
}


def _plan(name: str) -> dict:
    return {**PLANS[name], "tensor_parallel": RULE, "pipeline": {"microbatches": 2, **PLANS[name].get("pipeline", {})}}


def _batch(seed: int, rows: int = 8):
    ids = torch.randint(0, TINY["vocab_size"], (rows, 16), generator=torch.Generator().manual_seed(seed))
    return rewrite.microbatches(ids, 4)


def _chosen(model, inputs: list) -> torch.Tensor:
    """Every expert id the routers of `model` (one process) choose for `inputs`."""
    ids = []
    hooks = [m.register_forward_hook(lambda mod, args, out: ids.append(args[1].reshape(-1)))
             for n, m in model.named_modules() if n.endswith("mlp.experts")]
    with torch.no_grad():
        for x in inputs:
            model(input_ids=x, use_cache=False)
    for hook in hooks:
        hook.remove()
    return torch.cat(ids)


def _longcat(seed: int = 0):
    """The tiny LongCat, its routers' correction bias (a stored buffer steering the choice) set away from 0."""
    model = tiny_moe_model("longcat_flash", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    return model


def _mine(stage, inputs: list, targets: list) -> tuple[list, list]:
    per = len(inputs) // stage.dp
    return inputs[stage.dp_rank * per:(stage.dp_rank + 1) * per], targets[stage.dp_rank * per:(stage.dp_rank + 1) * per]


def _identity_experts(rank: int, world: int, root: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    out = []
    inputs, targets = _batch(3)
    for name in ("dp4 ep2 recompute", "pp2 x dp2 ep2"):
        model = _longcat()
        reference = copy.deepcopy(model)
        hit = set(_chosen(reference, inputs).tolist())  # identity experts, and routed ones on both ep ranks
        assert hit & {4, 5} and hit & {0, 2} and hit & {1, 3}, hit
        stage = rewrite.apply_plan(model, _plan(name))
        held = {(m.gate_up_proj.shape[0], m.down_proj.shape[0]) for m in model.modules() if hasattr(m, "expert_shard")}
        assert held == {(3, 2)}, (name, held)
        loss = assert_replica_step(stage, model, reference, inputs, targets, f"longcat {name} rank {rank}")
        out.append(f"{name}: {float(loss):.5f}")
        if stage.mesh.pp > 1:
            continue
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
        optimizer.step()
        optimizer.zero_grad()
        save_training_state(f"{root}/state", stage, optimizer, extra={"step": 1})
        rewrite.save_pretrained(stage, _plan(name), f"{root}/hf")
        saved = AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32)
        assert_shares_of("the Hugging Face save", stage.model, saved)
    other = rewrite.apply_plan(_longcat(seed=5), _plan("dp4 ep1"))
    assert load_training_state(f"{root}/state", other, torch.optim.AdamW(other.parameters(), lr=1e-2)) == {"step": 1}
    assert_shares_of("the training state under dp4 ep1", other.model, saved)
    inputs, targets = _batch(7)
    expected = sum(F.cross_entropy(saved(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
                   for x, y in zip(inputs, targets)) / len(inputs)
    resumed = rewrite.run_schedule(other, *_mine(other, inputs, targets))
    assert_close("dp4 ep1 loss on the loaded weights", resumed, expected.detach())
    loaded = rewrite.from_pretrained(f"{root}/hf", _plan("dp4 ep2 recompute"))  # each rank reads its rows only
    assert_shares_of("from_pretrained under dp4 ep2", loaded.model, saved)
    return out + [f"resumed: {float(resumed):.5f}"]


def test_identity_experts_split_in_blocks_train_save_and_resume(tmp_path):
    print(run(_identity_experts, 4, str(tmp_path), timeout_s=300)[0])
