"""Bad input fails on every rank alike, before any collective, and changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rewrite
from rewrite.run.presets import build_model
from tests.multiproc import run


def _expect_error(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    raise AssertionError("expected a ValueError")


def _bad_plans(rank: int, ws: int) -> list[str]:
    model = build_model("tiny-llama")
    before = [(n, type(m)) for n, m in model.named_modules()]
    messages = [
        _expect_error(lambda: rewrite.apply_plan(model, "plans/llama-tp4.yaml")),
        _expect_error(lambda: rewrite.apply_plan(model, {"mesh": {"tp": 2}, "tensor_parallel": {"model.nope": "row"}})),
    ]
    assert [(n, type(m)) for n, m in model.named_modules()] == before, "a refused plan changed the model"
    # The group still works: nobody was left inside a collective.
    flag = torch.ones(1)
    dist.all_reduce(flag)
    assert flag.item() == ws
    return messages


def test_refused_plans_fail_on_every_rank():
    results = run(_bad_plans, 2, timeout_s=60)
    for messages in results:
        assert "needs pp=1 x tp=4 = 4 ranks, but the world size is 2" in messages[0]
        assert "tensor_parallel['model.nope'] matches no module" in messages[1]


def _bad_steps(rank: int, ws: int) -> list[str]:
    model = build_model("tiny-llama")
    stage = rewrite.apply_plan(model, "plans/llama-pp2.yaml")
    ids = [torch.randint(0, 256, (2, 8)) for _ in range(4 if rank == 0 else 3)]
    targets = [torch.zeros(2, 8, dtype=torch.long)] * len(ids)
    messages = [_expect_error(lambda: rewrite.run_afab(stage, ids, targets))]
    ids = [torch.randint(0, 256, (2, 8)) for _ in range(2)]
    bad_targets = [torch.zeros(2, 8, dtype=torch.long)] if stage.is_last else None
    messages.append(_expect_error(lambda: rewrite.run_afab(stage, ids, bad_targets)))
    # After refusing, a good step still runs.
    loss = rewrite.run_afab(stage, ids, [torch.zeros(2, 8, dtype=torch.long)] * 2)
    assert torch.isfinite(loss)
    return messages


def test_bad_steps_fail_on_every_rank():
    first, last = run(_bad_steps, 2, timeout_s=60)
    for messages in (first, last):
        assert "ranks disagree on the number of microbatches (3 to 4)" in messages[0]
    assert "rank(s) [1] rejected their inputs" in first[1]
    assert "targets must be a list with one tensor per microbatch (2), got 1" in last[1]


def test_no_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"torch.distributed is not initialised: call .*init_process_group"):
        rewrite.apply_plan(build_model("tiny-llama", device="meta"), "plans/llama-tp2.yaml")
