"""The plan search's pruning: `step_lower_bound` never above `predict_step`, and the best-first search
choosing what a pass over every candidate chooses."""

from __future__ import annotations

import dataclasses
import gc

import pytest

import rewrite
from rewrite.estimate import mesh_search
from rewrite.estimate.hardware import load_hardware
from rewrite.estimate.search import NoPlanFits
from rewrite.estimate.search_space import CHECKPOINTING, Bound, bind, binds_sp, meshes, variant
from rewrite.estimate.step_time import predict_step
from rewrite.run.presets import build_model, load_config
from tests.paths import ROOT

GIB = 1024**3


def _bounds(model, dp, pp, tp, seq_len, cp=1):
    """Every binding the search makes for a mesh: vocab/loss parallelism, virtual stages, sequence parallelism."""
    layers, out = model.config.num_hidden_layers, []
    for vocab_loss in (False, True) if tp > 1 else (False,):
        for k in (2, 1) if pp > 1 and 2 * pp <= layers else (1,):
            base = bind(model, dp=dp, pp=pp, tp=tp, k=k, vocab_loss=vocab_loss, sp=False, seq_len=seq_len, cp=cp)
            if isinstance(base, str):
                continue
            out.append(Bound(base, model))
            if tp > 1 and binds_sp(model, base):
                sp = base.plan.model_copy(update={"sequence_parallel": True})
                out.append(Bound(dataclasses.replace(base, plan=sp), model))
    return out


def _groups(model, *, world, G, seq_len, batch):
    """(mesh, bound, schedule, microbatches, sharding, reduce, sequences per replica) of the whole search space."""
    for dp, pp, cp, tp in meshes(world, G, model.config.num_hidden_layers, seq_len=seq_len, max_cp=None):
        if batch % dp:
            continue
        for bound in _bounds(model, dp, pp, tp, seq_len, cp):
            for schedule, m, sharding, reduce in mesh_search._groups(bound, batch // dp):
                yield (dp, pp, cp, tp), bound, schedule, m, sharding, reduce, batch // dp


@pytest.mark.parametrize("case", ["tiny-cpu", "8b-two-nodes"])
def test_the_lower_bound_is_never_above_the_prediction_and_exact_without_a_pipeline(case):
    if case == "tiny-cpu":
        model, hw, kw = build_model("tiny-llama", device="meta"), load_hardware("cpu"), dict(world=4, G=4, seq_len=128, batch=8)
    else:  # tp and dp groups crossing nodes (4 devices each), FSDP2's gathers inside every action under full sharding
        model = build_model(load_config(ROOT / "tests" / "configs" / "llama-3.1-8b.json"), device="meta")
        hw, kw = load_hardware("h100-sxm"), dict(world=8, G=4, seq_len=1024, batch=16)
    checked = exact = 0
    every = [(*g, mode) for g in _groups(model, **kw) for mode in CHECKPOINTING if g[1].allows(mode)]
    for mesh, bound, schedule, m, sharding, reduce, n, mode in every[:: 1 if case == "tiny-cpu" else 7]:  # 8B: a sample
        b = n // m
        low = bound.lower_bound(schedule, m, sharding, reduce, mode, b, hw, kw["G"])
        v = variant(bound.base, schedule=schedule, microbatches=m, sharding=sharding, checkpointing=mode, reduce=reduce)
        step = predict_step(v, model, hw, batch_size=b, gpus_per_node=kw["G"], parameters=bound.parameters).step_s
        assert 0 < low <= step, (mesh, schedule, m, sharding, reduce, mode, low, step)
        checked += 1
        if mesh[0] == mesh[1] == mesh[2] == 1:  # one rank's actions back to back, nothing overlapped: the bound is the step
            assert low == pytest.approx(step, rel=1e-6), (mesh, schedule, m, mode)
            exact += 1
    assert checked > 100 and (exact > 0 or case != "tiny-cpu")


def _exhaustive_best(model, hw, *, world, G, limit, seq_len, batch):
    """Per mesh, the candidate an exhaustive pass keeps: each (binding, schedule, microbatches, sharding,
    reduce) with the least checkpointing that fits, the fastest of them, the first named on a tie."""
    best = {}
    for mesh, bound, schedule, m, sharding, reduce, n in _groups(model, world=world, G=G, seq_len=seq_len, batch=batch):
        for mode in filter(bound.allows, CHECKPOINTING):  # 'selective' where it is estimated
            v = variant(bound.base, schedule=schedule, microbatches=m, sharding=sharding, checkpointing=mode,
                        reduce=reduce)
            params_fit, peak = mesh_search._fits(bound, (schedule, m, sharding, reduce), mode, n // m, limit)
            if not params_fit:
                break
            if peak is None:
                continue
            step = predict_step(v, model, hw, batch_size=n // m, gpus_per_node=G, parameters=bound.parameters)
            if mesh not in best or step.step_s < best[mesh][0]:
                best[mesh] = (step.step_s, v.plan, peak)
            break
    return best


@pytest.mark.parametrize("case", ["tiny-roomy", "tiny-tight", "8b"])  # tight: checkpointing needed
def test_the_best_first_search_keeps_what_an_exhaustive_pass_keeps(case):
    if case == "8b":
        model = build_model(load_config(ROOT / "tests" / "configs" / "llama-3.1-8b.json"), device="meta")
        hardware, world, memory_gib, seq_len, batch = "h100-sxm", 8, 40, 2048, 32
    else:
        model, hardware, world, batch = build_model("tiny-llama", device="meta"), "cpu", 4, 16
        memory_gib, seq_len = (1, 128) if case == "tiny-roomy" else (0.004, 256)
    profile = load_hardware(hardware)  # a plan fits in what the device leaves to tensors
    want = _exhaustive_best(model, profile, world=world, G=4, limit=profile.usable_gib(memory_gib) * GIB,
                            seq_len=seq_len, batch=batch)
    found = rewrite.suggest_plans(model, world=world, device_memory=memory_gib, hardware=hardware, seq_len=seq_len,
                                  global_batch=batch, gpus_per_node=4)
    got = {(c.plan.mesh.dp, c.plan.mesh.pp, c.plan.mesh.cp, c.plan.mesh.tp): (c.step_s, c.plan, c.peak_bytes)
           for c in found}
    assert got.keys() == want.keys() and len(got) >= 3
    for mesh in want:
        assert got[mesh][0] == want[mesh][0], mesh
        assert got[mesh][1].model_dump() == want[mesh][1].model_dump(), mesh
        assert got[mesh][2] == want[mesh][2], mesh
    if case == "tiny-tight":
        assert any(c.checkpointing != "off" for c in found)


def test_the_search_leaves_the_garbage_collector_as_it_found_it():
    model = build_model("tiny-llama", device="meta")
    assert gc.isenabled()
    rewrite.suggest_plans(model, world=2, device_memory=1, hardware="cpu", seq_len=64)
    assert gc.isenabled()
    with pytest.raises(NoPlanFits):
        rewrite.suggest_plans(model, world=2, device_memory=1e-6, hardware="cpu", seq_len=64)
    assert gc.isenabled()
    gc.disable()
    try:
        rewrite.suggest_plans(model, world=2, device_memory=1, hardware="cpu", seq_len=64)
        assert not gc.isenabled()
    finally:
        gc.enable()
