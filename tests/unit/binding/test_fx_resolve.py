"""Binding plans to non-HF modules through torch.fx."""

from __future__ import annotations

import pytest

from rewrite import resolve
from tests.models import BranchyNet, SkipNet, ToyNet


def test_balanced_and_explicit_stages():
    resolved = resolve({"mesh": {"pp": 2}}, ToyNet())
    assert resolved.kind == "fx" and resolved.cut_points == ("blocks.2",)
    assert [s.modules for s in resolved.stages] == [("inp", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head")]
    resolved = resolve({"mesh": {"pp": 3}, "pipeline": {"cut_points": ["blocks.1", "head"]}}, ToyNet())
    assert [s.modules for s in resolved.stages] == [("inp", "blocks.0"), ("blocks.1", "blocks.2", "blocks.3"), ("head",)]
    assert sum(s.param_count for s in resolved.stages) == resolved.total_params


def test_tensor_parallel_rules_on_any_module():
    rules = {"blocks.*.fc1": "column", "blocks.*.fc2": "row"}
    resolved = resolve({"mesh": {"tp": 2, "pp": 2}, "tensor_parallel": rules}, ToyNet())
    assert {s.fqn: s.weight_shape for s in resolved.shards}["blocks.0.fc1"] == (16, 16)


def test_untraceable_module_is_named():
    with pytest.raises(ValueError) as info:
        resolve({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["head"]}}, BranchyNet())
    message = str(info.value)
    assert "BranchyNet cannot be split into pipeline stages: torch.fx could not trace module 'gate' (Gate)" in message
    assert "TraceError" in message


def test_cut_where_several_values_flow():
    with pytest.raises(ValueError) as info:
        resolve({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["blocks.2"]}}, SkipNet())
    assert "pipeline.cut_points[0] 'blocks.2': 2 values enter stage 1" in str(info.value)
    assert "cut where a single tensor flows" in str(info.value)


def test_cut_point_mistakes():
    with pytest.raises(ValueError, match="'blocks.9' is not a module called by forward"):
        resolve({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["blocks.9"]}}, ToyNet())
    with pytest.raises(ValueError, match="are not in the order forward"):
        resolve({"mesh": {"pp": 3}, "pipeline": {"cut_points": ["blocks.3", "blocks.1"]}}, ToyNet())
    with pytest.raises(ValueError, match="needs a layer sequence of at least 5 modules"):
        resolve({"mesh": {"pp": 5}}, ToyNet())
