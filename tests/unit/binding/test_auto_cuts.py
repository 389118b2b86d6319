"""`pipeline.cut_points: auto`: the compute estimate, the split it picks, and the shares `show` prints."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

import rewrite
from rewrite import load_plan, resolve
from rewrite.models.hf_decoder import find_backbone
from rewrite.models.flops import TRAINING, embed_flops, estimate_costs, head_flops, layer_flops
from rewrite.binding.cuts import balanced_split, best_split
from rewrite.run.show.report import format_plan
from rewrite.run.presets import build_config, build_model
from tests.models import ToyNet
from tests.paths import PLANS

# Llama-3.1-8B's sizes.
BIG = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


@pytest.fixture(scope="module")
def heavy_head():
    """Eight small layers under a 4096-token vocabulary: at SEQ tokens the head weighs about four layers."""
    return build_model(build_config("tiny-llama", vocab_size=4096, num_hidden_layers=8), device="meta")


# The tiny models' own context (max_position_embeddings); at 2048 tokens their 8-dim heads' attention
# would outweigh everything else.
SEQ = 256


def problems(plan, model) -> str:
    with pytest.raises(ValueError) as info:
        resolve(plan, model)
    return str(info.value)


def contiguous_splits(n: int, pp: int):
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        yield [bounds[s + 1] - bounds[s] for s in range(pp)]


def test_a_layer_counts_what_a_hand_count_does():
    config, s = build_config("tiny-llama"), 16  # h 64, 8 heads of 8, 4 kv heads, intermediate 128
    q = o = 2 * s * 64 * 64
    k = v = 2 * s * 64 * 32  # GQA: 4 kv heads of 8
    scores = weighted_sum = 2 * s * s * 64  # (s, 8) x (8, s) per head, 8 heads
    mlp = 3 * 2 * s * 64 * 128
    norms = 2 * 4 * s * 64
    assert layer_flops(config, seq_len=s) == q + k + v + o + scores + weighted_sum + mlp + norms
    assert head_flops(config, seq_len=s) == 4 * s * 64 + 2 * s * 64 * 256 + 5 * s * 256
    assert 0 < embed_flops(config, seq_len=s) < layer_flops(config, seq_len=s) / 100
    # Qwen3 sets head_dim apart from hidden / heads.
    qwen = build_config("tiny-qwen3", head_dim=16)
    assert layer_flops(qwen, seq_len=s) - layer_flops(build_config("tiny-qwen3"), seq_len=s) == (
        2 * s * 64 * 8 * (2 * 8 + 2 * 4) + 4 * s * s * 8 * 8
    )


def test_a_config_without_a_size_is_named():
    with pytest.raises(ValueError, match=r"config.intermediate_size is None; the compute estimate needs a positive"):
        layer_flops(SimpleNamespace(hidden_size=64, num_attention_heads=8), seq_len=4)


def test_a_big_vocabulary_head_outweighs_a_layer_and_attention_grows_with_the_square():
    config = build_config("tiny-llama", num_hidden_layers=32, **BIG)
    assert 1.5 < head_flops(config, seq_len=2048) / layer_flops(config, seq_len=2048) < 2.5
    # Attention grows with the square of the length, the head linearly: at 32k tokens the two are close.
    assert 1.0 < head_flops(config, seq_len=32768) / layer_flops(config, seq_len=32768) < 1.2
    model = build_model(config, device="meta")
    costs = estimate_costs(config, find_backbone(model), num_layers=32, seq_len=2048)
    assert costs.layers == (TRAINING * layer_flops(config, seq_len=2048),) * 32
    assert costs.embed < costs.layers[0] / 1000 < costs.head


def test_best_split_is_the_exact_optimum_and_favours_the_earliest_stages():
    for n in range(1, 8):
        for pp in range(1, n + 1):
            assert best_split([5] * n, pp) == balanced_split(n, pp)
    weights = [3, 1, 4, 1, 5, 9, 2, 6]
    for pp in range(1, 9):
        sizes = best_split(weights, pp)

        def loads(split):
            starts = [sum(split[:s]) for s in range(len(split))]
            return [sum(weights[a : a + k]) for a, k in zip(starts, split)]

        assert max(loads(sizes)) == min(max(loads(split)) for split in contiguous_splits(8, pp))
    with pytest.raises(ValueError, match="3 stages for 2 layers"):
        best_split([1, 1], 3)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_auto_lightens_the_last_stage_and_is_optimal(heavy_head, pp):
    auto = resolve({"mesh": {"pp": pp}, "pipeline": {"cut_points": "auto", "seq_len": SEQ}}, heavy_head)
    sizes = [len(s.layers) for s in auto.stages]
    assert sizes[-1] < balanced_split(8, pp)[-1], sizes
    assert sum(sizes) == 8 and min(sizes) >= 1
    assert auto.cut_points == tuple(f"model.layers.{sum(sizes[:s])}" for s in range(1, pp))
    best = max(auto.costs.stage_costs(sizes))
    for split in contiguous_splits(8, pp):
        assert best <= max(auto.costs.stage_costs(split)), split
    shares = [s.est_compute for s in auto.stages]
    assert sum(shares) == pytest.approx(1.0)
    assert shares == pytest.approx(auto.costs.shares(sizes))


def test_auto_weighs_an_unsharded_head_against_tensor_parallel_layers(heavy_head):
    rules = load_plan(PLANS / "llama-tp2.yaml").tensor_parallel  # the layers' linears, not lm_head
    pipeline = {"cut_points": "auto", "seq_len": SEQ}
    one = resolve({"mesh": {"pp": 2}, "pipeline": pipeline}, heavy_head)
    two = resolve({"mesh": {"pp": 2, "tp": 2}, "tensor_parallel": rules, "pipeline": pipeline}, heavy_head)
    assert two.costs.layers[0] == one.costs.layers[0] // 2 and two.costs.head == one.costs.head
    assert len(two.stages[-1].layers) <= len(one.stages[-1].layers)


def test_auto_on_one_stage_cuts_nothing(heavy_head):
    resolved = resolve({"pipeline": {"cut_points": "auto"}}, heavy_head)
    assert resolved.cut_points == () and len(resolved.stages) == 1
    assert resolved.stages[0].layers == tuple(f"model.layers.{i}" for i in range(8))
    assert resolved.stages[0].est_compute == pytest.approx(1.0)


def test_auto_needs_a_layer_per_stage():
    tiny = build_model("tiny-llama", device="meta")
    message = problems({"mesh": {"pp": 5}, "pipeline": {"cut_points": "auto"}}, tiny)
    assert "mesh.pp=5 stages but the model has 4 layers; each stage needs at least one layer" in message


@pytest.mark.parametrize("pp", [1, 2])
def test_auto_is_refused_for_a_traced_model(pp):
    message = problems({"mesh": {"pp": pp}, "pipeline": {"cut_points": "auto"}}, ToyNet())
    assert "pipeline.cut_points: 'auto' balances the estimated compute of Hugging Face LLaMA-family layers" in message
    assert "ToyNet is split by torch.fx and its modules have no cost estimate" in message
    if pp == 2:
        assert "list the pp - 1 = 1 module paths where stages start (its layer sequence: blocks.0," in message
    else:
        assert "omit cut_points: one stage needs none" in message


def test_the_default_split_is_still_by_layer_count(heavy_head):
    resolved = resolve({"mesh": {"pp": 3}, "pipeline": {"seq_len": SEQ}}, heavy_head)
    assert resolved.plan.pipeline.cut_points is None
    assert [len(s.layers) for s in resolved.stages] == balanced_split(8, 3) == [3, 3, 2]
    assert resolved.cut_points == ("model.layers.3", "model.layers.6")
    shares = [s.est_compute for s in resolved.stages]
    assert shares[-1] > shares[0], "the head's weight shows on the last stage"


def test_auto_and_seq_len_load_from_a_file(tmp_path, heavy_head):
    path = tmp_path / "auto.yaml"
    path.write_text("mesh: {pp: 2}\npipeline:\n  microbatches: 2\n  cut_points: auto\n  seq_len: 512\n")
    plan = load_plan(path)
    assert plan.pipeline.cut_points == "auto" and plan.pipeline.seq_len == 512
    again = tmp_path / "again.yaml"
    again.write_text(plan.to_yaml())
    assert load_plan(again).model_dump() == plan.model_dump()
    assert resolve(path, heavy_head).costs.seq_len == 512
    assert load_plan({}).pipeline.seq_len == 2048


def test_cut_points_mistakes_have_one_message_each(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mesh: {pp: 2}\npipeline:\n  cut_points: model.layers.2\n  seq_len: 0\n")
    with pytest.raises(ValueError) as info:
        load_plan(path)
    message = str(info.value)
    assert f"{path}: 2 problems" in message
    assert (
        "line 3: pipeline.cut_points: 'model.layers.2' is neither a list of module paths nor 'auto'; "
        "for one cut write a list, cut_points: ['model.layers.2']; or write 'auto'"
    ) in message
    assert "line 4: pipeline.seq_len: Input should be greater than or equal to 1 (found 0)" in message
    with pytest.raises(ValueError) as info:
        load_plan({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["model layers"]}})
    assert "pipeline.cut_points[0]: 'model layers' is not a module-path pattern" in str(info.value)
    assert "auto" not in str(info.value), "a list is reported as a list, not against 'auto' too"


def test_show_prints_each_stages_share(heavy_head):
    plan = {"mesh": {"pp": 2}, "pipeline": {"cut_points": "auto", "seq_len": 256}}
    resolved = resolve(plan, heavy_head)
    text = format_plan(resolved)
    flat = " ".join(text.split())  # prose wraps at 100 columns
    assert "Pipeline: 2 stages, cut at model.layers." in text
    assert "(auto); est. compute: training FLOPs per stage for 256-token sequences (pipeline.seq_len)" in flat
    rows = [line.split() for line in text.splitlines()]
    assert ["stage", "ranks", "est.", "compute", "modules"] in rows
    for stage in resolved.stages:
        row = next(r for r in rows if r[:2] == [str(stage.stage_idx), str(stage.stage_idx)] and r[2].endswith("%"))
        assert row[2] == f"{stage.est_compute:.0%}"
    balanced = " ".join(format_plan(resolve({"mesh": {"pp": 2}}, heavy_head)).split())
    assert "est. compute: training FLOPs per stage for 2048-token sequences" in balanced
    assert "(auto)" not in balanced
    traced = format_plan(resolve({"mesh": {"pp": 2}}, ToyNet()))
    assert "est. compute" in traced and "training FLOPs" not in traced
    assert [r[:3] for r in (line.split() for line in traced.splitlines()) if r[:1] == ["1"]][0] == ["1", "1", "-"]


def test_the_public_api_keeps_the_shares():
    resolved = rewrite.resolve(PLANS / "llama-pp2.yaml", build_model("tiny-llama", device="meta"))
    assert all(0 < s.est_compute < 1 for s in resolved.stages)
