"""balance_warnings: a stage or rank far above the mean, by parameters and by estimated compute."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from torch import nn

from rewrite.estimate.balance import THRESHOLD, balance_warnings
from rewrite.binding.resolve import resolve
from rewrite.plan.loading import load_plan
from rewrite.run.presets import build_model, load_config
from tests.paths import PLANS, ROOT

CONFIGS = sorted((ROOT / "tests" / "configs").glob("*.json")) + [ROOT / "tests" / "configs" / "moe" / "qwen3-30b-a3b.json"]
SHIPPED = sorted(PLANS.glob("*.yaml"))
TINY = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


@functools.cache
def meta_model(config: str):
    return build_model(load_config(config), device="meta")


def llama8b():
    return meta_model(str(ROOT / "tests" / "configs" / "llama-3.1-8b.json"))


def suggested(warning: str) -> list[str]:
    """The cut points a warning says to paste."""
    found = re.search(r"pipeline\.cut_points: (\[[^\]]*\])", warning)
    assert found, warning
    return json.loads(found.group(1))


@pytest.mark.parametrize("config", [c.stem for c in CONFIGS] + TINY)
def test_shipped_plans_are_balanced_on_every_config_that_fits(config):
    path = next((c for c in CONFIGS if c.stem == config), None)
    model = meta_model(str(path) if path else config)
    bound = 0
    for path in SHIPPED:
        try:
            resolved = resolve(path, model)
        except ValueError:
            continue  # its mesh splits a head; test_real_configs names which
        bound += 1
        assert balance_warnings(resolved, model) == [], f"{path.name} on {config}"
    assert bound >= 3  # smollm2-135m (9 heads) takes only the plans without tensor parallelism


def test_a_cut_for_a_shallow_model_warns_on_a_deep_one_and_names_the_fix():
    model = llama8b()
    rules = load_plan(PLANS / "llama-tp2.yaml").tensor_parallel
    skewed = {"mesh": {"pp": 2, "tp": 2}, "tensor_parallel": rules, "pipeline": {"cut_points": ["model.layers.2"]}}
    resolved = resolve(skewed, model)
    params, compute = balance_warnings(resolved, model)
    per_stage = [s.param_count for s in resolved.stages]
    ratio = 2 * max(per_stage) / sum(per_stage)
    assert params.startswith(f"parameters: stage 1 holds {ratio:.2f}x the mean (3.80 B of 4.54 B over 2 stages")
    assert 'with cut_points ["model.layers.2"] (layers per stage 2, 30)' in params
    flops = resolved.costs.stage_costs([2, 30])
    ratio = 2 * flops[1] / sum(flops)
    assert compute.startswith(f"compute: stage 1 holds {ratio:.2f}x the mean estimated training FLOPs")
    assert "per 2048-token sequence over 2 stages" in compute and "more than 1.25x" in compute
    # One fix for both, and it is what `cut_points: auto` picks.
    auto = resolve({**skewed, "pipeline": {"cut_points": "auto"}}, model)
    assert suggested(params) == suggested(compute) == list(auto.cut_points) == ["model.layers.18"]
    assert "what cut_points: auto picks; layers per stage 18, 14" in params
    fixed = resolve({**skewed, "pipeline": {"cut_points": suggested(params)}}, model)
    assert balance_warnings(fixed, model) == []


@pytest.mark.parametrize("cut", ["model.layers.2", "model.layers.28"])
def test_the_suggested_cuts_clear_both_measures(cut):
    model = llama8b()
    plan = {"mesh": {"pp": 2}, "pipeline": {"cut_points": [cut]}}
    warnings = balance_warnings(resolve(plan, model), model)
    assert [w.split(":")[0] for w in warnings] == ["parameters", "compute"]
    fixed = resolve({"mesh": {"pp": 2}, "pipeline": {"cut_points": suggested(warnings[0])}}, model)
    assert balance_warnings(fixed, model) == []


def test_a_tiny_model_cut_after_one_layer_is_told_two_and_two():
    # tiny-llama: 4 layers, a small head; auto and the default both split 2 + 2.
    model = meta_model("tiny-llama")
    plan = {"mesh": {"pp": 2}, "pipeline": {"cut_points": ["model.layers.1"]}}
    warnings = balance_warnings(resolve(plan, model), model)
    assert warnings and all(suggested(w) == ["model.layers.2"] for w in warnings)
    assert all("layers per stage 1, 3" in w for w in warnings)


def chain(blocks: int) -> nn.Sequential:
    """Equal bias-free blocks, split by torch.fx: stage parameters are in the ratio of their blocks."""
    return nn.Sequential(*(nn.Linear(8, 8, bias=False) for _ in range(blocks)))


def test_exactly_the_threshold_is_not_a_warning():
    model = chain(8)
    at = resolve({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["5"]}}, model)  # 5 of 8 blocks: 1.25x the mean
    assert [s.param_count for s in at.stages] == [5 * 64, 3 * 64] and THRESHOLD == 1.25
    assert balance_warnings(at, model) == []
    over = resolve({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["6"]}}, model)  # 6 of 8: 1.5x
    (warning,) = balance_warnings(over, model)
    assert warning.startswith("parameters: stage 0 holds 1.50x the mean (384 of 512 over 2 stages, mean 256")
    assert 'with cut_points ["6"] (stages start at 6); fix: omit pipeline.cut_points' in warning
    assert balance_warnings(over, model, threshold=1.5) == []
    assert balance_warnings(at, model, threshold=1.2) != []


def test_the_threshold_applies_to_each_measure():
    model = llama8b()
    resolved = resolve({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["model.layers.2"]}}, model)
    params = [s.param_count for s in resolved.stages]
    flops = resolved.costs.stage_costs([2, 30])
    p, c = 2 * max(params) / sum(params), 2 * max(flops) / sum(flops)
    assert p < c
    between = (p + c) / 2
    (only,) = balance_warnings(resolved, model, threshold=between)
    assert only.startswith("compute:")
    assert balance_warnings(resolved, model, threshold=c + 0.01) == []
    with pytest.raises(ValueError, match="threshold=1.0"):
        balance_warnings(resolved, model, threshold=1.0)


@pytest.mark.parametrize("plan", ["llama-tp2.yaml", "llama-fsdp4.yaml"])
def test_one_stage_never_warns(plan):
    model = llama8b()
    assert balance_warnings(resolve(PLANS / plan, model), model) == []
    chained = chain(4)
    assert balance_warnings(resolve({}, chained), chained) == []


def test_virtual_stages_weigh_parameters_per_rank_and_compute_per_stage():
    model = meta_model(str(ROOT / "tests" / "configs" / "qwen2.5-0.5b.json"))
    even = {"mesh": {"pp": 2}, "pipeline": {"schedule": "zbv", "virtual_stages": 2, "microbatches": 4}}
    resolved = resolve(even, model)  # 6 layers a stage; rank 0 holds the embeddings and the head
    params, compute = balance_warnings(resolved, model)
    assert params.startswith("parameters: pp rank 0 (stages 0, 3) holds 1.28x the mean")
    assert "over 2 pp ranks, summed over each rank's virtual stages" in params
    assert compute.startswith("compute: stage 3 holds 1.70x the mean estimated training FLOPs")
    assert "over 4 stages" in compute
    fixed = resolve({**even, "pipeline": {**even["pipeline"], "cut_points": suggested(params)}}, model)
    assert [len(s.layers) for s in fixed.stages] == [7, 8, 8, 1]
    assert balance_warnings(fixed, model) == []


def test_pure_on_a_meta_model():
    model = llama8b()
    resolved = resolve({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["model.layers.2"]}}, model)
    before = [(n, p.shape) for n, p in model.named_parameters()]
    balance_warnings(resolved, model)
    assert [(n, p.shape) for n, p in model.named_parameters()] == before
    assert all(p.is_meta for p in model.parameters())
    assert not torch.distributed.is_initialized()
