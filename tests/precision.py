"""The bfloat16 recipe's step against one process computing in bfloat16: the check both the dense and the
expert-parallel mixed-precision tests make.

Where dp shards, FSDP2 casts (the one-process oracle: the model's own forward on a copy with bfloat16
parameters and the float32 buffers FSDP2 leaves alone: rotary frequencies rounded to bfloat16 would move
a mixture of experts' routing); elsewhere autocast does (the oracle: the float32 model's own forward under
the same autocast). The weights, gradients and AdamW state stay float32 in both.
"""

from __future__ import annotations

import copy

import torch

import rewrite
from rewrite.run.parity import reference_step
from tests.reference import expected_shard

BF16 = torch.bfloat16
# bfloat16 keeps 8 bits of mantissa (relative spacing 2^-8 = 3.9e-3): a sum split over ranks rounds
# differently from one process's, so gradients agree to about that, not to float32's 1e-5.
GRAD_RTOL = 2e-2
LOSS_RTOL = 5e-3


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30))


def check_bf16_step(model, plan: dict, cast_by: str, ids: list, targets: list, name: str) -> str:
    """Apply `plan` to the float32 `model` computing in bfloat16, run this replica's equal share of the global
    batch (`ids`, `targets`: every replica's microbatches, replica d's the d-th share) and check the loss and
    every gradient against one process running all of it in bfloat16, and away from float32. Collective."""
    exact = copy.deepcopy(model)  # float32 throughout: the run must be measurably away from it
    oracle = copy.deepcopy(model)
    if cast_by == "fsdp":  # FSDP2 casts the parameters it gathers, and leaves buffers (rotary frequencies) alone
        kept = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
        oracle.to(BF16)
        for name, buffer in oracle.named_buffers():
            buffer.data = kept[name]
    stage = rewrite.apply_plan(model, plan, compute_dtype=BF16)
    assert stage.precision is not None and stage.precision.by == cast_by, f"{name}: {stage.precision}"
    per = len(ids) // stage.dp
    mine = slice(stage.dp_rank * per, (stage.dp_rank + 1) * per)
    loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
    with torch.autocast("cpu", dtype=BF16, enabled=cast_by == "autocast"):
        expected = reference_step(oracle, ids, targets)
    reference_step(exact, ids, targets)  # its gradients, below
    ref = dict(oracle.named_parameters(remove_duplicate=False))
    off = abs(float(loss) - float(expected)) / abs(float(expected))
    assert off < LOSS_RTOL, f"{name}: loss {float(loss):.6f} vs one process in bfloat16 {float(expected):.6f}"
    ref32 = dict(exact.named_parameters(remove_duplicate=False))
    worst, away, where = 0.0, 0.0, ""
    for pname, param in model.named_parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, f"{name} {pname}: not float32 master"
        grad = whole(param.grad)
        off = relative(grad, expected_shard(model, pname, ref[pname].grad))
        worst, where = max((worst, where), (off, pname))
        away = max(away, relative(grad, expected_shard(model, pname, ref32[pname].grad)))
    assert worst < GRAD_RTOL, f"{name}: {where}'s gradient is {worst:.2e} (relative) from one process's in bfloat16"
    # Computed in bfloat16 indeed: float32 would agree with its own to 1e-6.
    assert away > 1e-3, f"{name}: {away:.2e} from float32, {worst:.2e} from bfloat16"
    return f"{float(loss):.5f} bf16-off {worst:.1e} fp32-off {away:.1e}"
