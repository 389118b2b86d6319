"""The bfloat16 recipe (`apply_plan(..., compute_dtype=torch.bfloat16)`) against one process computing in
bfloat16 (`tests/precision.py`: FSDP2 casts where dp shards, autocast elsewhere)."""

from __future__ import annotations

import pytest

import rewrite
from rewrite.run.presets import build_config, build_model
from tests.distributed.pipeline.test_pipeline import _batch
from tests.multiproc import run
from tests.precision import check_bf16_step

TP_RULES = "plans/llama-tp2.yaml"


def _step(rank: int, plan: dict, overrides: dict, cast_by: str) -> str:
    model = build_model(build_config("tiny-llama", **overrides), seed=3)
    name = f"rank {rank} {plan['mesh']} {plan['data_parallel']} {plan['pipeline']['schedule']}"
    dp = plan["mesh"].get("dp", 1)
    ids, targets = _batch(build_config("tiny-llama", **overrides), 2 * dp)
    return check_bf16_step(model, plan, cast_by, ids, targets, name)


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
