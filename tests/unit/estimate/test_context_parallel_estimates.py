"""The estimates under context parallelism: activations, parameters, step time, `show` and the plan search."""

from __future__ import annotations

import json

import pytest

import rewrite
from rewrite.estimate import predict_step, rank_activations, rank_memory, stage_times
from rewrite.estimate.collectives import all_gather_s
from rewrite.models.flops import layer_flop_parts
from rewrite.run.presets import build_model, load_config
from tests.paths import ROOT
from tests.unit.estimate.test_step_time import UNIT
from tests.unit.run.test_cli import rewrite_cmd

CONFIGS = ROOT / "tests" / "configs"


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", device="meta")  # float32, h 64, 8 heads (4 kv) of 8, i 128, V 256, 4 layers


def _resolved(model, *, cp=1, dp=1, seq_len=16, **extra):
    return rewrite.resolve({"mesh": {"dp": dp, "cp": cp}, "pipeline": {"schedule": "afab", "microbatches": 1,
                                                                          "seq_len": seq_len}, **extra}, model)


def test_activations_at_cp_2_by_hand(llama):
    # s = 16 over cp 2: a rank holds T = 8 tokens, SDPA keeps the whole sequence's gathered k and v (16 tokens, 4
    # kv heads of 8), and the stage its two chunks' masks: L = 4 queries each against 4 and 16 keys, float32.
    norm = 8 * (4 * 64 + 4 * 64 + 4)
    attention = 8 * 4 * 64 + 8 * (4 * 8 * 8 + 2 * 4 * 8 * 8 + 4 * 8) + 16 * 4 * 2 * 4 * 8  # input; q, out, lse; k, v
    mlp = 8 * 4 * 64 + 4 * 8 * 4 * 128
    end = norm + 8 * 4 * 64 + 4 * 8 * 256
    masks = 4 * (4 * 4 + 4 * 16)
    (rank,) = rank_activations(_resolved(llama, cp=2), llama)
    assert rank.peak == 4 * (2 * norm + attention + mlp) + end + masks == 171616
    (one,) = rank_activations(_resolved(llama), llama)
    assert 0.5 < rank.peak / one.peak < 0.6  # half the tokens, the whole k and v and the masks on top
    (four,) = rank_activations(_resolved(llama, cp=4), llama)
    assert four.peak < rank.peak


def test_parameters_are_shared_over_dp_x_cp(llama):
    cp = rank_memory(_resolved(llama, cp=2), llama)
    dp = rank_memory(_resolved(llama, dp=2), llama)
    one = rank_memory(_resolved(llama), llama)
    assert [(m.rank, m.cp_rank, m.tp_rank) for m in cp] == [(0, 0, 0), (1, 1, 0)]  # both cp ranks listed, alike
    assert cp[0].weights == cp[1].weights == dp[0].weights < one[0].weights  # FSDP2 over the 2 cp ranks
    assert cp[0].gathered == dp[0].gathered > 0
    both = rank_memory(_resolved(llama, cp=2, dp=2), llama)
    assert len(both) == 2 and both[0].weights == rank_memory(_resolved(llama, dp=4), llama)[0].weights


def test_stage_times_at_cp_2_by_hand(llama):
    (t,) = stage_times(_resolved(llama, cp=2), llama, UNIT)
    parts = layer_flop_parts(llama.config, seq_len=16)
    linear = (parts["q_o"] + parts["k_v"] + parts["mlp"] + parts["norms"]) / 2  # half the tokens
    scores = parts["scores"] * 5 / 8  # (2c + 1) L^2 pairs, charged twice as one process's causal ones
    kv = all_gather_s(2 * 16 * 4 * 8 * 4, 2, UNIT.intra_node, 1.0)  # the whole sequence's k and v, float32
    head = (2 * 8 * 64 * 256 + 5 * 8 * 256 + 4 * 8 * 64) / 1e9  # head, loss and final norm on 8 tokens
    assert t.forward == pytest.approx(4 * ((linear + scores) / 1e9 + kv) + head)
    assert t.cp_comm == pytest.approx(4 * 2 * kv)  # gathered in F, reduce-scattered in I
    assert t.tp_comm == 0
    # A cp group over two nodes gathers over the network.
    (far,) = stage_times(_resolved(llama, cp=2), llama, UNIT, gpus_per_node=1)
    assert far.cp_comm == pytest.approx(4 * 2 * all_gather_s(2 * 16 * 4 * 8 * 4, 2, UNIT.inter_node, 1.0))
    step = predict_step(_resolved(llama, cp=2), llama, UNIT)
    assert step.tokens_per_s == pytest.approx(16 / step.step_s / 2)  # one sequence a step over 2 devices
    assert step.dp_s > 0  # the gradients reduced over the 2 cp ranks


def test_show_prints_the_cp_ranks_and_the_memory_it_estimates(tmp_path, llama):
    plan = tmp_path / "cp.yaml"
    plan.write_text("mesh: {dp: 2, cp: 2}\npipeline: {seq_len: 64, microbatches: 2}\n")
    shown = rewrite_cmd("show", str(plan), "--model", "tiny-llama", "--hardware", "cpu")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "mesh: dp=2 x pp=1 x cp=2 x tp=1 = 4 ranks" in text and "cp_rank" in text
    assert "each of a stage's 2 cp ranks holds 32 of a sequence's 64 tokens" in text
    assert "sharding full over the 4 ranks holding the same parameters" in text
    assert "1 sequence of 64 tokens (32 on each cp rank)" in text and "Predicted step on cpu" in text
    data = json.loads(rewrite_cmd("show", str(plan), "--model", "tiny-llama", "--json").stdout)
    expected = rank_memory(rewrite.resolve(rewrite.load_plan(plan), llama), llama)
    assert [(r["rank"], r["cp_rank"], r["total"]) for r in data["memory"]["ranks"]] == \
        [(m.rank, m.cp_rank, m.total) for m in expected]
    assert data["mesh"]["cp"] == 2 and data["stages"][0]["ranks"] == [0, 1]
    bad = tmp_path / "odd.yaml"
    bad.write_text("mesh: {cp: 2}\npipeline: {seq_len: 30}\n")
    refused = rewrite_cmd("show", str(bad), "--model", "tiny-llama")
    assert refused.returncode != 0 and "use a length that 4 divides, e.g. 28 or 32" in refused.stderr


def test_the_planner_proposes_cp_where_the_sequence_demands_it(tmp_path):
    config = load_config(CONFIGS / "llama-3.1-8b.json")
    long = rewrite.suggest_plans(config, world=8, device_memory=48, seq_len=131072, global_batch=8)
    assert long[0].plan.mesh.cp > 1, long[0].summary()  # tp alone does not hold it at full speed
    assert all(c.plan.mesh.cp == 1 for c in rewrite.suggest_plans(config, world=8, device_memory=48, seq_len=131072,
                                                                   global_batch=8, max_cp=1))
    short = rewrite.suggest_plans(config, world=8, device_memory=80, seq_len=2048)
    assert short[0].plan.mesh.cp == 1
    # A length 2 cp does not divide leaves that cp out.
    odd = rewrite.suggest_plans(config, world=8, device_memory=80, seq_len=4098, global_batch=8)
    assert {c.plan.mesh.cp for c in odd} <= {1}
    with pytest.raises(ValueError, match="max_cp"):
        rewrite.suggest_plans(config, world=8, max_cp=0)
    # `rewrite plan` writes the cp plan, and `show` of it holds the memory planned.
    out = tmp_path / "long.yaml"
    run = rewrite_cmd("plan", "--model", str(CONFIGS / "llama-3.1-8b.json"), "--world", "8", "--device-memory", "48",
                      "--seq-len", "131072", "--global-batch", "8", "--out", str(out), "--json")
    assert run.returncode == 0, run.stderr
    best = json.loads(run.stdout)["candidates"][0]
    assert best["plan"]["mesh"]["cp"] > 1
    line = next(x for x in out.read_text().splitlines() if x.startswith("#   rewrite show"))
    data = json.loads(rewrite_cmd(*line.removeprefix("#   rewrite ").split(), "--json").stdout)
    assert max(r["total"] for r in data["memory"]["ranks"]) == best["peak_bytes"]
    assert data["predicted"]["step_s"] == pytest.approx(best["step_s"])
