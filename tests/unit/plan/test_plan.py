"""Loading plans: the schema, files, and the messages a mistake produces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rewrite
from rewrite import ParallelPlan, PlanError, load_plan
from tests.paths import PLANS

EXAMPLE = """
mesh: {pp: 2, tp: 2}
tensor_parallel:
  "model.layers.*.self_attn.q_proj": column
  "model.layers.*.self_attn.k_proj": column
  "model.layers.*.self_attn.v_proj": column
  "model.layers.*.self_attn.o_proj": row
  "model.layers.*.mlp.gate_proj": column
  "model.layers.*.mlp.up_proj": column
  "model.layers.*.mlp.down_proj": row
pipeline:
  microbatches: 4
  schedule: afab
  cut_points: ["model.layers.2"]
"""


def write(tmp_path: Path, text: str, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(source) -> str:
    with pytest.raises(ValueError) as info:
        load_plan(source)
    assert isinstance(info.value, PlanError)
    return str(info.value)


def test_issue_example_loads(tmp_path):
    plan = load_plan(write(tmp_path, EXAMPLE))
    assert (plan.mesh.pp, plan.mesh.tp, plan.mesh.world_size) == (2, 2, 4)
    assert plan.pipeline.cut_points == ["model.layers.2"] and plan.pipeline.microbatches == 4
    assert plan.tensor_parallel["model.layers.*.mlp.down_proj"] == "row"
    assert plan.source.endswith("plan.yaml")


def test_defaults_and_sources(tmp_path):
    plan = load_plan({})
    assert (plan.mesh.pp, plan.mesh.tp, plan.pipeline.microbatches, plan.pipeline.schedule) == (1, 1, 1, "afab")
    assert plan.pipeline.cut_points is None and plan.tensor_parallel == {}
    as_json = write(tmp_path, json.dumps({"mesh": {"tp": 2}}), "plan.json")
    assert load_plan(as_json).mesh.tp == 2
    assert load_plan(write(tmp_path, "", "empty.yml")).model_dump() == ParallelPlan().model_dump()
    round_trip = load_plan(write(tmp_path, load_plan(write(tmp_path, EXAMPLE)).to_yaml(), "again.yaml"))
    assert round_trip.model_dump() == load_plan(write(tmp_path, EXAMPLE)).model_dump()


def test_hf_aliases():
    plan = load_plan({"tensor_parallel": {"a.q": "colwise", "a.o": "rowwise", "lm_head": "colwise_gather_output",
                                          "a.n": "replicated_with_grad_allreduce", "a.s": "rowwise_split_input"}})
    assert plan.tensor_parallel == {"a.q": "column", "a.o": "row", "lm_head": "column_gather",
                                    "a.n": "grad_allreduce", "a.s": "row_split"}


def test_every_schema_problem_at_once_with_file_and_line(tmp_path):
    text = """mesh: {pp: 0, tp: 0}
tensor_paralel: {}
tensor_parallel:
  "model.layers.*.mlp.up_proj": colum
pipeline:
  microbatches: 0
  schedule: zb-h2
  cut_points: ["model.layers.2", "model.layers.2"]
"""
    message = problems_of(write(tmp_path, text))
    assert "plan.yaml: 6 problems" in message
    assert "line 1: mesh.pp: Input should be greater than or equal to 1 (found 0)" in message
    assert "line 1: mesh.tp: Input should be greater than or equal to 1 (found 0)" in message
    assert "line 2: tensor_paralel: unknown key 'tensor_paralel'; did you mean 'tensor_parallel'?" in message
    assert "line 4: tensor_parallel['model.layers.*.mlp.up_proj']: unknown style 'colum'" in message
    assert "did you mean 'column'?" in message
    assert "line 6: pipeline.microbatches: Input should be greater than or equal to 1 (found 0)" in message
    assert ("line 7: pipeline.schedule: unknown schedule 'zb-h2': the schedules are afab, 1f1b, interleaved-1f1b, "
            "zero-bubble, zbv, and 'custom' with your own pipeline.table") in message
    assert "set pipeline.schedule to one of them (did you mean 'zero-bubble'?)" in message


def test_cut_point_rules():
    message = problems_of({"mesh": {"pp": 3}, "pipeline": {"cut_points": ["model.layers.2"]}})
    assert "pipeline.cut_points: 1 cut point(s) ['model.layers.2'] for mesh.pp=3; need exactly pp - 1 = 2" in message
    message = problems_of({"mesh": {"pp": 3}, "pipeline": {"cut_points": ["model.layers.2", "model.layers.2"]}})
    assert "['model.layers.2'] listed more than once" in message
    # Two stages a rank: pp x virtual_stages - 1 cuts, checked on the raw data too when another field fails.
    two = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "cut_points": ["model.layers.2"]}
    need = "for mesh.pp=2 x virtual_stages=2; need exactly pp x virtual_stages - 1 = 3"
    assert need in problems_of({"mesh": {"pp": 2}, "pipeline": two})
    message = problems_of({"mesh": {"pp": 2, "tp": 0}, "pipeline": {**two, "virtual_stages": 2, "schedule": "1f1b"}})
    assert need in message and "pipeline.schedule '1f1b' runs one stage per rank" in message
    three = ["model.layers.1", "model.layers.2", "model.layers.3"]
    assert load_plan({"mesh": {"pp": 2}, "pipeline": {**two, "cut_points": three}}).pipeline.virtual_stages == 2


def test_types_are_strict():
    assert "mesh.tp: Input should be a valid integer (found True)" in problems_of({"mesh": {"tp": True}})
    assert "mesh.pp: Input should be a valid integer (found '2')" in problems_of({"mesh": {"pp": "2"}})
    with pytest.raises(TypeError, match="load_plan takes a file path, a dict or a ParallelPlan"):
        load_plan(42)


def test_bad_files(tmp_path):
    message = problems_of(write(tmp_path, "mesh: {pp: 2\n"))
    assert "plan.yaml: 1 problem" in message and "line 2, column 1: malformed YAML" in message
    message = problems_of(write(tmp_path, 'mesh: !!python/object/apply:os.system ["echo pwned"]\n'))
    assert "line 1, column 7: YAML tag '!!python/object/apply:os.system' is refused" in message
    message = problems_of(write(tmp_path, "mesh:\n  pp: 2\n  pp: 3\n"))
    assert "line 3, column 3: malformed YAML: duplicate key 'pp' (first on line 2)" in message
    message = problems_of(write(tmp_path, '{"mesh": {"tp": 2}, "mesh": {}}', "plan.json"))
    assert "duplicate key(s) ['mesh']" in message
    missing = problems_of(tmp_path / "missing.yaml")
    assert f"no plan file at {tmp_path / 'missing.yaml'}; the plans in {tmp_path}/: plan.json, plan.yaml" in missing
    assert f"did you mean {tmp_path / 'plan.yaml'}?" in problems_of(tmp_path / "plam.yaml")
    assert "unknown plan file type '.toml'" in problems_of(write(tmp_path, "", "plan.toml"))
    assert "a plan is a mapping" in problems_of(write(tmp_path, "- 1\n- 2\n"))
    assert "is not a module-path pattern" in problems_of({"tensor_parallel": {"model..x": "row"}})


SHIPPED_WORLD = {
    "llama-tp2": 2, "llama-tp2-sp": 2, "llama-tp4": 4, "llama-pp2": 2, "llama-tp2-pp2": 4, "llama-pp2-zbv": 2,
    "llama-fsdp4": 4, "llama-dp2-tp2": 4, "llama-dp2-tp2-pp2": 8, "llama-cp2-tp2": 4,
    "qwen3-moe-dp2-ep2-tp2-pp2": 8,
}


@pytest.mark.parametrize("name", list(SHIPPED_WORLD))
def test_shipped_plans_load(name):
    plan = load_plan(PLANS / f"{name}.yaml")
    assert plan.description
    assert plan.mesh.world_size == SHIPPED_WORLD[name]


def test_every_shipped_plan_is_listed_and_names_its_schema_for_editors():
    assert sorted(p.stem for p in PLANS.glob("*.yaml")) == sorted(SHIPPED_WORLD)
    for path in PLANS.glob("*.yaml"):
        assert path.read_text().startswith("# yaml-language-server: $schema=plan.schema.json\n"), path.name


def test_what_the_readme_examples_make_is_ignored_by_git():
    ignored = (PLANS.parent / ".gitignore").read_text().split()
    assert {"/out/", "/models/", "/runs/"} <= set(ignored)


def test_shipped_data_parallel_plans():
    fsdp4, dp2_tp2, three = (load_plan(PLANS / f"{n}.yaml") for n in ("llama-fsdp4", "llama-dp2-tp2", "llama-dp2-tp2-pp2"))
    assert (fsdp4.mesh.dp, fsdp4.mesh.pp, fsdp4.mesh.tp, fsdp4.data_parallel.sharding) == (4, 1, 1, "full")
    tp_rules = load_plan(PLANS / "llama-tp2.yaml").tensor_parallel
    assert (dp2_tp2.mesh.dp, dp2_tp2.mesh.pp, dp2_tp2.mesh.tp) == (2, 1, 2) and dp2_tp2.tensor_parallel == tp_rules
    assert (three.mesh.dp, three.mesh.pp, three.mesh.tp) == (2, 2, 2) and three.tensor_parallel == tp_rules
    assert (three.pipeline.schedule, three.pipeline.microbatches) == ("1f1b", 4)
    assert three.mesh.shape_text() == "dp=2 x pp=2 x tp=2"


def test_schema_file_in_sync():
    shipped = json.loads((PLANS / "plan.schema.json").read_text())
    assert shipped == ParallelPlan.model_json_schema(), (
        "plans/plan.schema.json is stale: regenerate it with `rewrite schema > plans/plan.schema.json`"
    )
    styles = shipped["properties"]["tensor_parallel"]["additionalProperties"]["enum"]
    assert {"column", "row", "column_gather", "colwise", "rowwise"} <= set(styles)


def test_plan_is_exported():
    assert rewrite.load_plan is load_plan and rewrite.ParallelPlan is ParallelPlan
