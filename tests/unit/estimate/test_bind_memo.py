"""A plan search's binding steps (`MemoSteps`) are kept by their arguments (`TpRules`, `PipelineShape`, the
sequence length, the shards): never a stale binding, never a needless one."""

from __future__ import annotations

import pytest
import yaml

from rewrite import PlanError, resolve
from rewrite.binding.resolve import resolve_with
from rewrite.estimate.bind_memo import MemoSteps
from rewrite.plan.size_checks import PipelineShape
from rewrite.binding.tp_rules import TpRules
from rewrite.run.presets import build_model

RULES = yaml.safe_load(open("plans/llama-tp2.yaml"))["tensor_parallel"]


def _plan(tp: int, pp: int, **pipeline) -> dict:
    return {"mesh": {"tp": tp, "pp": pp}, "tensor_parallel": RULES, "pipeline": pipeline}


def _steps(steps: MemoSteps, name: str) -> list:
    return [key for key in steps.memo if key[0] == name]


def test_a_shared_cache_binds_each_rule_set_once_and_gives_what_a_fresh_binding_gives():
    model = build_model("tiny-llama", device="meta")
    cache = MemoSteps(model)
    plans = [_plan(2, 1), _plan(2, 2), _plan(4, 2), _plan(2, 2, cut_points="auto"), _plan(2, 2, seq_len=64)]
    for data in plans:
        cached, fresh = resolve_with(cache, data), resolve(data, model)
        assert cached.shards == fresh.shards and cached.stages == fresh.stages
    assert len(_steps(cache, "shards")) == 2  # tp 2 and tp 4
    assert len(_steps(cache, "costs")) == 3  # (tp 2, seq 512), (tp 4, seq 512), (tp 2, seq 64)
    assert len(_steps(cache, "stages")) == 5


def test_the_keys_are_the_values_read_with_their_lines(tmp_path):
    model = build_model("tiny-llama", device="meta")
    cache = MemoSteps(model)
    bad = {"mesh": {"tp": 2}, "tensor_parallel": {**RULES, "model.layers.*.mlp.gate": "column"}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad, sort_keys=False))
    with pytest.raises(PlanError, match=r"line \d+: tensor_parallel\['model.layers.\*.mlp.gate'\] matches no module"):
        resolve_with(cache, str(path))
    with pytest.raises(PlanError) as refused:  # the same rules from a dict: no line to name, not the file's
        resolve_with(cache, bad)
    assert "line" not in str(refused.value) and "matches no module" in str(refused.value)
    from rewrite import load_plan

    plan = load_plan(str(path))
    assert TpRules.of(plan).at("model.layers.*.mlp.gate").startswith("line ")
    assert TpRules.of(plan) == TpRules.of(load_plan(str(path)))  # hashable values, equal when read alike
    assert PipelineShape.of(plan).stages == 1 and hash(PipelineShape.of(plan))
