"""The shipped plans against real model configs (meta models): sizes, which plans bind, and how fast."""

from __future__ import annotations

import functools
import time

import pytest

from rewrite.plan.resolve import resolve
from rewrite.plan.schema import PlanError
from rewrite.run.presets import build_model, load_config
from tests.paths import PLANS, ROOT

CONFIGS = ROOT / "tests" / "configs"

# Parameters of each model, tied embeddings counted once (as the published checkpoints report them).
PARAMS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "smollm2-135m": 134_515_008,
    "qwen2.5-0.5b": 494_032_768,
    "mistral-7b": 7_241_732_096,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
}

# Plans a config cannot take: tp must divide the attention and key-value heads.
#   smollm2-135m: 9 heads, 3 kv heads: neither tp 2 nor tp 4.
#   qwen2.5-0.5b: 14 heads, 2 kv heads: tp 2, not tp 4.
TP2 = {"llama-tp2", "llama-tp2-sp", "llama-tp2-pp2", "llama-dp2-tp2", "llama-dp2-tp2-pp2"}
REFUSED = {
    "llama-3.1-8b": set(),
    "llama-3.2-1b": set(),
    "smollm2-135m": TP2 | {"llama-tp4"},
    "qwen2.5-0.5b": {"llama-tp4"},
    "mistral-7b": set(),
    "llama-3.1-70b": set(),  # 64 heads, 8 kv heads
    "qwen2.5-7b": set(),  # 28 heads, 4 kv heads
}

SHIPPED = sorted(p.stem for p in PLANS.glob("*.yaml"))
# Loose: resolving and formatting one plan takes well under 2 s on a meta model.
SECONDS = 4.0


@functools.cache
def meta_model(name: str):
    return build_model(load_config(CONFIGS / f"{name}.json"), device="meta")


def test_every_config_is_listed():
    assert sorted(p.stem for p in CONFIGS.glob("*.json")) == sorted(PARAMS) == sorted(REFUSED)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_meta_model_has_the_published_parameter_count(name):
    model = meta_model(name)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]
    assert resolve({}, model).total_params == PARAMS[name]


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("plan", SHIPPED)
def test_each_shipped_plan_binds_or_is_refused(name, plan):
    model = meta_model(name)
    if plan in REFUSED[name]:
        with pytest.raises(PlanError) as info:
            resolve(PLANS / f"{plan}.yaml", model)
        assert isinstance(info.value, ValueError)
        assert "does not divide" in str(info.value) and "heads" in str(info.value)
        return
    resolved = resolve(PLANS / f"{plan}.yaml", model)
    layers = [layer for stage in resolved.stages for layer in stage.layers]
    assert layers == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert len(resolved.stages) == resolved.pp * resolved.plan.pipeline.virtual_stages


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_resolving_and_showing_is_quick(name):
    from rewrite.run.show.report import format_plan

    model = meta_model(name)
    timings = {}
    for plan in SHIPPED:
        if plan in REFUSED[name]:
            continue
        start = time.perf_counter()
        resolved = resolve(PLANS / f"{plan}.yaml", model)
        text = format_plan(resolved, model=model)
        timings[plan] = time.perf_counter() - start
        assert text
    slow = {plan: round(s, 2) for plan, s in timings.items() if s >= SECONDS}
    assert not slow, f"{name}: resolve + format_plan took {slow} s (bound {SECONDS} s)"
