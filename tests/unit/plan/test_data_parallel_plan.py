"""The data-parallel dimension of a plan: mesh.dp and data_parallel.sharding, checked without ranks."""

from __future__ import annotations

import pytest
import yaml

import rewrite
from rewrite.binding.resolve import resolve
from rewrite.run.presets import build_model


def _problems(plan, **kwargs) -> str:
    with pytest.raises(rewrite.PlanError) as info:
        if kwargs:
            resolve(plan, build_model("tiny-llama", device="meta"), **kwargs)
        else:
            rewrite.load_plan(plan)
    return str(info.value)


def test_mesh_has_three_dimensions_and_a_sharding_mode():
    plan = rewrite.load_plan({"mesh": {"dp": 2, "pp": 2, "tp": 2}})
    assert plan.mesh.world_size == 8 and plan.mesh.shape_text() == "dp=2 x pp=2 x tp=2"
    assert plan.data_parallel.sharding == "full"  # the default, as torchtitan's
    assert rewrite.load_plan({}).mesh.shape_text() == "pp=1 x tp=1"  # no replicas: dp is not mentioned
    assert plan.data_parallel.reduce == "step"  # once per step, after the step's backwards
    for reduce in ("step", "microbatch"):  # any schedule with whole backwards, and at dp = 1 (ignored) even zbv
        assert rewrite.load_plan({"mesh": {"dp": 2}, "data_parallel": {"reduce": reduce}}).data_parallel.reduce == reduce
    zbv = {"mesh": {"pp": 2}, "pipeline": {"schedule": "zbv", "virtual_stages": 2, "microbatches": 4}}
    assert rewrite.load_plan({**zbv, "data_parallel": {"reduce": "microbatch"}}).data_parallel.reduce == "microbatch"
    for mode in ("full", "grad_op", "replicate"):
        assert rewrite.load_plan({"mesh": {"dp": 2}, "data_parallel": {"sharding": mode}}).data_parallel.sharding == mode
    text = rewrite.load_plan({"mesh": {"dp": 4}, "data_parallel": {"sharding": "grad_op"}}).to_yaml()
    again = rewrite.load_plan(yaml.safe_load(text))
    assert again.mesh.dp == 4 and again.data_parallel.sharding == "grad_op"


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        ({"data_parallel": {"sharding": "zero3"}}, "data_parallel.sharding: Input should be 'full', 'grad_op' or 'replicate'"),
        ({"data_parallel": {"shard": "full"}}, "unknown key 'shard'; did you mean 'sharding'?"),
        ({"mesh": {"dp": 0}}, "mesh.dp: Input should be greater than or equal to 1"),
        ({"mesh": {"dp": "2"}}, "mesh.dp: Input should be a valid integer"),
        ({"mesh": {"dq": 2}}, "mesh.dq: unknown key 'dq'; allowed here: dp, pp, tp"),
        ({"data_parallel": {"reduce": "layer"}}, "data_parallel.reduce: Input should be 'step' or 'microbatch'"),
        ({"mesh": {"dp": 2, "pp": 2}, "pipeline": {"schedule": "zbv", "virtual_stages": 2, "microbatches": 4},
          "data_parallel": {"reduce": "microbatch"}},
         "data_parallel.reduce: microbatch reduces each unit's gradients as its backward ends, but schedule zbv "
         "splits backwards (W computes the weight gradients after I); use reduce: step (the default) with it"),
        ({"mesh": {"dp": 2, "pp": 2}, "pipeline": {"schedule": "custom", "table": ["F0 I0 W0", "F0 I0 W0"]},
          "data_parallel": {"reduce": "microbatch"}}, "but the custom table splits backwards"),
    ],
)
def test_bad_data_parallel_settings_are_refused(plan, expected):
    assert expected in _problems(plan)


def test_world_size_must_be_dp_times_pp_times_tp():
    message = _problems({"mesh": {"dp": 2, "tp": 2}}, world_size=2)
    assert "mesh: dp=2 x pp=1 x tp=2 = 4 ranks, but the world size is 2; launch 4 processes" in message
