"""Every schedule against a single-process reference: loss and every gradient, on every rank."""

from __future__ import annotations

import copy

import pytest
from torch.nn import functional as F

import rewrite
from rewrite.plan.schedules import build_table, parse_row, peak_in_flight
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.distributed.pipeline.test_pipeline import _batch
from tests.models import toy_step_setup
from tests.multiproc import run
from tests.reference import assert_grads_match

# A hand-written table: AFAB on stage 0, 1F1B on stage 1 (valid: transfers in the same order).
CUSTOM_PP2 = ["F0 F1 F2 B0 B1 B2", "F0 B0 F1 B1 F2 B2"]


def _executed_peak(timeline) -> int:
    """Most microbatches between their forward and backward at once, as the step ran them."""
    live = peak = 0
    for event in timeline:
        live += 1 if event.kind == "forward" else -1
        peak = max(peak, live)
    return peak


def _step(rank: int, config, plan: dict, microbatches: int) -> dict:
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan)
    ids, targets = _batch(config, microbatches)
    loss = rewrite.run_schedule(stage, ids, targets)
    name = f"rank {rank} {plan['pipeline']['schedule']} m={microbatches}"
    assert_close(f"{name} loss", loss, reference_step(reference, ids, targets))
    assert assert_grads_match(model, reference, prefix=f"{name} ") > 0
    order = [(e.kind[0].upper(), e.mb_idx) for e in stage.timeline]
    return {"order": order, "peak": _executed_peak(stage.timeline), "stage": stage.stage_idx}


def _schedules(rank: int, ws: int, mesh: dict, overrides: dict, schedules: list[str], counts: list[int]) -> list:
    config = build_config("tiny-llama", **overrides)
    tp_rules = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel if mesh.get("tp", 1) > 1 else {}
    results = []
    for schedule in schedules:
        for m in counts:
            pipeline = {"schedule": schedule, "microbatches": m}
            if schedule == "custom":
                pipeline["table"] = CUSTOM_PP2
            plan = {"mesh": mesh, "tensor_parallel": tp_rules, "pipeline": pipeline}
            results.append((schedule, m, _step(rank, config, plan, m)))
    return results


CASES = {
    # name: (world, mesh, config overrides, schedules, microbatch counts)
    "pp2": (2, {"pp": 2}, {}, ["afab", "1f1b"], [2, 4, 3]),
    "pp2-custom": (2, {"pp": 2}, {}, ["custom"], [3]),
    "pp4": (4, {"pp": 4}, {}, ["afab", "1f1b"], [4, 8, 5]),
    "tp2xpp2-tied-1f1b": (4, {"pp": 2, "tp": 2}, {"tie_word_embeddings": True}, ["1f1b"], [2, 3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_matches_reference(case):
    world, mesh, overrides, schedules, counts = CASES[case]
    per_rank = run(_schedules, world, mesh, overrides, schedules, counts, timeout_s=240)
    pp = mesh["pp"]
    for results in per_rank:
        for schedule, m, got in results:
            s = got["stage"]
            if schedule == "1f1b":
                # Activations of at most pp - s microbatches are alive at once, however many run.
                assert got["peak"] == min(pp - s, m), (schedule, m, s, got["order"])
            if schedule == "afab":
                assert got["peak"] == m
            if schedule == "custom":
                expected = parse_row(CUSTOM_PP2[s], s)[0]
                assert got["order"] == [(a.kind, a.mb) for a in expected], got["order"]
    # The executed order is the table's row, on every rank.
    for results in per_rank:
        for schedule, m, got in results:
            if schedule != "custom":
                row = build_table(schedule, pp, m)[got["stage"]]
                assert got["order"] == [(a.kind, a.mb) for a in row]
                assert peak_in_flight(row) == got["peak"]


def _fx_1f1b(rank: int, ws: int) -> float:
    model, reference, xs, ys = toy_step_setup(5)
    stage = rewrite.apply_plan(model, {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 5}})
    loss = rewrite.run_schedule(stage, xs, ys, loss_fn=F.mse_loss)
    ref_loss = sum(F.mse_loss(reference(x), y) / 5 for x, y in zip(xs, ys))
    ref_loss.backward()
    assert_close("fx 1f1b loss", loss, ref_loss.detach())
    assert assert_grads_match(stage.module, reference, prefix=f"rank {rank} ") > 0
    assert _executed_peak(stage.timeline) == 2 - stage.stage_idx
    return float(loss)


def test_traced_module_under_1f1b():
    losses = run(_fx_1f1b, 2, timeout_s=120)
    assert losses[0] == losses[1]


def _custom_count(rank: int, ws: int) -> str:
    plan = {"mesh": {"pp": 2}, "pipeline": {"schedule": "custom", "microbatches": 3, "table": CUSTOM_PP2}}
    stage = rewrite.apply_plan(build_model("tiny-llama"), plan)
    config = build_config("tiny-llama")
    ids, targets = _batch(config, 2)
    try:
        rewrite.run_schedule(stage, ids, targets)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("a custom table ran another number of microbatches")


def test_custom_table_runs_its_own_microbatch_count():
    first, second = run(_custom_count, 2, timeout_s=60)
    assert first == second
    assert "custom table runs 3 microbatches, got 2" in first
