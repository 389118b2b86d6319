"""`sharding: replicate` on torch's DDP (one stage per rank, whole backwards) against one process:
several steps with AdamW, accumulation over steps, which schedules take DDP, clipping, and the
refusal of a parameter the step never reaches."""

from __future__ import annotations

import copy

import torch
from torch import nn

import rewrite
from rewrite.data_parallel import DdpSync, GradSync
from rewrite.estimate.dp_time import DpTime
from rewrite.estimate.step_time import stage_parameters
from rewrite.schedules import splits_backward
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.distributed.pipeline.test_pipeline import _batch
from tests.unit.estimate.test_step_time import UNIT
from tests.multiproc import run

PER_REPLICA = 2


def _plan(**pipeline) -> dict:
    return {"mesh": {"dp": 2}, "data_parallel": {"sharding": "replicate"},
            "pipeline": {"microbatches": PER_REPLICA, **pipeline}}


def _mine(stage, ids, targets):
    at = slice(stage.dp_rank * PER_REPLICA, (stage.dp_rank + 1) * PER_REPLICA)
    return ids[at], targets[at]


def _grads_match(name: str, model: nn.Module, reference: nn.Module) -> None:
    ref = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        assert not hasattr(param, "to_local"), f"{pname}: DDP keeps plain parameters"
        assert_close(f"{name} {pname}.grad", param.grad, ref[pname].grad)


def _steps(rank: int, world: int) -> list[str]:
    config = build_config("tiny-llama")
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, _plan())
    assert stage.finishing(DdpSync) is not None and stage.finishing(DdpSync).ddp is None  # built at the first step
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2, eps=1e-3)  # eps: see test_data_parallel
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-3)
    losses = []
    for step in range(3):
        ids, targets = _batch(config, PER_REPLICA * 2, seed=step)
        loss = rewrite.run_schedule(stage, *_mine(stage, ids, targets))
        assert_close(f"step {step} loss", loss, reference_step(reference, ids, targets))
        _grads_match(f"step {step}", model, reference)
        norm = rewrite.clip_grad_norm_(stage, 0.5)  # counted once over the replicas
        assert_close(f"step {step} norm", norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
        losses.append(f"{float(loss):.6f}")
    # Two steps without zero_grad accumulate, as two backwards would on one process.
    for step in (3, 4):
        ids, targets = _batch(config, PER_REPLICA * 2, seed=step)
        rewrite.run_schedule(stage, *_mine(stage, ids, targets))
        reference_step(reference, ids, targets)
    _grads_match("accumulated over 2 steps", model, reference)
    return losses


_SCHEDULES = {
    "afab": {}, "1f1b": {"schedule": "1f1b"}, "zero-bubble": {"schedule": "zero-bubble"},
    "interleaved-1f1b": {"schedule": "interleaved-1f1b", "virtual_stages": 2},
}


def _which_sync(rank: int, world: int) -> dict:
    config = build_config("tiny-llama")
    out = {}
    for name, pipeline in _SCHEDULES.items():
        plan = {**_plan(**pipeline), "mesh": {"dp": 2, "pp": 2}}
        model = build_model(config, seed=3)
        reference = copy.deepcopy(model)
        stage = rewrite.apply_plan(model, plan)
        out[name] = type(stage.grad_finish[0]).__name__  # the data-parallel reduce comes first
        ids, targets = _batch(config, PER_REPLICA * 2)
        loss = rewrite.run_schedule(stage, *_mine(stage, ids, targets))
        assert_close(f"{name} loss", loss, reference_step(reference, ids, targets))
        ref = dict(reference.named_parameters())
        for pname, param in model.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            assert_close(f"{name} {pname}.grad", grad, ref[pname].grad)
    return out


def _unused(rank: int, world: int) -> str:
    model = build_model(build_config("tiny-llama"), seed=3)
    model.model.register_parameter("unused", nn.Parameter(torch.zeros(4)))  # trainable, read by nothing
    stage = rewrite.apply_plan(model, _plan())
    ids, targets = _batch(build_config("tiny-llama"), PER_REPLICA * 2)
    try:
        rewrite.run_schedule(stage, *_mine(stage, ids, targets))
    except RuntimeError as exc:
        return str(exc)
    return "ran"


def test_replicate_on_ddp_matches_one_process_over_steps():
    first, second = run(_steps, 2, timeout_s=180)
    assert first == second


def test_schedules_take_ddp_where_the_last_backward_reaches_every_parameter():
    per_rank = run(_which_sync, 4, timeout_s=240)
    assert all(r == per_rank[0] for r in per_rank)
    ddp, fsdp = DdpSync.__name__, GradSync.__name__
    assert per_rank[0] == {"afab": ddp, "1f1b": ddp, "zero-bubble": fsdp, "interleaved-1f1b": fsdp}
    # The step model prices each as it runs: DDP's buckets, or FSDP2's replicate unit by unit.
    meta = build_model(build_config("tiny-llama"), device="meta")
    for name, pipeline in _SCHEDULES.items():
        resolved = rewrite.resolve({**_plan(**pipeline), "mesh": {"dp": 2, "pp": 2}}, meta)
        dp_time = DpTime(resolved, stage_parameters(resolved, meta)[0], UNIT, 8)
        split = splits_backward(resolved.plan.pipeline.schedule, None)
        assert dp_time.on_ddp("replicate", split) == (per_rank[0][name] == ddp) != dp_time.on_fsdp("replicate", split)


def test_a_parameter_the_step_never_reaches_is_refused_on_every_rank():
    first, second = run(_unused, 2, timeout_s=120)
    assert first == second
    assert "the step's last backward did not reach every trainable parameter (model.unused)" in first
    assert "requires_grad_(False)" in first
