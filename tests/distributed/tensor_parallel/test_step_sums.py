"""Gradients each tp rank holds only in part (the norms under sequence parallelism, Qwen3's
per-head norms): summed over tp once per step under the runner, once per backward under model(...);
both equal one process, and a step that raises leaves the modules summing at every backward again."""

from __future__ import annotations

import copy


import rewrite
from rewrite.run.parity import reference_step
from rewrite.tensor_parallel.partial_grads import StepSums
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.collectives import CountCollectives
from tests.distributed.pipeline.test_pipeline import _batch
from tests.multiproc import run
from tests.reference import expected_shard

M = 3  # microbatches


def _counting_sums(fn) -> int:
    with CountCollectives() as seen:
        fn()
    return seen.counts["all_reduce"]


def _grads_match(name: str, model, reference) -> None:
    ref = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        assert_close(f"{name} {pname}.grad", param.grad, expected_shard(model, pname, ref[pname].grad))


def _backward_each(model, ids, targets) -> None:
    """model(...) and a backward per microbatch, each loss a share of the step's token mean."""
    tokens = sum(int((y != -100).sum()) for y in targets)
    for x, y in zip(ids, targets):
        (rewrite.causal_lm_loss(model(input_ids=x).logits, y, reduction="sum") / tokens).backward()


def _case(rank: int, world: int, plan: dict, **overrides) -> dict:
    config = build_config("tiny-llama", **overrides)
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan)
    sums = stage.finishing(StepSums)
    partial = sums.modules if sums is not None else []
    assert partial and sums is not None
    ids, targets = _batch(config, M)

    # The runner: the partial gradients accumulate, then one sum per step completes them all.
    step_sums = _counting_sums(lambda: rewrite.run_schedule(stage, ids, targets))
    reference_step(reference, ids, targets)
    _grads_match("run_schedule", model, reference)
    assert not any(m.deferred for m in partial)

    # A second step accumulates onto complete gradients: what they held stays whole.
    rewrite.run_schedule(stage, ids, targets)
    reference_step(reference, ids, targets)
    _grads_match("two steps", model, reference)

    # model(...) with its own backward: each backward sums (a hook on the weight), no step is there to do it.
    model.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)

    use_sums = _counting_sums(lambda: _backward_each(model, ids, targets))
    reference_step(reference, ids, targets)
    _grads_match("model(...)", model, reference)

    # A step that raises mid-way lifts the deferral: model(...) is whole again afterwards.
    calls = []

    def failing(logits, target):  # the same on every rank: the second microbatch's loss raises
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a loss that fails")
        return rewrite.causal_lm_loss(logits, target)

    try:
        rewrite.run_schedule(stage, ids, targets, failing)
    except RuntimeError as exc:
        assert "a loss that fails" in str(exc)
    assert len(calls) == 2 and not any(m.deferred for m in partial)
    return {"step_sums": step_sums, "use_sums": use_sums, "modules": len(partial)}


def _unfrozen_later(plan: dict) -> int:
    """The norms frozen when the plan is applied and trained after all: model(...)'s backward still sums them."""
    config = build_config("tiny-llama")
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    for name, param in model.named_parameters():
        param.requires_grad_("norm" not in name)
    rewrite.apply_plan(model, plan)
    for param in model.parameters():
        param.requires_grad_(True)
    ids, targets = _batch(config, M)
    sums = _counting_sums(lambda: _backward_each(model, ids, targets))
    reference_step(reference, ids, targets)
    _grads_match("unfrozen after apply_plan", model, reference)
    return sums


def _cases(rank: int, world: int) -> dict:
    plan = {"mesh": {"tp": 2}, "tensor_parallel": rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel,
            "pipeline": {"microbatches": M}}
    return {"sp": _case(rank, world, {**plan, "sequence_parallel": True}),
            "kv": _case(rank, world, plan, num_key_value_heads=1),  # k/v held whole by both ranks
            "unfrozen": _unfrozen_later({**plan, "sequence_parallel": True})}


def test_partial_gradients_summed_once_per_step_and_at_every_use_outside():
    first, second = run(_cases, 2, timeout_s=180)
    assert first == second
    sp, kv = first["sp"], first["kv"]
    # tiny-llama: 4 layers x 2 norms + the final norm, all in one sum per step; the rest of
    # sequence parallelism's traffic is gathers and reduce-scatters.
    assert sp["modules"] == 9 and sp["step_sums"] == 1 and sp["use_sums"] == 9 * M, sp
    # k_proj and v_proj of 4 layers: their weights' sums (one each per use) become one per step,
    # beside the layers' own sums, which both ways make alike.
    assert kv["modules"] == 8 and kv["use_sums"] - kv["step_sums"] == 8 * M - 1, kv
    assert first["unfrozen"] == sp["use_sums"]  # the 9 norms, each summed at every use, as if never frozen


def _fsdp_outside_a_step(rank: int, world: int) -> int:
    config = build_config("tiny-llama")
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    plan = {"mesh": {"dp": 2, "tp": 2}, "tensor_parallel": rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel,
            "sequence_parallel": True, "data_parallel": {"sharding": "full"}}
    stage = rewrite.apply_plan(model, plan)
    partial = stage.finishing(StepSums).modules
    ids, targets = _batch(config, 1)  # every replica the same microbatch: their average is its gradient
    for _ in range(2):  # FSDP2 sets its gathered parameters anew on each forward: each sums again, once
        model.zero_grad(set_to_none=True), reference.zero_grad(set_to_none=True)
        with CountCollectives() as seen:
            rewrite.causal_lm_loss(model(input_ids=ids[0]).logits, targets[0]).backward()
        reference_step(reference, ids, targets)
        ref = dict(reference.named_parameters())
        for pname, param in model.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            assert_close(f"rank {rank} FSDP2 model(...) {pname}.grad", grad, expected_shard(model, pname, ref[pname].grad))
    return {"sums": seen.counts["all_reduce"], "modules": len(partial)}


def test_partial_gradients_whole_under_fsdp_outside_a_step():
    """FSDP2 replaces the parameters (sharded at rest, gathered for a forward): a plain forward and backward
    still sums every norm's gradient over tp, on the gathered parameters, once."""
    counts = run(_fsdp_outside_a_step, 4, timeout_s=240)
    # tiny-llama's 9 norms, one sum each (sequence parallelism's other traffic is gathers and reduce-scatters)
    assert all(c == {"sums": 9, "modules": 9} for c in counts), counts
