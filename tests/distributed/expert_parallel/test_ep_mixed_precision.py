"""Experts split over ep in the bfloat16 recipe (`compute_dtype=torch.bfloat16` over float32 weights).

FSDP2 leaves the experts it does not hold alone, so each rank's experts cast their own weights as they
compute (gradients and AdamW state float32); under replicate autocast casts, as in one process. The
reference is the same mesh without ep, where FSDP2's policy (or autocast) casts the experts with
everything else: the loss and every gradient agree to bfloat16's rounding (each expert now sums the
rows of both ranks in one product), are float32, and are measurably away from a float32 step. On
Qwen3-MoE (full and replicate sharding, and pp 2 x dp 2 ep 2), Llama 4's every-token experts and
LongCat's identity experts.

(One process computing in bfloat16 is not the reference here: on these tiny random MoEs it differs
from the same mesh without ep by as much as bfloat16 differs from float32 on a few norm weights, with
ep or without.)"""

from __future__ import annotations

import copy
import re

import torch

import rewrite
from rewrite.run.parity import reference_step
from tests.families import TINY, tiny_moe_model
from tests.multiproc import run
from tests.precision import BF16, GRAD_RTOL, LOSS_RTOL, relative, whole
from tests.reference import expected_shard

CASES = [
    ("qwen3_moe", {"mesh": {"dp": 2}}),
    ("qwen3_moe", {"mesh": {"dp": 2}, "data_parallel": {"sharding": "replicate"}}),
    ("llama4_text", {"mesh": {"dp": 2}}),
    ("longcat_flash", {"mesh": {"dp": 2}}),
]
PIPELINE = ("qwen3_moe", {"mesh": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b"}})


def _rules(model) -> dict:
    """Every experts module split by expert."""
    return {re.sub(r"\.\d+\.", ".*.", n): "expert_parallel" for n, _ in model.named_modules() if n.endswith(".experts")}


def _plan(layout: dict, rules: dict, ep: int) -> dict:
    return {**layout, "mesh": {**layout["mesh"], **({"ep": ep} if ep > 1 else {})}, "tensor_parallel": rules,
            "pipeline": {"microbatches": 2, **layout.get("pipeline", {})}}


def _cases(rank: int, world: int, cases: list) -> list[str]:
    out = []
    for family, layout in cases:
        model = tiny_moe_model(family)
        whole_experts, exact = copy.deepcopy(model), copy.deepcopy(model)
        gen = torch.Generator().manual_seed(4)
        ids = [torch.randint(0, TINY["vocab_size"], (2, 16), generator=gen) for _ in range(4)]
        targets = [torch.randint(0, TINY["vocab_size"], (2, 16), generator=gen) for _ in range(4)]
        split = rewrite.apply_plan(model, _plan(layout, _rules(model), 2), compute_dtype=BF16)
        kept = rewrite.apply_plan(whole_experts, _plan(layout, {}, 1), compute_dtype=BF16)
        name = f"{family} {layout} rank {rank}"
        assert split.precision == kept.precision, name
        per = len(ids) // split.dp
        mine = slice(split.dp_rank * per, (split.dp_rank + 1) * per)
        loss = rewrite.run_schedule(split, ids[mine], targets[mine])
        expected = rewrite.run_schedule(kept, ids[mine], targets[mine])
        reference_step(exact, ids, targets)
        assert abs(float(loss) - float(expected)) <= LOSS_RTOL * abs(float(expected)), (name, loss, expected)
        ref = {n: whole(p.grad) for n, p in whole_experts.named_parameters()}
        ref32 = {n: p.grad for n, p in exact.named_parameters()}
        worst, away, where = 0.0, 0.0, ""
        for pname, param in model.named_parameters():
            assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, f"{name} {pname}: not float32"
            grad = whole(param.grad)
            worst, where = max((worst, where), (relative(grad, expected_shard(model, pname, ref[pname])), pname))
            away = max(away, relative(grad, expected_shard(model, pname, ref32[pname])))
        assert worst < GRAD_RTOL, f"{name}: {where}'s gradient is {worst:.2e} (relative) from the experts kept whole"
        assert away > 1e-3, f"{name}: {away:.2e} from float32: not computed in bfloat16"
        out.append(f"{name} ({split.precision.by}): loss {float(loss):.5f}, off {worst:.1e}, from float32 {away:.1e}")
    return out


def test_experts_split_over_ep_compute_in_bfloat16():
    print(run(_cases, 2, CASES, timeout_s=300)[0])
    print(run(_cases, 4, [PIPELINE], timeout_s=300)[0])
