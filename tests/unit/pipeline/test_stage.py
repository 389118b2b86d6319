"""`Stage` built by hand, without a process group: its keyword constructor, `pp_rank` (the old
`stage_idx` alias is gone), and the gradient-finishing protocol the runner calls."""

from __future__ import annotations

import warnings

import pytest

from rewrite import Stage, resolve
from rewrite.data_parallel import DdpSync, GradSync
from rewrite.expert_parallel import ExpertSums
from rewrite.grad_finish import GradFinish
from rewrite.mesh import Mesh
from rewrite.pipeline.tied import TiedSums
from rewrite.tensor_parallel.partial_grads import StepSums
from tests.models import ToyNet


def _stage(rank: int) -> Stage:
    model = ToyNet()
    mesh = Mesh(pp=2, tp=1, rank=rank, tp_group=None, tied_group=None)
    return Stage(model=model, module=model, resolved=resolve({"mesh": {"pp": 2}}, model), mesh=mesh,
                 forward_fns={rank: model})


def test_pp_rank_and_no_alias():
    stage = _stage(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pp_rank warns of nothing
        assert stage.pp_rank == 1 and stage.stage_ids == (1,)
    with pytest.raises(AttributeError):
        stage.stage_idx  # a stage id lives on TimelineEvent and StageSpec; the pp rank is pp_rank


def test_defaults_of_a_stage_built_by_keywords():
    stage = _stage(0)
    assert (stage.tied, stage.timeline, stage.grad_finish, stage.recomputed, stage.logit_shard) == ([], [], (), (), None)
    assert stage.finishing(GradSync) is None
    assert stage.is_first and not stage.is_last
    assert repr(stage).startswith("Stage(0/2, tp_rank=0/1, rank=0, modules=")


def test_every_way_of_finishing_gradients_is_the_runners_protocol():
    for kind in (GradSync, DdpSync, ExpertSums, StepSums, TiedSums):
        assert issubclass(kind, GradFinish) and kind.finish is not GradFinish.finish, kind

    class NoFinish(GradFinish):
        pass

    with pytest.raises(NotImplementedError):
        NoFinish().finish()
    NoFinish().begin(), NoFinish().next_backward_reduces(), NoFinish().end()  # the rest are optional
