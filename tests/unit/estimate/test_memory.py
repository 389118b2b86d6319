"""Memory per rank under data parallelism, and how `rewrite show` prints dp plans."""

from __future__ import annotations

import math

import pytest

import rewrite
from rewrite.estimate.memory import footprint, rank_footprints
from rewrite.run.show.columns import format_bytes
from rewrite.run.show.data import show_data
from rewrite.run.show.memory import memory_table
from rewrite.run.show.report import format_plan
from rewrite.run.presets import build_model
from tests.paths import PLANS

TP_RULES = rewrite.load_plan(PLANS / "llama-tp2.yaml").tensor_parallel


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", device="meta")


def _plan(dp: int, sharding: str = "full", pp: int = 1, tp: int = 1, schedule: str = "afab", k: int = 1) -> dict:
    return {
        "mesh": {"dp": dp, "pp": pp, "tp": tp},
        "tensor_parallel": TP_RULES if tp > 1 else {},
        "pipeline": {"schedule": schedule, "virtual_stages": k, "microbatches": 4},
        "data_parallel": {"sharding": sharding},
    }


def _flat(text: str) -> str:
    return " ".join(text.split())  # prose wraps at 100 columns


def _rows(text: str, rank: str) -> list[str]:
    # The per-rank memory row of `rank`: rank, stages, tp_rank, params, then sizes of 2 words each (weights,
    # grads, AdamW, [gathered,] activations or "-", total).
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "stages"])
    return next(r for r in (line.split() for line in lines[start + 2 :]) if r[0] == rank)


def test_footprint_pads_dim_0_to_a_multiple_of_dp():
    # [3, 4] float32 over dp=2: rows padded to 4, 2 rows of 4 per rank; a scalar counts as [1].
    full = footprint([((3, 4), 4), ((), 4)], dp=2, sharding="full")
    assert full.params == 2 * 4 + 1
    assert (full.weights, full.grads, full.adamw) == (36, 36, 72)
    # Peak: weights + AdamW held, the parameters gathered with their padding (2 x 9 x 4), whole gradients (13 x 4):
    # one unit here, so full (the largest unit gathered) and grad_op (all of them) gather alike.
    assert full.peak == 36 + 72 + 72 + 52
    assert footprint([((3, 4), 4), ((), 4)], dp=2, sharding="grad_op") == full
    # Two layers and the root: full gathers the root and the larger layer (2 x (1 + 8) x 4), grad_op
    # or a split schedule all (2 x 13 x 4); held 18 x 4, whole gradients 21 x 4.
    units = [((3, 4), 4, "layer 0"), ((2, 4), 4, "layer 1"), ((), 4, "root")]
    assert footprint(units, dp=2, sharding="full").peak == 52 + 104 + 72 + 84
    assert footprint(units, dp=2, sharding="grad_op").peak == footprint(units, dp=2, split=True).peak == 52 + 104 + 104 + 84
    rep = footprint([((3, 4), 4), ((), 4)], dp=2, sharding="replicate")
    assert (rep.params, rep.weights, rep.grads, rep.adamw) == (13, 52, 52, 104)
    assert rep.peak == 52 + 104 + 52 + 52  # replicate's second copy (DDP's buckets) beside the parameters
    alone = footprint([((3, 4), 2)], dp=1, sharding="full")
    assert (alone.params, alone.weights, alone.adamw, alone.peak, alone.at_rest) == (12, 24, 96, 144, 144)
    with pytest.raises(ValueError, match="use one of full, grad_op, replicate"):
        footprint([((3, 4), 4)], dp=2, sharding="zero3")


def test_reduce_per_microbatch_holds_the_shards_and_one_layer_of_whole_gradients():
    # The units above: reduced as each backward ends, the reduced shards (13 x 4) accumulate beside the
    # root's and the larger layer's whole gradients (2 x (1 + 8) x 4), where a step's one reduce waits
    # on every whole gradient (21 x 4).
    units = [((3, 4), 4, "layer 0"), ((2, 4), 4, "layer 1"), ((), 4, "root")]
    assert footprint(units, dp=2, sharding="full", reduce="microbatch").peak == 52 + 104 + 72 + 52 + 72
    assert footprint(units, dp=2, sharding="grad_op", reduce="microbatch").peak == 52 + 104 + 104 + 52 + 72
    for sharding in ("full", "grad_op", "replicate"):  # what is held between steps does not change
        step, each = (footprint(units, dp=2, sharding=sharding, reduce=r) for r in ("step", "microbatch"))
        assert step.at_rest == each.at_rest
    assert footprint(units, dp=2, sharding="replicate", reduce="microbatch") == footprint(units, dp=2, sharding="replicate")
    # Eight [4, 4] layers and a [4, 4] root over dp 4: whole gradients 9 x 64 bytes, against the shards
    # (9 x 16) and one layer with the root (2 x 64).
    many = [((4, 4), 4, f"layer {i}") for i in range(8)] + [((4, 4), 4, "root")]
    step, each = (footprint(many, dp=4, sharding="full", reduce=r) for r in ("step", "microbatch"))
    assert step.peak - each.peak == 9 * 64 - (9 * 16 + 2 * 64)
    with pytest.raises(ValueError, match="use one of step, microbatch"):
        footprint(units, dp=2, reduce="layer")


def test_one_whole_backward_a_rank_reduces_as_it_goes_under_step_too(llama):
    # The runner arms the sync before a step's last whole backward: with one microbatch and one stage a
    # rank that is the only one, so `step` holds what `microbatch` holds; not with two microbatches, two
    # stages a rank, or a split backward (W after it).
    from rewrite.estimate.memory import reduce_as_run

    assert reduce_as_run("step", microbatches=1, virtual_stages=1, split=False) == "microbatch"
    for kw in ({"microbatches": 2, "virtual_stages": 1, "split": False},
               {"microbatches": 1, "virtual_stages": 2, "split": False},
               {"microbatches": 1, "virtual_stages": 1, "split": True}):
        assert reduce_as_run("step", **kw) == "step" and reduce_as_run("microbatch", **kw) == "microbatch"
    one = rewrite.resolve(_plan(2) | {"pipeline": {"microbatches": 1}}, llama)
    two = rewrite.resolve(_plan(2) | {"pipeline": {"microbatches": 2}}, llama)
    each = rewrite.resolve(_plan(2) | {"pipeline": {"microbatches": 2}, "data_parallel": {"reduce": "microbatch"}}, llama)
    peak = lambda r: rank_footprints(r, llama)[0].peak  # noqa: E731
    assert peak(one) == peak(each) < peak(two)
    # show's --microbatches counts the run it shows
    assert rewrite.rank_memory(two, llama, microbatches=1)[0].gathered == rewrite.rank_memory(one, llama)[0].gathered


def test_mixed_precision_gathers_in_the_compute_dtype_or_caches_casts():
    # The units above in float32, computed in bfloat16 (2 bytes). Where dp shards, FSDP2 gathers in
    # bfloat16: half the gathered bytes (full: the root and the larger layer, 72 -> 36; grad_op: all, 104
    # -> 52); gradients accumulate and reduce in float32 as before. Elsewhere autocast keeps a bfloat16
    # copy of every weight through the step (21 elements x 2).
    units = [((3, 4), 4, "layer 0"), ((2, 4), 4, "layer 1"), ((), 4, "root")]
    for sharding, gathered in (("full", 72), ("grad_op", 104)):
        plain, mixed = (footprint(units, dp=2, sharding=sharding, compute_bytes=c) for c in (None, 2))
        assert plain.peak - mixed.peak == gathered // 2 and plain.at_rest == mixed.at_rest
    alone = footprint(units, compute_bytes=2)
    assert alone.peak == footprint(units).peak + 21 * 2 and alone.weights == 84  # float32 master weights
    assert footprint(units, dp=2, sharding="replicate", compute_bytes=2).peak == (
        footprint(units, dp=2, sharding="replicate").peak + 21 * 2)
    for kw in ({}, {"dp": 2, "sharding": "full"}, {"dp": 2, "sharding": "replicate"}):  # no narrower: no change
        assert footprint(units, compute_bytes=4, **kw) == footprint(units, **kw)


def test_show_counts_the_recipe_float32_weights_bfloat16_compute(llama):
    resolved = rewrite.resolve(PLANS / "llama-dp2-tp2-pp2.yaml", llama)
    plain = show_data(resolved, llama, hardware="h100-sxm")
    mixed = show_data(resolved, llama, hardware="h100-sxm", dtype="bfloat16")
    for a, b in zip(plain["memory"]["ranks"], mixed["memory"]["ranks"]):
        assert (a["weights"], a["grads"], a["adamw"]) == (b["weights"], b["grads"], b["adamw"])  # float32 master
        assert b["activations"] < a["activations"] and b["gathered"] < a["gathered"]
    assert mixed["memory"]["compute_dtype"] == "bfloat16" and plain["memory"]["compute_dtype"] == "float32"
    assert mixed["predicted"]["step_s"] < plain["predicted"]["step_s"]  # the bfloat16 peak, 15x float32's


@pytest.mark.parametrize("sharding", ["full", "grad_op", "replicate"])
def test_each_sharding_per_rank(llama, sharding):
    dp = 3  # divides none of tiny-llama's dims: every parameter is padded
    resolved = rewrite.resolve(_plan(dp, sharding), llama)
    (foot,) = rank_footprints(resolved, llama)
    shapes = [p.shape for p in llama.parameters()]
    whole = sum(math.prod(s) for s in shapes)
    held = sum(math.ceil(s[0] / dp) * math.prod(s[1:]) for s in shapes)
    if sharding == "replicate":
        assert (foot.params, foot.weights, foot.grads, foot.adamw) == (whole, 4 * whole, 4 * whole, 8 * whole)
        assert foot.peak == 4 * whole * 3 + 8 * whole
    else:
        assert held > whole / dp and (foot.params, foot.weights, foot.adamw) == (held, 4 * held, 8 * held)
        # Gathered: under full the root (embeddings, norm, head; kept from forward to backward)
        # and the largest layer, under grad_op all.
        units: dict[str, int] = {}
        for name, p in llama.named_parameters():
            unit = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "root"
            units[unit] = units.get(unit, 0) + math.ceil(p.shape[0] / dp) * math.prod(p.shape[1:])
        root = units.pop("root")
        gathered = root + max(units.values()) if sharding == "full" else held
        assert foot.peak == 4 * held + 8 * held + dp * 4 * gathered + 4 * whole
    text = format_plan(resolved, model=llama)
    assert "mesh: dp=3 x pp=1 x tp=1 = 3 ranks; 4 microbatches per step per replica" in text
    assert "ranks: rank = (dp_rank * pp + pp_rank) * tp + tp_rank" in text
    assert "replicas: 3, each a whole pipeline on its own microbatches (0: rank 0, 1: rank 1, 2: rank 2)" in text
    assert f"data parallel: sharding {sharding}: " in text and "gradients reduced once per step" in text
    assert ("dim 0 padded to a multiple of dp" in text) == (sharding != "replicate")
    assert _rows(text, "0")[3] == f"{foot.params:,}"
    assert "replicas 1-2 (ranks 1-2) hold the same as replica 0, rank for rank" in text
    modes = {m: rank_footprints(resolved, llama, sharding=m)[0] for m in ("full", "grad_op", "replicate")}
    assert (
        "the fullest rank under each sharding, params + grads + AdamW: "
        + ", ".join(f"{m} {format_bytes(f.at_rest)}" for m, f in modes.items())
    ) in _flat(text)
    assert modes["full"].at_rest < modes["replicate"].at_rest / 2


def test_show_dp2_tp2_pp2(llama):
    resolved = rewrite.resolve(PLANS / "llama-dp2-tp2-pp2.yaml", llama, world_size=8)
    text = format_plan(resolved, model_label="tiny-llama", model=llama)
    assert "mesh: dp=2 x pp=2 x tp=2 = 8 ranks; 4 microbatches per step per replica, schedule 1f1b" in text
    assert "replicas: 2, each a whole pipeline on its own microbatches (0: ranks 0-3, 1: ranks 4-7)" in text
    assert "data parallel: sharding full: each rank holds 1/dp of every parameter" in text
    lines = [line.split() for line in text.splitlines()]
    assert ["stage", "ranks", "(replica", "0)", "est.", "compute", "modules"] in lines
    # Replica 0's ranks only; each holds half (dp=2) of what the same rank holds without dp.
    without = rewrite.resolve(PLANS / "llama-tp2-pp2.yaml", llama)
    for rank in range(4):
        row, stage = _rows(text, str(rank)), without.stages[rank // 2]
        assert row[1:3] == [str(rank // 2), str(rank % 2)]
        assert int(row[3].replace(",", "")) == stage.param_count // 2
    assert not any(len(r) == 16 and r[0] in {"4", "5", "6", "7"} for r in lines)
    assert "  ranks 4-7 (replica 1) hold the same as ranks 0-3, rank for rank" in text
    assert "whole model: 180,800 parameters" in text
    # The memory table lists replica 0's ranks in order, the ranks of replica 1 holding the same (the note above).
    header, rows = memory_table(show_data(resolved, llama)["memory"])
    assert [r[0] for r in rows] == [str(r) for r in range(4)] and header[:4] == ["rank", "stages", "tp_rank", "params"]
    assert [r[1:4] for r in rows] == [_rows(text, str(rank))[1:4] for rank in range(4)]


def test_a_split_schedule_keeps_full_gathered(llama):
    text = _flat(format_plan(rewrite.resolve(_plan(2, "full", pp=2, schedule="zbv", k=2), llama), model=llama))
    assert "schedule zbv splits backwards, so as under grad_op the layers stay gathered from forward to the step's end" in text
    text = format_plan(rewrite.resolve(_plan(2, "full", pp=2, schedule="1f1b"), llama), model=llama)
    assert "splits backwards" not in text


def test_dp_needs_the_model_for_padding(llama):
    resolved = rewrite.resolve(_plan(2), llama)
    with pytest.raises(ValueError, match=r"pads each one's dim 0 to a multiple of dp.*format_plan\(resolved, model=model\)"):
        format_plan(resolved)
    one = rewrite.resolve(PLANS / "llama-tp2-pp2.yaml", llama)
    bare, full = format_plan(one), format_plan(one, model=llama)  # without the model: no whole shapes, no activations
    assert "[32, 64]" in bare and "[64, 64] -> [32, 64]" in full and "weights, grads and activations in the" in bare
    assert [r[:10] for r in (_rows(bare, str(k)) for k in range(4))] == [r[:10] for r in (_rows(full, str(k)) for k in range(4))]
