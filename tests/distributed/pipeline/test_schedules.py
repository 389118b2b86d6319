"""Every schedule against a one-process reference (loss and every gradient, on every rank), as its table says."""

from __future__ import annotations

import copy

import pytest
from torch.nn import functional as F

import rewrite
from rewrite.schedules import peak_in_flight, placement, plan_table
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.distributed.pipeline.test_pipeline import _batch
from tests.models import toy_step_setup
from tests.multiproc import run
from tests.reference import assert_grads_match

# Hand-written tables: AFAB on rank 0 and 1F1B on rank 1; and, with two stages per rank,
CUSTOM_PP2 = ["F0 F1 F2 B0 B1 B2", "F0 B0 F1 B1 F2 B2"]
# a hand-written table with two stages per rank: rank 0 splits its backwards (B, then W), rank 1 does not.
CUSTOM_K2 = ["F0@0 F1@0 F0@2 F1@2 B0@2 W0@2 B1@2 W1@2 B0@0 B1@0 W0@0 W1@0", "F0@1 F1@1 F0@3 F1@3 B0@3 B1@3 B0@1 B1@1"]

_KIND = {"forward": "F", "backward": "B", "backward-input": "I", "backward-weight": "W"}


def _executed(stage) -> list[tuple[str, int, int]]:
    return [(_KIND[e.kind], e.mb_idx, e.stage_idx) for e in stage.timeline]


def _executed_peak(stage) -> int:
    """Most (microbatch, stage) pairs between their forward and their last backward pass, as run."""
    row = _executed(stage)
    last = {}
    for i, (kind, mb, s) in enumerate(row):
        if kind != "F":
            last[mb, s] = i
    live = peak = 0
    for i, (kind, mb, s) in enumerate(row):
        live += 1 if kind == "F" else -1 if last[mb, s] == i else 0
        peak = max(peak, live)
    return peak


def _step(rank: int, config, plan: dict, m: int) -> dict:
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan)
    ids, targets = _batch(config, m)
    loss = rewrite.run_schedule(stage, ids, targets)
    pipe = plan["pipeline"]
    name = f"rank {rank} {pipe['schedule']} k={pipe.get('virtual_stages', 1)} m={m}"
    assert_close(f"{name} loss", loss, reference_step(reference, ids, targets))
    assert assert_grads_match(model, reference, prefix=f"{name} ") > 0
    return {"order": _executed(stage), "peak": _executed_peak(stage), "pp_rank": stage.pp_rank,
            "stages": list(stage.stage_ids)}


def _schedules(rank: int, ws: int, mesh: dict, overrides: dict, schedules: list, counts: list[int]) -> list:
    config = build_config("tiny-llama", **overrides)
    tp_rules = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel if mesh.get("tp", 1) > 1 else {}
    results = []
    for schedule, k in schedules:
        for m in counts if schedule != "custom" else [2 if k == 2 else 3]:
            pipeline = {"schedule": schedule, "virtual_stages": k, "microbatches": m}
            if schedule == "custom":
                pipeline["table"] = CUSTOM_K2 if k == 2 else CUSTOM_PP2
            plan = {"mesh": mesh, "tensor_parallel": tp_rules, "pipeline": pipeline}
            results.append((schedule, k, m, _step(rank, config, plan, m)))
    return results


EVERY = [("afab", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zero-bubble", 2), ("zbv", 2)]
CASES = {
    # name: (world, mesh, config overrides, (schedule, virtual stages) pairs, microbatch counts)
    "pp2": (2, {"pp": 2}, {}, [*EVERY, ("custom", 1), ("custom", 2)], [2, 4, 3]),
    "pp4": (4, {"pp": 4}, {"num_hidden_layers": 8}, EVERY, [4, 8, 5]),
    "tp2xpp2-tied": (4, {"pp": 2, "tp": 2}, {"tie_word_embeddings": True},
                     [("1f1b", 1), ("zbv", 2), ("interleaved-1f1b", 2)], [2, 3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_matches_reference(case):
    world, mesh, overrides, schedules, counts = CASES[case]
    per_rank = run(_schedules, world, mesh, overrides, schedules, counts, timeout_s=300)
    pp = mesh["pp"]
    for results in per_rank:
        for schedule, k, m, got in results:
            r = got["pp_rank"]
            # The rank holds the stages its placement gives it, and ran its row of the table.
            assert got["stages"] == [s for s, p in enumerate(placement(schedule, pp, k)) if p == r]
            table = (CUSTOM_K2 if k == 2 else CUSTOM_PP2) if schedule == "custom" else None
            row = plan_table(schedule, table, pp, k, m)[r]
            assert got["order"] == [(a.kind, a.mb, a.stage) for a in row], (schedule, k, m, r)
            assert got["peak"] == peak_in_flight(row)
            if schedule in ("1f1b", "zero-bubble") and k == 1:
                assert got["peak"] <= pp - r  # 1F1B, and ZB-H1 with it, hold at most pp - r microbatches
            if schedule == "afab":
                assert got["peak"] == m


def _fx(rank: int, ws: int) -> list[float]:
    losses = []
    for schedule, k in [("1f1b", 1), ("zbv", 2), ("zero-bubble", 1), ("interleaved-1f1b", 2)]:
        model, reference, xs, ys = toy_step_setup(3)
        plan = {"mesh": {"pp": 2}, "pipeline": {"schedule": schedule, "virtual_stages": k, "microbatches": 3}}
        stage = rewrite.apply_plan(model, plan)
        loss = rewrite.run_schedule(stage, xs, ys, loss_fn=F.mse_loss)
        ref_loss = sum(F.mse_loss(reference(x), y) / 3 for x, y in zip(xs, ys))
        ref_loss.backward()
        assert_close(f"fx {schedule} loss", loss, ref_loss.detach())
        assert assert_grads_match(stage.module, reference, prefix=f"rank {rank} {schedule} ") > 0
        assert {id(p) for p in model.parameters()} == {id(p) for p in stage.module.parameters()}
        losses.append(float(loss))
    return losses


def test_traced_module_under_every_schedule():
    first, second = run(_fx, 2, timeout_s=180)
    assert first == second


def _misuse(rank: int, ws: int) -> list[str]:
    config = build_config("tiny-llama")
    stage = rewrite.apply_plan(build_model(config, seed=3), "plans/llama-pp2-zbv.yaml")
    ids, targets = _batch(config, 2)
    messages = []
    for call in (lambda: stage(ids[0]), lambda: stage.run(5, ids[0])):
        try:
            call()
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    # After refusing, the stage still trains.
    assert_close("loss after the refusals", rewrite.run_schedule(stage, ids, targets),
                 reference_step(build_model(config, seed=3), ids, targets))
    return messages


def test_several_stages_per_rank_refuse_one_stage_calls():
    first, second = run(_misuse, 2, timeout_s=120)
    assert "this rank holds stages [0, 3]: run one with stage.run(stage_id, x)" in first[0]
    assert "stage 5 is not on this rank; it holds stages [1, 2]" in second[1]


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
