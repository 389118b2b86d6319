"""Compiled plans in the estimates: the profile's compiled terms, the traced collectives, the backward a
compiled block runs whole, the search weighing `compile` both ways, `rewrite plan --compile`, and what
`rewrite calibrate` writes."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

import rewrite
from rewrite.estimate.correction import Scales, scaled_profile
from rewrite.estimate.hardware import CompiledCosts, Hardware, load_hardware
from rewrite.estimate.memory import rank_memory
from rewrite.estimate.stage_time import stage_times
from rewrite.run.calibrate import profile_yaml
from rewrite.run.presets import build_model
from tests.paths import PLANS
from tests.unit.estimate.test_step_time import UNIT
from tests.unit.run.test_cli import rewrite_cmd

TP_RULES = dict(rewrite.load_plan(PLANS / "llama-tp2.yaml").tensor_parallel)
EAGER = {"layer_overhead_s": 3e-3, "activation_bandwidth": 2e9, "microbatch_overhead_s": 4e-3}
CHEAP = CompiledCosts(layer_overhead_s=1e-3, activation_bandwidth=8e9, microbatch_overhead_s=1e-3)


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", device="meta")  # 4 layers


def _profile(compiled: CompiledCosts | None = CHEAP, **update) -> Hardware:
    return UNIT.model_copy(update={**EAGER, "compiled": compiled, **update})


def _times(llama, hw, *, compile=None, pp=1, tp=1, schedule="afab", sp=False):
    plan = {"mesh": {"pp": pp, "tp": tp}, "tensor_parallel": TP_RULES if tp > 1 else {}, "sequence_parallel": sp,
            "pipeline": {"schedule": schedule, "microbatches": 2 * pp, "seq_len": 16}}
    plan |= {"compile": compile} if compile is not None else {}
    return stage_times(rewrite.resolve(plan, llama), llama, hw, batch_size=2)


def test_a_profile_carries_compiled_terms_and_steps_on_them_only_when_asked():
    hw = _profile()
    assert hw.stepping(False) is hw and _profile(None).stepping(True) == _profile(None)
    on = hw.stepping(True)
    assert (on.layer_overhead_s, on.activation_bandwidth, on.microbatch_overhead_s) == (1e-3, 8e9, 1e-3)
    assert on.compiled == CHEAP and on.intra_node is hw.intra_node  # the links are the same objects (measured curves)
    for bad in ({"layer_overhead_s": -1.0}, {"layer_overhead_s": 0.0, "activation_bandwidth": 0.0},
                {"layer_overhead_s": 0.0, "unknown": 1}):
        with pytest.raises(ValidationError):
            CompiledCosts.model_validate(bad)
    # Rescaled by `plan --measure --profile` as the eager terms are.
    scaled = scaled_profile(hw, Scales(2.0, 1.0, "fitted")).compiled
    assert (scaled.layer_overhead_s, scaled.activation_bandwidth, scaled.microbatch_overhead_s) == (2e-3, 4e9, 2e-3)
    assert all(load_hardware(name).compiled is None for name in ("h100-sxm", "cpu"))  # not measured: eager terms


def test_a_compiled_stage_is_charged_its_terms_and_runs_its_backward_whole(llama):
    hw = _profile()
    eager, same = _times(llama, hw), _times(llama, _profile(CompiledCosts(**EAGER)), compile=True)
    # Equal terms: the same forward and whole backward, all of it in I (W has nothing left to run).
    for e, c in zip(eager, same):
        assert c.forward == pytest.approx(e.forward, rel=1e-12) and c.weight_backward == 0
        assert c.input_backward == pytest.approx(e.input_backward + e.weight_backward, rel=1e-12)
        assert c.backward == pytest.approx(e.backward, rel=1e-12)
    # Cheaper fixed costs: each of 4 layers' F a third of the difference, and half the microbatch's.
    (cheap,), (base,) = _times(llama, _profile(CHEAP.model_copy(update={"activation_bandwidth": 2e9})), compile=True), same
    assert base.forward - cheap.forward == pytest.approx(4 * 2e-3 / 3 + 3e-3 / 2, rel=1e-9)
    assert base.backward - cheap.backward == pytest.approx(4 * 2 * 2e-3 / 3 + 3e-3 / 2, rel=1e-9)
    # Without compiled terms, or traced without inductor's kernels: the eager terms, the backward whole still.
    for hw_, options in ((_profile(None), True), (hw, {"backend": "aot_eager"})):
        (t,) = _times(llama, hw_, compile=options)
        assert t.forward == pytest.approx(eager[0].forward, rel=1e-12) and t.weight_backward == 0
    # Split backwards (zero bubble) get no separate W on a compiled stage: as under recomputation.
    for e, c in zip(_times(llama, hw, pp=2, schedule="zero-bubble"), _times(llama, _profile(CompiledCosts(**EAGER)), pp=2,
                                                                     schedule="zero-bubble", compile=True)):
        assert e.weight_backward > 0 and c.weight_backward == 0 and c.backward == pytest.approx(e.backward)


@pytest.mark.parametrize("sp", [False, True])
def test_compiled_blocks_pay_torch_s_collectives_not_the_layers_own(llama, sp):
    # What gloo's own collectives take against the layers' pairwise swaps, on CPU: 10x here.
    curve = lambda t: {2: {1024: t, 1 << 20: 2 * t}}  # noqa: E731
    times = {"sum": curve(1e-4), "gather": curve(1e-4), "scatter": curve(1e-4),
             "all_reduce": curve(1e-3), "all_gather": curve(1e-3), "reduce_scatter": curve(1e-3)}
    hw = _profile(CompiledCosts(**EAGER), collective_times=times)
    (eager,), (compiled,) = _times(llama, hw, tp=2, sp=sp), _times(llama, hw, tp=2, sp=sp, compile=True)
    assert compiled.tp_comm == pytest.approx(10 * eager.tp_comm, rel=1e-9)
    same = _profile(CompiledCosts(**EAGER), collective_times={**times, "all_reduce": times["sum"],
                                                             "all_gather": times["gather"], "reduce_scatter": times["scatter"]})
    (e,), (c,) = _times(llama, same, tp=2, sp=sp), _times(llama, same, tp=2, sp=sp, compile=True)
    assert c.tp_comm == pytest.approx(e.tp_comm, rel=1e-12) and c.backward == pytest.approx(e.backward, rel=1e-12)


def test_the_search_compiles_where_the_profile_says_it_is_faster(llama):
    search = lambda hw, **kw: rewrite.suggest_plans(llama, world=2, seq_len=16, global_batch=4,  # noqa: E731
                                                    hardware=hw, **kw)
    fast = search(_profile())
    assert all(c.plan.compile is not None for c in fast) and fast[0].summary().endswith(", compiled")
    slow = search(_profile(CompiledCosts(layer_overhead_s=1.0)))
    assert all(c.plan.compile is None for c in slow)
    unmeasured = search(_profile(None))
    assert [c.as_dict() for c in unmeasured] == [c.as_dict() for c in slow]  # eager, as before compiled terms
    forced = search(_profile(None), compiled=True)
    assert all(c.plan.compile is not None for c in forced)
    assert all(c.plan.compile is None for c in search(_profile(), compiled=False))
    # Compiling moves no parameter and no activation the estimate counts: each compiled plan holds what it does eager.
    for c in fast:
        eager = rewrite.resolve(c.plan.model_copy(update={"compile": None}), llama)
        assert max(m.total for m in rank_memory(eager, llama, batch_size=c.batch_size)) == c.peak_bytes


def test_rewrite_plan_writes_the_compiled_plan_and_takes_compile_flags(tmp_path):
    profile = tmp_path / "here.yaml"
    profile.write_text(yaml.safe_dump(_profile().model_dump()))
    args = ("plan", "--model", "tiny-llama", "--world", "2", "--seq-len", "16", "--global-batch", "4",
            "--hardware", str(profile))
    for flags, compiled in (((), True), (("--no-compile",), False), (("--compile",), True)):
        out = tmp_path / f"plan{len(flags)}{compiled}.yaml"
        run = rewrite_cmd(*args, *flags, "--out", str(out))
        assert run.returncode == 0, run.stderr
        plan = rewrite.load_plan(out)
        assert (plan.compile is not None) == compiled and ("compile" in run.stdout) == compiled, flags
        assert (", compiled." in out.read_text()) == compiled
    shipped = rewrite_cmd(*args[:-2], "--hardware", "cpu", "--out", str(tmp_path / "cpu.yaml"))
    assert shipped.returncode == 0 and rewrite.load_plan(tmp_path / "cpu.yaml").compile is None  # no compiled terms


def test_calibrate_writes_the_compiled_terms_or_says_why_not():
    found = {"world": 2, "flops": {"float32": 1e10}, "memory_bandwidth": 2e10, "latency": 1e-5, "link": 1e9,
             "collective": 0.5, "memory_gib": 4.0, **EAGER, "measured": {"p2p": {4: 1e-5}, "all_reduce": {4: 2e-5}}}
    written = lambda **kw: Hardware.model_validate(yaml.safe_load(profile_yaml({**found, **kw})))  # noqa: E731
    assert written(compiled=CHEAP.model_dump()).compiled == CHEAP
    assert written(compiled={**CHEAP.model_dump(), "activation_bandwidth": None}).compiled.activation_bandwidth is None
    assert "--no-compile" in profile_yaml(found) and written().compiled is None
    assert "on a GPU" in profile_yaml({**found, "gpu": True}) and written(gpu=True).compiled is None
