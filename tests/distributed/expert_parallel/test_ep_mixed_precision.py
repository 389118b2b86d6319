"""Experts split over ep in the bfloat16 recipe (`compute_dtype=torch.bfloat16` over float32 weights): FSDP2
leaves the experts it does not hold alone, so each rank's experts cast their own weights as they compute
(gradients and AdamW state float32); under replicate autocast casts, as in one process. A step equals one
process computing in bfloat16 (`tests/precision.py`: loss, every gradient, float32, and measurably away
from float32's) on Qwen3-MoE under dp 2 ep 2 full and replicate and pp 2 x dp 2 ep 2, on Llama 4's
every-token experts and LongCat's identity experts."""

from __future__ import annotations

import re

import torch

from tests.families import TINY, tiny_moe_model
from tests.multiproc import run
from tests.precision import check_bf16_step

CASES = [
    ("qwen3_moe", {"mesh": {"dp": 2, "ep": 2}}, "fsdp"),
    ("qwen3_moe", {"mesh": {"dp": 2, "ep": 2}, "data_parallel": {"sharding": "replicate"}}, "autocast"),
    ("llama4_text", {"mesh": {"dp": 2, "ep": 2}}, "fsdp"),
    ("longcat_flash", {"mesh": {"dp": 2, "ep": 2}}, "fsdp"),
]
PIPELINE = ("qwen3_moe", {"mesh": {"pp": 2, "dp": 2, "ep": 2}, "pipeline": {"schedule": "1f1b"}}, "fsdp")


def _rules(model) -> dict:
    """Every experts module split by expert."""
    return {re.sub(r"\.\d+\.", ".*.", n): "expert_parallel" for n, _ in model.named_modules() if n.endswith(".experts")}


def _cases(rank: int, world: int, cases: list) -> list[str]:
    out = []
    for family, layout, cast_by in cases:
        model = tiny_moe_model(family)
        plan = {**layout, "tensor_parallel": _rules(model), "pipeline": {"microbatches": 2, **layout.get("pipeline", {})}}
        gen = torch.Generator().manual_seed(4)
        ids = [torch.randint(0, TINY["vocab_size"], (2, 16), generator=gen) for _ in range(4)]
        targets = [torch.randint(0, TINY["vocab_size"], (2, 16), generator=gen) for _ in range(4)]
        name = f"{family} {layout['mesh']} rank {rank}"
        out.append(f"{name}: " + check_bf16_step(model, plan, cast_by, ids, targets, name))
    return out


def test_experts_split_over_ep_compute_in_bfloat16():
    print(run(_cases, 2, CASES, timeout_s=300)[0])
    print(run(_cases, 4, [PIPELINE], timeout_s=300)[0])
