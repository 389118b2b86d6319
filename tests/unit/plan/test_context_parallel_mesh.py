"""mesh.cp in a plan: the rank formula with cp between pp and tp, groups as slices of the grid, the world size,
the shape in words, cp 1 left out of written plans, and a pipeline.seq_len that 2 x cp does not divide refused."""

from __future__ import annotations

import itertools

import pytest

import rewrite
from rewrite.plan.ranks import Coords, Shape


@pytest.mark.parametrize(("dp", "pp", "cp", "tp"), [(1, 1, 2, 1), (2, 2, 2, 2), (1, 3, 4, 2), (3, 1, 1, 2)])
def test_the_rank_formula_round_trips(dp, pp, cp, tp):
    shape, seen = Shape(dp=dp, pp=pp, cp=cp, tp=tp), []
    for d, p, c, t in itertools.product(range(dp), range(pp), range(cp), range(tp)):
        rank = shape.rank(Coords(dp=d, pp=p, cp=c, tp=t))
        assert rank == ((d * pp + p) * cp + c) * tp + t  # the formula checkpoints and plans were written with
        assert shape.coords(rank) == Coords(dp=d, pp=p, cp=c, tp=t) and shape.grid()[d, p, c, t] == rank
        seen.append(rank)
    assert seen == list(range(dp * pp * cp * tp))  # tp innermost, then cp, then pp, dp outermost


def test_groups_are_slices_of_the_grid():
    shape = Shape(dp=2, pp=3, cp=2, tp=2)  # rank = ((d * 3 + p) * 2 + c) * 2 + t
    assert shape.along("tp")[:3] == [[0, 1], [2, 3], [4, 5]]  # neighbours
    assert shape.along("cp")[:3] == [[0, 2], [1, 3], [4, 6]]  # tp apart, at each tp rank of a stage
    assert shape.along("pp")[:2] == [[0, 4, 8], [1, 5, 9]]  # cp x tp apart, at each (dp, cp, tp)
    assert shape.along("dp")[:2] == [[0, 12], [1, 13]]  # pp x cp x tp apart
    assert shape.along("dp", "cp")[:2] == [[0, 2, 12, 14], [1, 3, 13, 15]]  # a stage's replicas: dp-major
    for group in shape.along("dp", "cp"):
        assert len({shape.coords(r).pp for r in group}) == len({shape.coords(r).tp for r in group}) == 1


def test_a_plan_with_cp():
    plan = rewrite.load_plan({"mesh": {"dp": 2, "cp": 2, "tp": 2}})
    assert plan.mesh.world_size == 8 and plan.mesh.shape_text() == "dp=2 x pp=1 x cp=2 x tp=2"
    assert plan.mesh.shape.rank(Coords(dp=1, cp=1, tp=1)) == 7
    assert "cp: 2" in plan.to_yaml()
    assert "cp" not in rewrite.load_plan({"mesh": {"tp": 2}}).to_yaml()  # plans without cp read as before
    assert Shape(pp=2, tp=2).text() == "pp=2 x tp=2"
    assert Shape(dp=2, cp=2, ep=2).text() == "dp=2 x pp=1 x cp=2 x tp=1 (ep=2)"
    with pytest.raises(ValueError, match=r"pipeline.seq_len: a sequence of 100 tokens does not split into 2 x cp = 8 "
                                         r"equal chunks .* e.g. 96 or 104"):
        rewrite.load_plan({"mesh": {"cp": 4}, "pipeline": {"seq_len": 100}})
    with pytest.raises(ValueError, match="cp"):
        rewrite.load_plan({"mesh": {"cp": 0}})
