"""Every mixture-of-experts family of the installed transformers (`tests/families.py: moe_families`),
tiny (4 experts, 2 chosen), at ep 2 (dp 2, its experts modules split by expert), at pp 2 (1f1b), at
tp 2 (its own tp plan through plan_from_hf: each expert split over tp where the family's plan splits it
and its experts add up so split, else whole) and at ep 2 x tp 2 (plan_from_hf on 2 ranks: the experts
split by expert over the tp pair): the step loss and every gradient equal one
process, or the plan is refused on every rank before anything runs. Never a crash mid-step, never
silently wrong.

With REWRITE_MOE_TABLE=path set, each case adds its outcome to that JSON file (`python -m
bench.families --moe` writes docs/moe_families.md from it)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import rewrite
from rewrite.run.parity import reference_step
from tests.asserts import assert_close
from tests.families import TINY, check_family, documented_works, moe_families, tiny_moe_model
from tests.multiproc import run
from tests.paths import ROOT
from tests.reference import assert_grads_match, assert_replica_step


def _experts_rules(model) -> dict[str, str]:
    """`expert_parallel` for the family's experts modules: its ep plan's, else every module named `experts`."""
    prefix = model.base_model_prefix
    ep_plan = getattr(model.config, "base_model_ep_plan", None) or {}
    named = [f"{prefix}.{k}" for k, v in ep_plan.items() if v == "ep_dispatch_experts"]
    named = named or sorted({re.sub(r"\.\d+\.", ".*.", n) for n, _ in model.named_modules() if n.endswith(".experts")})
    return {pattern: "expert_parallel" for pattern in named}


# Families whose router samples experts at random in training: one process and a plan draw differently,
# so their steps are compared in eval mode (no dropout here either way), where routing is the top k.
RANDOM_ROUTING = {"phimoe": "its sparsemixer router samples experts in training"}

PLANS = {
    "ep2": lambda model: {"mesh": {"dp": 2, "ep": 2}, "tensor_parallel": _experts_rules(model),
                          "pipeline": {"microbatches": 2}},
    "pp2": lambda model: {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    "tp2": lambda model: rewrite.plan_from_hf(model, tp=2),
    # ep 2 over the tp pair: the family's tp plan for the rest, its experts split by expert, each tp rank's half
    # of the tokens to them.
    "ep2 x tp2": lambda model: rewrite.plan_from_hf(model, tp=2, ep=2),
}


def _sweep(rank: int, world: int, family: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(2)]
    targets = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(2)]
    out = {}
    for name, plan_of in PLANS.items():
        try:
            model = tiny_moe_model(family)
        except Exception as exc:  # the tiny config itself is not valid for this family: nothing to run
            out[name] = f"no tiny model: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        if family in RANDOM_ROUTING:
            model.eval()
        reference = copy.deepcopy(model)
        tag = f"{family} {name} rank {rank}"
        try:
            plan = plan_of(model)
            rules = plan.get("tensor_parallel", {}) if isinstance(plan, dict) else plan.tensor_parallel
            split = "expert_tensor_parallel" in rules.values()
            stage = rewrite.apply_plan(model, plan)
        except ValueError as exc:  # refused before any collective but the agreement: every rank alike
            problems = getattr(exc, "problems", None)
            out[name] = "refused: " + (problems[0] if problems else str(exc).splitlines()[0])
            continue
        if stage.dp > 1:
            assert_replica_step(stage, model, reference, ids, targets, tag)
        else:
            loss = rewrite.run_schedule(stage, ids, targets)
            assert_close(f"{tag} step loss", loss, reference_step(reference, ids, targets))
            assert assert_grads_match(model, reference, prefix=f"{tag} ") > 0
        notes = ([f"in eval mode: {RANDOM_ROUTING[family]}"] if family in RANDOM_ROUTING else []) + (
            ["each expert split over tp" if split else "experts whole"] if name == "tp2" else [])
        out[name] = f"works ({'; '.join(notes)})" if notes else "works"
    return out


DOC = ROOT / "docs" / "moe_families.md"


def test_the_documented_floor_is_read():
    floor = documented_works(DOC, PLANS)
    assert len(floor) >= 50 and floor["qwen3_moe"] == set(PLANS), floor.get("qwen3_moe")


@pytest.mark.parametrize("family", moe_families())
def test_moe_family_trains_as_itself_or_is_refused(family):
    check_family(family, run(_sweep, 2, family, timeout_s=300), DOC, PLANS, "REWRITE_MOE_TABLE")
