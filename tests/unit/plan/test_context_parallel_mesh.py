"""mesh.cp in a plan: the rank formula with cp between pp and tp, the world size, the shape in
words, cp 1 left out of written plans, and a pipeline.seq_len that 2 x cp does not divide refused."""

from __future__ import annotations

import itertools

import pytest

import rewrite
from rewrite.plan.ranks import coordinates, cp_rank_of, global_rank, shape_text


@pytest.mark.parametrize(("dp", "pp", "cp", "tp"), [(1, 1, 2, 1), (2, 2, 2, 2), (1, 3, 4, 2), (3, 1, 1, 2)])
def test_the_rank_formula_round_trips(dp, pp, cp, tp):
    seen = []
    for d, p, c, t in itertools.product(range(dp), range(pp), range(cp), range(tp)):
        rank = global_rank(d, p, t, pp=pp, tp=tp, cp=cp, cp_rank=c)
        assert coordinates(rank, pp=pp, tp=tp, cp=cp) == (d, p, t) and cp_rank_of(rank, tp=tp, cp=cp) == c
        seen.append(rank)
    assert seen == list(range(dp * pp * cp * tp))  # tp innermost, then cp, then pp, dp outermost


def test_a_plan_with_cp():
    plan = rewrite.load_plan({"mesh": {"dp": 2, "cp": 2, "tp": 2}})
    assert plan.mesh.world_size == 8 and plan.mesh.shape_text() == "dp=2 x pp=1 x cp=2 x tp=2"
    assert plan.mesh.global_rank(0, 1, dp_rank=1, cp_rank=1) == 7
    assert "cp: 2" in plan.to_yaml()
    assert "cp" not in rewrite.load_plan({"mesh": {"tp": 2}}).to_yaml()  # plans without cp read as before
    assert shape_text(1, 2, 2) == "pp=2 x tp=2"
    with pytest.raises(ValueError, match=r"pipeline.seq_len: a sequence of 100 tokens does not split into 2 x cp = 8 "
                                         r"equal chunks .* e.g. 96 or 104"):
        rewrite.load_plan({"mesh": {"cp": 4}, "pipeline": {"seq_len": 100}})
    with pytest.raises(ValueError, match="cp"):
        rewrite.load_plan({"mesh": {"cp": 0}})
