"""`packed_column` (transformers' packed_colwise): a fused gate_up_proj splits each of its two parts
over tp, so `chunk(2)` still gives a rank its slice of gate and of up. Against one process (Phi-3,
tiny): the step's loss and every gradient under tp 2 x dp 2 (full) and tp 2 x pp 2; the HF save
loads in plain transformers and back under the packed plan; a training state saved packed resumes
under plans with and without packing."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import rewrite
from rewrite.run.parity import reference_step
from rewrite.tensor_parallel.layers import ColumnParallelLinear
from tests.asserts import assert_close
from tests.families import TINY, tiny_family_model
from tests.multiproc import run
from tests.reference import expected_shard

PACKED = {"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "row"}
PLANS = {
    "tp2 x dp2": {"mesh": {"tp": 2, "dp": 2}, "data_parallel": {"sharding": "full"}, "tensor_parallel": PACKED},
    "tp2 x pp2": {"mesh": {"tp": 2, "pp": 2}, "tensor_parallel": PACKED,
                  "pipeline": {"schedule": "1f1b", "microbatches": 2}},
}
RESUMED = {"pp2 x dp2": {"mesh": {"pp": 2, "dp": 2}}, "tp2 x pp2 packed": PLANS["tp2 x pp2"]}


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _adamw(params):
    # eps large: AdamW's first step is then nearly linear in the gradient (see test_data_parallel).
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def _packed(rank: int, world: int, ckpt: str, hf: str) -> str:
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(4)]
    targets = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(4)]
    stepped = None
    for name, plan in PLANS.items():
        model = tiny_family_model("phi3")
        reference = copy.deepcopy(model)
        stage = rewrite.apply_plan(model, plan)
        packed = [m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.parts == 2]
        assert packed and all(m.weight.shape[0] == 128 for m in packed), packed  # [gate_r; up_r] each
        dp, dp_rank = stage.mesh.dp, stage.mesh.dp_rank
        count = len(ids) // dp
        mine = slice(dp_rank * count, (dp_rank + 1) * count)
        loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
        tag = f"{name} rank {rank}"
        assert_close(f"{tag} loss", loss, reference_step(reference, ids, targets))
        ref = dict(reference.named_parameters())
        for pname, param in model.named_parameters():
            assert_close(f"{tag} {pname}.grad", _whole(param.grad), expected_shard(model, pname, ref[pname].grad))
        optimizer, ref_optimizer = _adamw(stage.parameters()), _adamw(reference.parameters())
        optimizer.step()
        ref_optimizer.step()
        if name == "tp2 x dp2":
            rewrite.save_training_state(ckpt, stage, optimizer, step=1)
            stepped = reference
        else:
            rewrite.save_pretrained(stage, plan, hf)
    ref = dict(stepped.named_parameters())
    loaded = rewrite.from_pretrained(hf, PLANS["tp2 x dp2"])  # the save read back packed, dp-sharded
    for pname, param in loaded.model.named_parameters():
        assert_close(f"loaded rank {rank} {pname}", _whole(param.detach()), expected_shard(loaded.model, pname, ref[pname].detach()))
    for name, plan in RESUMED.items():  # the packed boxes, read by plans that cut them otherwise
        model = tiny_family_model("phi3", seed=9)
        stage = rewrite.apply_plan(model, plan)
        optimizer = _adamw(stage.parameters())
        rewrite.load_training_state(ckpt, stage, optimizer)
        for pname, param in model.named_parameters():
            assert_close(f"{name} rank {rank} {pname}", _whole(param.detach()), expected_shard(model, pname, ref[pname].detach()))
        assert optimizer.state, name
    return "ok"


def test_packed_column_trains_saves_and_resumes(tmp_path):
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    assert run(_packed, 4, str(ckpt), str(hf), timeout_s=240) == ["ok"] * 4
    reference = tiny_family_model("phi3")
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(4)]
    targets = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(4)]
    reference_step(reference, ids, targets)
    _adamw(reference.parameters()).step()
    loaded = AutoModelForCausalLM.from_pretrained(hf)
    for name, tensor in reference.state_dict().items():
        assert_close(f"saved {name}", loaded.state_dict()[name], tensor)


def test_packed_column_is_checked_when_the_plan_is_bound():
    model = tiny_family_model("phi3")
    resolved = rewrite.resolve({"mesh": {"tp": 2}, "tensor_parallel": PACKED}, model)
    spec = next(s for s in resolved.shards if s.fqn == "model.layers.0.mlp.gate_up_proj")
    assert (spec.style, spec.weight_shape) == ("packed_column", (128, 64))
    with pytest.raises(rewrite.PlanError) as err:  # 256 features: 2 parts of 128, not divisible by 3
        rewrite.resolve({"mesh": {"tp": 3}, "tensor_parallel": PACKED}, model)
    assert "out_features=256 must be 2 equal parts, each divisible by mesh.tp=3" in str(err.value)
    from rewrite.plan.styles import STYLES
    assert "packed_column" in STYLES
    with pytest.raises(ValueError, match="parts=2 needs gather_output=False"):
        ColumnParallelLinear(4, 8, parts=2)
