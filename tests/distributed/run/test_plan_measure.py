"""`rewrite plan --measure K` end to end: the top plans timed on 2 local ranks, the fastest measured written
as the plan, the corrected profile written and read back by the next `plan`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from rewrite.estimate.hardware import CompiledCosts, load_hardware
from tests.paths import ROOT
from tests.unit.run.test_cli import rewrite_cmd

JOB = ("--model", "tiny-llama", "--world", "2", "--seq-len", "32", "--global-batch", "4")
ROW = re.compile(r"^\s+(\d)\s+(.+?)\s{2,}(\S+)\s+(\S+) \((\S+)-(\S+)\)\s+(\S+)\s+(\S+)$", re.MULTILINE)


def test_measure_times_the_top_plans_keeps_the_fastest_and_corrects_the_profile(tmp_path):
    plan, profile = tmp_path / "plan.yaml", tmp_path / "here.yaml"
    run = subprocess.run(
        [sys.executable, "-m", "rewrite", "plan", *JOB, "--hardware", "cpu", "--measure", "3", "--measure-steps", "2",
         "--profile", str(profile), "--out", str(plan)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # Before it starts: what it will do and about how long; then a line per plan timed (stderr is not a terminal).
    assert re.search(r"^measuring the top 3 plans on 2 local ranks \(CPU\), 1 warm-up \+ 2 steps each: about \S+ s",
                     run.stderr, re.MULTILINE), run.stderr
    assert re.findall(r"^timed plan (\d)/3, step 3/3", run.stderr, re.MULTILINE) == ["1", "2", "3"], run.stderr
    assert "Measured here (2 local ranks, median of 2 steps after a warm-up" in run.stdout
    rows = {int(m[0]): m for m in ROW.findall(run.stdout)}
    assert sorted(rows) == [1, 2, 3], run.stdout
    for _, summary, predicted, measured, low, high, ratio, corrected in rows.values():
        assert float(low) <= float(measured) <= float(high) and float(measured) > 0
        assert float(ratio) == pytest.approx(float(measured) / float(predicted), abs=0.01 + 0.01 * float(ratio))
    fastest = min(rows, key=lambda i: float(rows[i][3]))
    assert f"fastest measured: #{fastest}" in run.stdout and "(fastest measured)" in rows[fastest][1]
    assert re.search(r"^correction: compute x\S+, communication x\S+ \((fitted|one scale: .+)\); the corrected "
                     r"predictions are within \d+% of the measured steps", run.stdout, re.MULTILINE), run.stdout
    # The plan written is the fastest measured, and says what it measured.
    text = plan.read_text()
    summary = rows[fastest][1].removesuffix(" (fastest measured)")
    assert f"# {summary}.\n" in text
    assert f"# measured here by --measure 3: {rows[fastest][3]} s a step on 2 local ranks" in text
    assert yaml.safe_load(text)["mesh"]  # a plan file
    # The corrected profile reads back, and the next search predicts what the table called corrected.
    assert f"wrote {profile}: plan with it next time here (--hardware {profile})" in run.stdout
    hw = load_hardware(profile)
    assert hw.name == "cpu-measured"
    assert profile.read_text().startswith("# cpu-measured: cpu corrected by `rewrite plan --model tiny-llama --world 2")
    again = rewrite_cmd("plan", *JOB, "--hardware", str(profile), "--json")
    assert again.returncode == 0, again.stderr
    predicted = {c["summary"]: c["step_s"] for c in json.loads(again.stdout)["candidates"]}
    # The search lists the best of each mesh: with the corrected terms another variant of a measured plan's mesh
    # (sp on or off) may take its place. Every measured plan it still lists is predicted as the table said.
    listed = [(summary.removesuffix(" (fastest measured)"), corrected) for _, summary, *_, corrected in rows.values()
              if summary.removesuffix(" (fastest measured)") in predicted]
    assert listed, (rows, predicted)
    for name, corrected in listed:
        assert predicted[name] == pytest.approx(float(corrected), rel=6e-3), name


def test_measure_times_each_plan_compiled_and_eager_where_the_search_weighed_both(tmp_path):
    plan, profile = tmp_path / "plan.yaml", tmp_path / "compiled.yaml"
    # The shipped CPU profile with compiled terms (as `rewrite calibrate` measures them): the search weighs both.
    cpu = load_hardware("cpu")
    profile.write_text(yaml.safe_dump(cpu.model_copy(update={"compiled": CompiledCosts(layer_overhead_s=0.0)}).model_dump()))
    run = subprocess.run(
        [sys.executable, "-m", "rewrite", "plan", *JOB, "--hardware", str(profile), "--measure", "2",
         "--measure-steps", "1", "--out", str(plan)],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^measuring the top 2 plans, compiled and eager, on 2 local ranks", run.stderr, re.MULTILINE)
    assert re.search(r"^note: 2 of them compile their blocks in their warm-up step .*; kept in \S+\)$", run.stderr,
                     re.MULTILINE), run.stderr
    rows = {rank: m for rank, *m in re.findall(r"^\s+(\d'?)\s+(.+?)\s{2,}(\S+)\s+(\S+) \(\S+-\S+\)\s+\S+\s+\S+$",
                                                  run.stdout, re.MULTILINE)}
    assert sorted(rows) == ["1", "1'", "2", "2'"], run.stdout
    for n in ("1", "2"):  # the planner's plans compiled (cheaper layers in this profile), the same plans eager beside
        planned, other = rows[n][0].removesuffix(" (fastest measured)"), rows[n + "'"][0].removesuffix(" (fastest measured)")
        assert planned.endswith(", compiled") and other == planned.removesuffix(", compiled"), (planned, other)
    faster = sum(float(rows[n][2]) < float(rows[n + "'"][2]) for n in ("1", "2"))
    assert f"compiled faster, measured, for {faster} of 2" in run.stdout, run.stdout
    # The fastest of the four is the plan written, compiled or not as it ran fastest.
    fastest = min(rows, key=lambda r: float(rows[r][2]))
    assert f"fastest measured: #{fastest}" in run.stdout and "(fastest measured)" in rows[fastest][0]
    assert (", compiled" in rows[fastest][0]) == ("compile" in yaml.safe_load(plan.read_text()))
    # Each compiled plan's blocks compiled for it: none fell back to eager, torch never hit its recompile limit.
    assert "runs eagerly" not in run.stderr and "recompile_limit" not in run.stderr, run.stderr[-3000:]
