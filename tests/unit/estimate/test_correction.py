"""A profile corrected by measured steps (`estimate.correction`, `rewrite plan --measure`): the fit, the
rescaled profile against the step model, the file it is written to, and bad input."""

from __future__ import annotations

import pytest

import rewrite
from rewrite.estimate.correction import Parts, Scales, fit_scales, prediction_parts, profile_text, scaled_profile
from rewrite.estimate.hardware import load_hardware
from rewrite.run.presets import build_model
from tests.paths import ROOT
from tests.unit.run.test_cli import rewrite_cmd


def test_the_fit_recovers_both_scales_and_falls_back_to_one_where_it_cannot():
    parts = [Parts(2.0, 1.5), Parts(3.0, 1.0), Parts(1.0, 0.9)]
    measured = [1.3 * p.compute + 2.5 * p.communication for p in parts]
    found = fit_scales(parts, measured)
    assert found == Scales(1.3, 2.5, "fitted")
    assert [found.corrected(p) for p in parts] == pytest.approx(measured, rel=1e-6)
    # Every plan with the same share of communication: the parts cannot be told apart.
    alike = fit_scales([Parts(2.0, 1.0), Parts(4.0, 2.0)], [3.0, 6.0])
    assert alike.compute == alike.communication == pytest.approx(1.5) and "alike" in alike.how
    one = fit_scales([Parts(2.0, 1.0)], [5.0])
    assert one.compute == one.communication == pytest.approx(2.5) and one.how == "one scale: one plan measured"
    # A fit that makes communication free (or negative) is noise: one scale instead, named.
    wild = fit_scales([Parts(2.0, 1.0), Parts(2.0, 1.9)], [1.0, 2.0])
    assert wild.compute == wild.communication and "out of bounds" in wild.how
    no_comm = fit_scales([Parts(1.0, 1.0), Parts(2.0, 2.0)], [2.0, 4.0])
    assert no_comm.compute == pytest.approx(2.0) and "alike" in no_comm.how
    for parts, bad in (([], []), ([Parts(1.0, 1.0)], []), ([Parts(1.0, 1.0)], [1.0, 2.0]), ([Parts(1.0, 1.0)], [0.0])):
        with pytest.raises(ValueError, match="measured"):
            fit_scales(parts, bad)


@pytest.mark.parametrize("hardware", ["cpu", "h100-sxm"])
def test_the_rescaled_profile_scales_each_part_of_every_prediction(hardware, tmp_path):
    model = build_model("tiny-llama", device="meta")
    hw = load_hardware(hardware)
    # Slower compute on the CPU profile; on the GPU one a compute scale below its matmul efficiency moves the peak.
    scales = Scales(1.7, 0.6, "fitted") if hardware == "cpu" else Scales(0.5, 3.0, "fitted")
    fixed = hw.model_copy(update={"layer_overhead_s": 1e-4, "microbatch_overhead_s": 2e-4, "activation_bandwidth": 1e9})
    corrected = scaled_profile(fixed, scales)
    for name in ("llama-tp2", "llama-pp2", "llama-fsdp4", "llama-dp2-tp2-pp2"):
        resolved = rewrite.resolve(ROOT / "plans" / f"{name}.yaml", model)
        before = prediction_parts(resolved, model, fixed, batch_size=2)
        after = prediction_parts(resolved, model, corrected, batch_size=2)
        assert after.compute == pytest.approx(scales.compute * before.compute, rel=1e-9), name
        assert before.communication > 0, name
        if name == "llama-tp2":  # nothing overlaps tp's collectives: the step is the two parts' sum
            assert after.predicted == pytest.approx(scales.corrected(before), rel=1e-9), name
    assert corrected.efficiency.matmul <= 1 and corrected.name == f"{hardware}-measured"
    if hardware == "h100-sxm":
        assert corrected.efficiency.matmul == 1.0 and corrected.peak_flops["bfloat16"] == pytest.approx(
            hw.peak_flops["bfloat16"] * hw.efficiency.matmul / 0.5)
    assert corrected.inter_node == fixed.inter_node  # not used by the plans measured: kept
    assert scaled_profile(corrected, scales).name == corrected.name
    path = tmp_path / "here.yaml"
    path.write_text(profile_text(corrected, ["corrected by a test", "", "second line"]))
    assert load_hardware(path) == corrected
    assert path.read_text().startswith("# corrected by a test\n#\n# second line\n# Written ")


def test_bad_measure_flags_are_refused_before_the_search():
    base = ("plan", "--model", "tiny-llama", "--world", "2", "--seq-len", "32", "--global-batch", "4")
    cases = {
        ("--hardware", "cpu", "--measure", "0"): "--measure 0: give the number of plans to time",
        ("--hardware", "cpu", "--measure", "2", "--measure-steps", "0"): "--measure-steps 0: time at least 1 step",
        ("--hardware", "cpu", "--profile", "x.yaml"): "--profile writes a profile corrected by measured steps: add --measure K",
        ("--hardware", "h100-sxm", "--measure", "2"): "--hardware h100-sxm describes GPUs",
    }
    for extra, message in cases.items():
        run = rewrite_cmd(*base, *extra)
        assert run.returncode == 2 and message in run.stderr and not run.stdout, (extra, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_measured_plans_as_json_and_the_fastest():
    from rewrite.estimate.mesh_search import Candidate
    from rewrite.run.measure import Timed
    from rewrite.run.plan_measure import Measured

    plan = rewrite.load_plan(ROOT / "plans" / "llama-tp2.yaml")
    candidates = [Candidate(plan, 2, step, 0.0, 0.0, 0.0, 1, True, "off") for step in (1.0, 2.0)]
    timed = [Timed((3.0, 2.5, 2.0), None), Timed((1.5, 1.0, 1.2), 123)]
    parts = [Parts(1.0, 0.5), Parts(2.0, 1.5)]
    scales = Scales(2.0, 1.0, "fitted")
    found = Measured(candidates, timed, parts, scales, load_hardware("cpu"))
    assert found.fastest == 1 and timed[0].median_s == 2.5
    data = found.as_dict()
    assert data["fastest"] == 1 and data["scales"] == {"compute": 2.0, "communication": 1.0, "how": "fitted"}
    assert [(p["index"], p["predicted_s"], p["measured_s"], p["corrected_s"], p["measured_peak_bytes"])
            for p in data["plans"]] == [(0, 1.0, 2.5, 1.5, None), (1, 2.0, 1.2, 3.5, 123)]
    assert data["plans"][1]["steps_s"] == [1.5, 1.0, 1.2] and data["plans"][0]["summary"] == candidates[0].summary()
