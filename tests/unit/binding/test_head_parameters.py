"""Bare per-head parameters (attention sinks) split with the heads: what binds, what `show` lists, and the
refusals (a style other than column, heads not split, sinks left whole in a split attention, HF's
`local_params` written into a plan)."""

from __future__ import annotations

import pytest

from rewrite.binding.resolve import resolve
from rewrite.plan.files import PlanError
from rewrite.plan.from_hf import plan_from_hf
from rewrite.plan.loading import load_plan
from rewrite.run.show.data import tp_entries
from tests.families import tiny_moe_model

ATTENTION = "model.layers.*.self_attn"
SPLIT = {f"{ATTENTION}.{n}": "column" for n in ("q_proj", "k_proj", "v_proj")} | {f"{ATTENTION}.o_proj": "row"}


def _problems(model, rules: dict) -> list[str]:
    with pytest.raises(PlanError) as caught:
        resolve({"mesh": {"tp": 2}, "tensor_parallel": rules}, model)
    return caught.value.problems


def test_the_sinks_split_with_the_heads():
    model = tiny_moe_model("mimo_v2_flash")
    plan = plan_from_hf(model, tp=2)
    assert plan.tensor_parallel[f"{ATTENTION}.sinks"] == "column" and ATTENTION not in plan.tensor_parallel
    resolved = resolve(plan, model)
    sinks = {s.fqn: s for s in resolved.shards if s.parameter}
    assert sinks and all(s.weight_shape == (2,) and s.fqn.endswith(".sinks") for s in sinks.values()), sinks
    name = next(iter(sinks))
    assert resolved.split_of(name).local_shape((4,)) == (2,)
    row = next(e for e in tp_entries(resolved, model) if e["module"].endswith("self_attn.sinks"))
    assert (row["style"], row["weight"], row["weight_per_rank"]) == ("column", [4], [2]), row


def test_the_refusals():
    model = tiny_moe_model("mimo_v2_flash")
    wrong = _problems(model, {**SPLIT, f"{ATTENTION}.sinks": "row"})
    assert any("a rule on a parameter splits its dim 0 with its heads, as 'column'" in p for p in wrong), wrong
    alone = _problems(model, {f"{ATTENTION}.sinks": "column"})
    assert any("splits no heads over tp (no column layer in it): leave sinks whole" in p for p in alone), alone
    left = _problems(model, SPLIT)
    assert any(f"split it with them: tensor_parallel['{ATTENTION}.sinks']: column" in p for p in left), left
    with pytest.raises(ValueError, match="style 'local_params' is not needed: every module here already runs on"):
        load_plan({"tensor_parallel": {ATTENTION: "local_params"}})
