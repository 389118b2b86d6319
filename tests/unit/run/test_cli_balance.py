"""`show` and `validate` warn about a stage that holds up the others, naming the cuts that fix it."""

from __future__ import annotations

import json

from rewrite.run.cli import main

SKEWED = """\
mesh: {pp: 2, tp: 1}
pipeline:
  microbatches: 4
  cut_points: ["model.layers.2"]
"""
LLAMA_8B = "tests/configs/llama-3.1-8b.json"


def test_validate_and_show_warn_about_a_skewed_cut_and_name_the_fix(tmp_path, capsys):
    plan = tmp_path / "skewed.yaml"
    plan.write_text(SKEWED)
    assert main(["validate", str(plan), "--model", LLAMA_8B]) == 0  # valid: a warning, not a refusal
    out = capsys.readouterr()
    assert "OK for LlamaForCausalLM" in out.out
    warnings = [line for line in out.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and all('pipeline.cut_points: ["model.layers.' in w for w in warnings), out.err
    assert any("parameters: stage 1 holds" in w for w in warnings) and any("compute: stage 1" in w for w in warnings)

    assert main(["show", str(plan), "--model", LLAMA_8B]) == 0
    text = capsys.readouterr().out
    assert "Warnings:" in text and "stage 1 holds" in text
    assert main(["show", str(plan), "--model", LLAMA_8B, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["warnings"]) == 2 and data["warnings"][0].startswith("parameters: stage 1 holds")


def test_shipped_pipeline_plans_are_balanced_on_a_real_model(capsys):
    for plan in ("plans/llama-tp2-pp2.yaml", "plans/llama-pp2.yaml", "plans/llama-dp2-tp2-pp2.yaml"):
        assert main(["validate", plan, "--model", LLAMA_8B]) == 0
        assert "warning" not in capsys.readouterr().err, plan
        assert main(["show", plan, "--model", LLAMA_8B]) == 0
        assert "Warnings:" not in capsys.readouterr().out, plan
