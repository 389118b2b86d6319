"""Every family of the installed transformers (`tests/families.py`), tiny, at tp 2 (its own
base_model_tp_plan), pp 2 (1f1b), tp 2 with sequence parallelism, tp 2 with a vocabulary-parallel
head and loss, and tp 2 with a single kv head (held by both ranks): the step loss and every gradient
equal one process, or the plan is refused on every rank before anything runs. Never a crash
mid-step, never silently wrong.

With REWRITE_FAMILY_TABLE=path set, each case adds its outcome to that JSON file
(`python -m bench.families` writes docs/families.md from it)."""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from rewrite.run.parity import reference_step
from tests.asserts import assert_close
from tests.families import TINY, causal_lm_families, check_family, documented_works, tiny_family_model
from tests.multiproc import run
from tests.paths import ROOT
from tests.reference import assert_grads_match

PLANS = {
    "tp2": lambda model: rewrite.plan_from_hf(model, tp=2),
    "pp2": lambda model: {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    "sp": lambda model: rewrite.plan_from_hf(model, tp=2, sequence_parallel=True),
    "vocab_loss": lambda model: rewrite.plan_from_hf(model, tp=2, loss_parallel=True),
    "kv_replicated": lambda model: _attention_only(rewrite.plan_from_hf(model, tp=2)),  # one kv head, on both ranks
}
OVERRIDES = {"kv_replicated": {"num_key_value_heads": 1}}
# Gradient tolerances above fp32's 1e-5, each with what was measured. Qwen3.5's gated delta rule is a
# pure-torch recurrent kernel whose sums run in another order once tp splits its heads: conv1d.weight's
# gradient (a sum over the whole sequence) differed by 1.3e-5 on one machine, within 1e-5 on another.
GRAD_ATOL = {"qwen3_5_text": 3e-5}


def _attention_only(plan) -> dict | None:
    """The family's own rules for the attention holding k_proj alone (what replication changes), or
    None without a k_proj rule.

    The other blocks stay whole: their splits are the tp2 column's, and a pure-torch recurrent
    kernel (Qwen3.5's gated delta rule) would only add its own reduction-order noise here."""
    data = plan.model_dump(mode="json", exclude_none=True)
    attention = {p.rpartition(".")[0] for p in data["tensor_parallel"] if p.endswith(".k_proj")}
    rules = {p: s for p, s in data["tensor_parallel"].items() if p.rpartition(".")[0] in attention}
    return {**data, "tensor_parallel": rules} if rules else None


def _sweep(rank: int, world: int, family: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(2)]
    targets = [torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen) for _ in range(2)]
    out = {}
    for name, plan_of in PLANS.items():
        try:
            model = tiny_family_model(family, **OVERRIDES.get(name, {}))
        except Exception as exc:  # the tiny config itself is not valid for this family: nothing to run
            out[name] = f"no tiny model: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        reference = copy.deepcopy(model)
        plan = plan_of(model)
        if plan is None:
            out[name] = "no k_proj rule in its tp plan: nothing to replicate"
            continue
        try:
            stage = rewrite.apply_plan(model, plan)
        except rewrite.PlanError as exc:  # refused before any collective but the agreement: every rank alike
            out[name] = "refused: " + (exc.problems[0] if exc.problems else str(exc))
            continue
        loss = rewrite.run_schedule(stage, ids, targets)
        tag = f"{family} {name} rank {rank}"
        assert_close(f"{tag} step loss", loss, reference_step(reference, ids, targets))
        assert assert_grads_match(model, reference, atol=GRAD_ATOL.get(family, 1e-5), prefix=f"{tag} ") > 0
        out[name] = "works"
        if name == "kv_replicated" and stage.mesh.kv_replicas == 1:
            style = next(s.style for s in stage.resolved.shards if s.fqn.endswith(".k_proj"))
            why = "its k_proj keeps a kv head per query head" if style == "column" else f"its k_proj is {style}"
            out[name] = f"works, not replicated: {why}"
    return out


DOC = ROOT / "docs" / "families.md"


def test_the_documented_floor_is_read():
    floor = documented_works(DOC, PLANS)
    assert len(floor) >= 50 and sum(len(cases) for cases in floor.values()) >= 200, floor
    assert floor["llama"] == set(PLANS), floor["llama"]


@pytest.mark.parametrize("family", causal_lm_families())
def test_family_trains_as_itself_or_is_refused(family):
    check_family(family, run(_sweep, 2, family, timeout_s=300), DOC, PLANS, "REWRITE_FAMILY_TABLE")
