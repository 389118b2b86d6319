"""Bad input fails on every rank alike, before any collective, and changes nothing."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import rewrite
from rewrite.run.presets import build_model
from tests.multiproc import run


def _expect_error(fn) -> str:
    try:
        fn()
    except rewrite.RewriteError as exc:  # every refusal; still the ValueError callers caught before
        assert isinstance(exc, ValueError), type(exc)
        return str(exc)
    raise AssertionError("expected a refusal (rewrite.RewriteError)")


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
    messages = [_expect_error(lambda: rewrite.run_schedule(stage, ids, targets))]
    ids = [torch.randint(0, 256, (2, 8)) for _ in range(2)]
    bad_targets = [torch.zeros(2, 8, dtype=torch.long)] if stage.is_last else None
    messages.append(_expect_error(lambda: rewrite.run_schedule(stage, ids, bad_targets)))
    whole = torch.randint(0, 256, (8, 8))  # the batch itself, not cut into microbatches
    messages.append(_expect_error(lambda: rewrite.run_schedule(stage, whole, whole)))
    # After refusing, a good step still runs.
    loss = rewrite.run_schedule(stage, ids, [torch.zeros(2, 8, dtype=torch.long)] * 2)
    assert torch.isfinite(loss)
    return messages


def test_bad_steps_fail_on_every_rank():
    first, last = run(_bad_steps, 2, timeout_s=60)
    assert first == last, "every rank raises the same error"
    assert "ranks were given different microbatches (rank 0: 4 x [2, 8] int64; rank 1: 3 x [2, 8] int64)" in first[0]
    assert "rank 1: targets must be a list with one tensor per microbatch (2), got 1" in first[1]
    assert ("inputs must be a non-empty list of tensors, one per microbatch (on every rank), got a tensor of shape "
            "[8, 8]; cut a [batch, seq] batch of token ids with `inputs, targets = rewrite.microbatches(ids, "
            "stage.resolved.plan.pipeline.microbatches") in first[2]


def _timed_error(fn) -> tuple[str, float]:
    start = time.perf_counter()
    message = _expect_error(fn)
    return message, time.perf_counter() - start


def _fail_together(rank: int, ws: int) -> dict[str, tuple[str, float]]:
    """tp 2 x pp 2: each way a rank can differ from its peers, then a good step."""
    model = build_model("tiny-llama", seed=0)
    before = [(n, type(m)) for n, m in model.named_modules()]
    got = {}
    plan = "plans/llama-tp4.yaml" if rank == 3 else "plans/llama-tp2-pp2.yaml"
    got["plan"] = _timed_error(lambda: rewrite.apply_plan(model, plan))
    assert [(n, type(m)) for n, m in model.named_modules()] == before, "a refused plan changed the model"
    stage = rewrite.apply_plan(model, "plans/llama-tp2-pp2.yaml")
    got["twice"] = _timed_error(lambda: rewrite.apply_plan(model, "plans/llama-tp2-pp2.yaml"))

    def ids(shape=(2, 16), high=256):
        torch.manual_seed(1)
        return [torch.randint(0, high, shape) for _ in range(4)]

    shape = (4, 8) if rank >= 2 else (2, 16)  # same number of tokens, other shapes
    got["shapes"] = _timed_error(lambda: rewrite.run_schedule(stage, ids(shape), ids(shape)))
    big = ids()
    big[2][1, 3] = 300
    got["target 300"] = _timed_error(lambda: rewrite.run_schedule(stage, ids(), big))
    negative = ids()
    negative[0][0, 0] = -7
    got["target -7"] = _timed_error(lambda: rewrite.run_schedule(stage, ids(), negative))
    got["float inputs"] = _timed_error(lambda: rewrite.run_schedule(stage, [x.float() for x in ids()], ids()))
    got["input 300"] = _timed_error(lambda: rewrite.run_schedule(stage, big, ids()))
    ignored = ids()
    ignored[1][:, :4] = -100  # ignored positions are fine
    loss = rewrite.run_schedule(stage, ids(), ignored)
    assert torch.isfinite(loss)
    return got


def test_ranks_fail_together_tp2_pp2():
    results = run(_fail_together, 4, timeout_s=120)
    for case in results[0]:
        messages = {r[case][0] for r in results}
        assert len(messages) == 1, f"{case}: ranks raised different errors: {messages}"
        assert max(r[case][1] for r in results) < 30, f"{case}: took too long"
    got = {case: text for case, (text, _) in results[0].items()}
    assert "rank 3: plans/llama-tp4.yaml" in got["plan"], got["plan"]
    assert "already rewritten by apply_plan (it holds a stage of plans/llama-tp2-pp2.yaml)" in got["twice"]
    assert "ranks 0, 1: 4 x [2, 16] int64; ranks 2, 3: 4 x [4, 8] int64" in got["shapes"]
    assert "ranks 2, 3: targets[2] holds 300 at (1, 3), outside [0, 256) and not -100" in got["target 300"]
    assert "ranks 2, 3: targets[0] holds -7 at (0, 0), outside [0, 256)" in got["target -7"]
    assert "ranks 0, 1, 2, 3: inputs[0], inputs[1], inputs[2] and 1 more must be integer token ids [mb, seq], got [2, 16] float32" in got["float inputs"]
    assert "ranks 0, 1: inputs[2] holds id 300 at (1, 3), outside the vocabulary [0, 256)" in got["input 300"]


def _different_views(rank: int, ws: int) -> dict[str, str]:
    got = {}
    plan = "plans/llama-tp2.yaml" if rank == 0 else "plans/llama-pp2.yaml"
    got["plans"] = _expect_error(lambda: rewrite.apply_plan(build_model("tiny-llama"), plan))
    got["weights"] = _expect_error(lambda: rewrite.apply_plan(build_model("tiny-llama", seed=rank), "plans/llama-tp2.yaml"))
    flag = torch.ones(1)
    dist.all_reduce(flag)  # nobody was left inside a collective
    assert flag.item() == ws
    return got


def test_ranks_with_different_plans_or_weights_are_refused():
    first, second = run(_different_views, 2, timeout_s=60)
    assert first == second, "every rank raises the same error"
    assert "ranks were given different plans, models or weights" in first["plans"]
    assert "plan: rank 0: plans/llama-tp2.yaml (pp=1 x tp=2" in first["plans"]
    assert "rank 1: plans/llama-pp2.yaml (pp=2 x tp=1" in first["plans"]
    assert "weights: rank 0: checksum" in first["weights"] and "rank 1: checksum" in first["weights"]
    assert "\n  plan:" not in first["weights"], "only what differs is named"


def test_no_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"torch.distributed is not initialised: call .*init_process_group"):
        rewrite.apply_plan(build_model("tiny-llama", device="meta"), "plans/llama-tp2.yaml")
