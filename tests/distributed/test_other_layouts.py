"""Families whose parts have other names (GPT-NeoX, GPT-J) or are found by kind (LFM2, tied, with
convolution layers) compose like LLaMA: tp 2 x pp 2 with vocabulary-parallel loss, and dp 2 x pp 2
(full sharding), each step's loss and gradients equal one process; the tp x pp save loads in plain
transformers equal to the model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import rewrite
from rewrite.run.parity import reference_step
from tests.asserts import assert_close
from tests.families import TINY, tiny_family_model
from tests.multiproc import run
from tests.reference import expected_shard


def _plans(model) -> dict[str, dict]:
    tp_pp = rewrite.plan_from_hf(model, tp=2, pp=2, microbatches=2, schedule="1f1b", loss_parallel=True)
    dp_pp = {"mesh": {"dp": 2, "pp": 2}, "data_parallel": {"sharding": "full"},
             "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    return {"tp2 x pp2": tp_pp.model_dump(mode="json", exclude_none=True), "dp2 x pp2": dp_pp}


def _compose(rank: int, world: int, family: str, out: str) -> str:
    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(4)]
    targets = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(4)]
    for name, plan in _plans(tiny_family_model(family)).items():
        model = tiny_family_model(family)
        reference = copy.deepcopy(model)
        stage = rewrite.apply_plan(model, plan)
        dp, dp_rank = stage.mesh.dp, stage.mesh.dp_rank
        batch = slice(0, 2 * dp)  # 2 microbatches per replica; the global batch is the reference's
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)
        loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
        tag = f"{family} {name} rank {rank}"
        assert_close(f"{tag} loss", loss, reference_step(reference, ids[batch], targets[batch]))
        ref = dict(reference.named_parameters(remove_duplicate=False))
        for pname, param in model.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            assert_close(f"{tag} {pname}.grad", grad, expected_shard(model, pname, ref[pname].grad))
        if dp == 1:
            rewrite.save_pretrained(stage, plan, out)
    return "ok"


@pytest.mark.parametrize("family", ["gpt_neox", "gptj", "lfm2"])
def test_other_layouts_compose_and_save(family, tmp_path):
    assert run(_compose, 4, family, str(tmp_path), timeout_s=240) == ["ok"] * 4
    model = tiny_family_model(family)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
