"""Data parallelism (mesh.dp) with every sharding, alone and with tp and pp, against one process on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from rewrite.data_parallel import GradSync
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.distributed.pipeline.test_pipeline import _batch
from tests.multiproc import run
from tests.reference import expected_shard

TP_RULES = "plans/llama-tp2.yaml"


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A data-parallel shard put back together (torch DTensor), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(rank: int, config, plan: dict, per_replica: int) -> str:
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan)
    dp = stage.dp
    ids, targets = _batch(config, per_replica * dp)  # the global batch, the same on every rank
    mine = slice(stage.dp_rank * per_replica, (stage.dp_rank + 1) * per_replica)
    loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
    name = f"rank {rank} {plan['mesh']} {plan.get('data_parallel', {})} {plan['pipeline']['schedule']}"
    assert_close(f"{name} loss", loss, reference_step(reference, ids, targets))
    ref = dict(reference.named_parameters(remove_duplicate=False))
    compared = 0
    for pname, param in model.named_parameters():
        assert_close(f"{name} {pname}.grad", _whole(param.grad), expected_shard(model, pname, ref[pname].grad))
        compared += 1
    # One optimizer step on the sharded parameters (AdamW's moments sharded alike) equals one on the
    # whole model. Sound across plans and CPUs because eps is large: AdamW's first step is
    # u(g) = lr * g / (|g| + eps) (bias-corrected m = g, sqrt(v) = |g|), whose slope is at most
    # lr / eps = 10, so gradients that differ by reduction-order noise d (~4e-8 here, |g| <= 0.12)
    # give weights that differ by <= 10 d + 1 ulp (~1e-7 seen), far inside 1e-5. With the default
    # eps = 1e-8 the slope would be 1e6: d = 1e-9 on a gradient near eps moves a weight by ~lr.
    torch.optim.AdamW(stage.parameters(), lr=1e-2, eps=1e-3).step()
    torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-3).step()
    for pname, param in model.named_parameters():
        assert_close(f"{name} {pname} after AdamW", _whole(param.detach()), expected_shard(model, pname, ref[pname].detach()))
    assert compared > 0
    return f"{float(loss):.6f}"


def _cases(rank: int, ws: int, cases: list) -> list[str]:
    losses = []
    for mesh, sharding, schedule, k, overrides in cases:
        config = build_config("tiny-llama", **overrides)
        tp = rewrite.load_plan(TP_RULES).tensor_parallel if mesh.get("tp", 1) > 1 else {}
        pipeline = {"schedule": schedule, "virtual_stages": k, "microbatches": 2}
        sharding, _, reduce = sharding.partition(" ")  # "full microbatch": reduced as each backward ends
        data_parallel = {"sharding": sharding, **({"reduce": reduce} if reduce else {})}
        plan = {"mesh": mesh, "tensor_parallel": tp, "pipeline": pipeline, "data_parallel": data_parallel}
        losses.append(_step(rank, config, plan, per_replica=2))
    return losses


TIED = {"tie_word_embeddings": True}
CASES = {
    # world: [(mesh, sharding, schedule, virtual stages, config overrides)]
    "dp2": (2, [({"dp": 2}, s, "afab", 1, {}) for s in ("replicate", "full", "grad_op")]
            + [({"dp": 2}, "full", "afab", 1, TIED)]),
    "dp4-and-dp2xtp2": (4, [({"dp": 4}, "full", "afab", 1, {}), ({"dp": 2, "tp": 2}, "full", "afab", 1, {}),
                            ({"dp": 2, "tp": 2}, "replicate", "afab", 1, {})]),
    "dp2xpp2": (4, [({"dp": 2, "pp": 2}, "full", "afab", 1, {}), ({"dp": 2, "pp": 2}, "full", "1f1b", 1, {}),
                    ({"dp": 2, "pp": 2}, "full", "zbv", 2, {}), ({"dp": 2, "pp": 2}, "replicate", "zero-bubble", 1, {}),
                    ({"dp": 2, "pp": 2}, "full", "1f1b", 1, TIED), ({"dp": 2, "pp": 2}, "replicate", "1f1b", 1, TIED)]),
    "dp2xpp2xtp2": (8, [({"dp": 2, "pp": 2, "tp": 2}, "full", "1f1b", 1, {})]),
    # Reduced as each microbatch's backward ends: DDP (replicate, one stage per rank), FSDP2's
    # replicate (two stages per rank), full and grad_op, tied or not.
    "dp2-microbatch": (2, [({"dp": 2}, f"{s} microbatch", "afab", 1, {}) for s in ("replicate", "full", "grad_op")]
                       + [({"dp": 2}, "full microbatch", "afab", 1, TIED)]),
    "dp2xpp2-microbatch": (4, [({"dp": 2, "pp": 2}, "full microbatch", "1f1b", 1, {}),
                               ({"dp": 2, "pp": 2}, "replicate microbatch", "interleaved-1f1b", 2, {}),
                               ({"dp": 2, "pp": 2}, "grad_op microbatch", "afab", 1, TIED)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_data_parallel_matches_one_process(case):
    world, cases = CASES[case]
    per_rank = run(_cases, world, cases, timeout_s=420)
    assert all(losses == per_rank[0] for losses in per_rank), per_rank  # the same loss on every rank


def _refusals(rank: int, ws: int) -> list[str]:
    config = build_config("tiny-llama")
    messages = []
    try:  # 2 ranks for a mesh of 4: refused on every rank before any collective but the agreement
        rewrite.apply_plan(build_model(config, seed=3), {"mesh": {"dp": 2, "tp": 2}})
    except ValueError as exc:
        messages.append(str(exc))
    # dp = 1: nothing of data parallelism is installed (no FSDP2 module, no hook, plain parameters).
    from torch.distributed.fsdp import FSDPModule

    plain = rewrite.apply_plan(build_model(config, seed=3), {"mesh": {"pp": 2}})
    assert plain.finishing(GradSync) is None and plain.dp == 1 and plain.dp_rank == 0
    assert not any(isinstance(m, FSDPModule) or m._forward_pre_hooks or m._forward_hooks for m in plain.model.modules())
    assert not any(hasattr(p, "to_local") for p in plain.parameters())
    stage = rewrite.apply_plan(build_model(config, seed=3), {"mesh": {"dp": 2}, "pipeline": {"microbatches": 2}})
    assert stage.finishing(GradSync) is not None and stage.dp == 2 and stage.dp_rank == rank
    ids, targets = _batch(config, 3)
    count = 2 if stage.dp_rank == 0 else 3  # the replicas disagree on the microbatch count
    try:
        rewrite.run_schedule(stage, ids[:count], targets[:count])
    except ValueError as exc:
        messages.append(str(exc))
    # Refused, and still usable: the next step with agreeing replicas runs.
    loss = rewrite.run_schedule(stage, ids[stage.dp_rank : stage.dp_rank + 1], targets[stage.dp_rank : stage.dp_rank + 1])
    messages.append(f"{float(loss):.6f}")
    return messages


def test_bad_meshes_and_disagreeing_replicas_fail_on_every_rank():
    first, second = run(_refusals, 2, timeout_s=120)
    assert first == second, (first, second)
    assert "mesh needs dp=2 x pp=1 x tp=2 = 4 ranks, but the world size is 2" in first[0]
    assert "ranks were given different microbatches (rank 0: 2 x [2, 10] int64; rank 1: 3 x [2, 10] int64)" in first[1]
    assert "data-parallel replicas pass their own microbatches, all of the same count" in first[1]
    assert len(first) == 3
