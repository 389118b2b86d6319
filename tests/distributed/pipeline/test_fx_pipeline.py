"""Pipeline (and TP x PP) of a non-HF module split by torch.fx."""

from __future__ import annotations

import pytest
from torch.nn import functional as F

import rewrite
from tests.asserts import assert_close
from tests.distributed.pipeline.test_pipeline import assert_afab_order
from tests.models import toy_step_setup
from tests.multiproc import run
from tests.reference import assert_grads_match


def _fx(rank: int, ws: int, plan: dict) -> list[str]:
    model, reference, xs, ys = toy_step_setup(3)
    stage = rewrite.apply_plan(model, plan)
    assert stage.boundary_shapes((2, 5, 16))["output"] is None  # shapes travel on the wire
    loss = rewrite.run_schedule(stage, xs, ys, loss_fn=F.mse_loss)
    ref_loss = sum(F.mse_loss(reference(x), y) / 3 for x, y in zip(xs, ys))
    ref_loss.backward()
    assert_close("fx step loss", loss, ref_loss.detach())
    assert assert_grads_match(stage.module, reference, prefix=f"rank {rank} ") > 0
    assert_afab_order(stage.timeline)
    # The user's model was carved in place to the same parameters, as the same objects.
    assert {id(p) for p in model.parameters()} == {id(p) for p in stage.module.parameters()}
    return sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("mesh", [{"pp": 2}, {"pp": 2, "tp": 2}])
def test_fx_stages_match_reference(mesh):
    rules = {"blocks.*.fc1": "column", "blocks.*.fc2": "row"} if mesh.get("tp") else {}
    plan = {"mesh": mesh, "tensor_parallel": rules, "pipeline": {"microbatches": 3}}
    names = run(_fx, mesh["pp"] * mesh.get("tp", 1), plan, timeout_s=120)
    first, last = names[0], names[-1]
    assert first[0].startswith("blocks.0") and "inp.weight" in first and "head.weight" not in first
    assert "head.weight" in last and not any(n.startswith(("blocks.0", "inp")) for n in last)
