"""The bfloat16 recipe (`apply_plan(..., compute_dtype=torch.bfloat16)`) against one process computing in bfloat16.

Where dp shards, FSDP2 casts (the one-process oracle: the model's own forward on a bfloat16 copy);
elsewhere autocast does (the oracle: the float32 model's own forward under the same autocast).
The weights, gradients and AdamW state stay float32 in both.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.distributed.pipeline.test_pipeline import _batch
from tests.multiproc import run
from tests.reference import expected_shard

TP_RULES = "plans/llama-tp2.yaml"
BF16 = torch.bfloat16
# bfloat16 keeps 8 bits of mantissa (relative spacing 2^-8 = 3.9e-3): a sum split over ranks rounds
# differently from one process's, so gradients agree to about that, not to float32's 1e-5.
GRAD_RTOL = 2e-2
LOSS_RTOL = 5e-3


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))


def _step(rank: int, plan: dict, overrides: dict, cast_by: str) -> str:
    model = build_model(build_config("tiny-llama", **overrides), seed=3)
    exact = copy.deepcopy(model)  # float32 throughout: the run must be measurably away from it
    oracle = copy.deepcopy(model).to(BF16) if cast_by == "fsdp" else copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan, compute_dtype=BF16)
    name = f"rank {rank} {plan['mesh']} {plan['data_parallel']} {plan['pipeline']['schedule']}"
    assert stage.precision is not None and stage.precision.by == cast_by, f"{name}: {stage.precision}"
    per = 2
    ids, targets = _batch(build_config("tiny-llama", **overrides), per * stage.dp)
    mine = slice(stage.dp_rank * per, (stage.dp_rank + 1) * per)
    loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
    with torch.autocast("cpu", dtype=BF16, enabled=cast_by == "autocast"):
        expected = reference_step(oracle, ids, targets)
    reference_step(exact, ids, targets)  # its gradients, below
    off = abs(float(loss) - float(expected)) / abs(float(expected))
    assert off < LOSS_RTOL, f"{name}: loss {float(loss):.6f} vs one process in bfloat16 {float(expected):.6f}"
    ref = dict(oracle.named_parameters(remove_duplicate=False))
    ref32 = dict(exact.named_parameters(remove_duplicate=False))
    worst, away = 0.0, 0.0
    for pname, param in model.named_parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, f"{name} {pname}: not float32 master"
        grad = _whole(param.grad)
        worst = max(worst, _relative(grad, expected_shard(model, pname, ref[pname].grad)))
        away = max(away, _relative(grad, expected_shard(model, pname, ref32[pname].grad)))
    assert worst < GRAD_RTOL, f"{name}: a gradient is {worst:.2e} (relative) from one process's in bfloat16"
    # Computed in bfloat16 indeed: float32 would agree with its own to 1e-6.
    assert away > 1e-3, f"{name}: {away:.2e} from float32, {worst:.2e} from bfloat16"
    return f"{float(loss):.5f} bf16-off {worst:.1e} fp32-off {away:.1e}"


def _cases(rank: int, ws: int, cases: list) -> list[str]:
    out = []
    for mesh, sharding, schedule, k, overrides, cast_by in cases:
        tp = rewrite.load_plan(TP_RULES).tensor_parallel if mesh.get("tp", 1) > 1 else {}
        sharding, _, reduce = sharding.partition(" ")
        plan = {"mesh": mesh, "tensor_parallel": tp,
                "pipeline": {"schedule": schedule, "virtual_stages": k, "microbatches": 2},
                "data_parallel": {"sharding": sharding, **({"reduce": reduce} if reduce else {})}}
        out.append(_step(rank, plan, overrides, cast_by))
    return out


TIED = {"tie_word_embeddings": True}
CASES = {
    # FSDP2 casts: bfloat16 crosses the stages; reduced per step or per microbatch, tied or not.
    "sharded": [({"dp": 2, "pp": 2}, "full", "1f1b", 1, {}, "fsdp"),
                ({"dp": 2, "pp": 2}, "grad_op", "zbv", 2, TIED, "fsdp"),
                ({"dp": 2, "tp": 2}, "full microbatch", "afab", 1, {}, "fsdp")],
    # Autocast: no dp, DDP, FSDP2's replicate over two stages per rank.
    "autocast": [({"pp": 2, "tp": 2}, "full", "1f1b", 1, TIED, "autocast"),
                 ({"dp": 2, "tp": 2}, "replicate", "afab", 1, {}, "autocast"),
                 ({"dp": 2, "pp": 2}, "replicate", "interleaved-1f1b", 2, {}, "autocast")],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_recipe_matches_one_process_in_bfloat16(case):
    results = run(_cases, 4, CASES[case], timeout_s=240)
    print(case, results[0])
