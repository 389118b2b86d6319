"""clip_grad_norm_ over tp, pp and dp: the norm one process measures on the unsharded model
after the same step, and the same clipped gradients, each rank's slice of them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.utils import clip_grad_norm_ as torch_clip, get_total_norm

import rewrite
from rewrite.pipeline.grad_norm import clip_grad_norm_
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.collectives import CountCollectives
from tests.distributed.pipeline.test_pipeline import _batch
from tests.models import toy_step_setup
from tests.multiproc import run
from tests.reference import assert_counted_once, expected_shard

LAYERS = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel
VOCAB_RULES = {"model.embed_tokens": "vocab", "lm_head": "column"}


class _CountAllReduce:
    """`dist.all_reduce` calls made inside the block (clip_grad_norm_ makes exactly one)."""

    def __enter__(self):
        self.calls, self.saved = 0, dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return self.saved(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.saved


def _plan(mesh: dict, rules: dict | None = None, **switches) -> dict:
    pipeline = {"schedule": "1f1b", "microbatches": 2} if mesh.get("pp", 1) > 1 else {"microbatches": 2}
    return {"mesh": mesh, "tensor_parallel": rules or {}, "pipeline": pipeline, **switches}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a dp shard gathered (collective)


def _measure_and_clip(name: str, stage, model, reference) -> float:
    """After one step: the norms match one process, clipping once all-reduces once and leaves
    every rank's gradient slice equal to the reference's clipped gradient."""
    ref_grads = [p.grad for p in reference.parameters() if p.grad is not None]
    for norm_type in (2.0, math.inf):
        with _CountAllReduce() as seen, CountCollectives() as others:
            total = clip_grad_norm_(stage, None, norm_type=norm_type)
        assert (seen.calls, others.made()) == (1, {}), f"{name}: collectives {seen.calls} all_reduce, {others.made()}"
        assert total.dtype == torch.float32 and total.dim() == 0, name
        assert_close(f"{name} norm {norm_type}", total, get_total_norm(ref_grads, norm_type), atol=0.0)
    reference_norm = get_total_norm(ref_grads)
    max_norm = 0.1 * float(reference_norm)
    total = clip_grad_norm_(stage, max_norm)
    assert_close(f"{name} norm before clipping", total, torch_clip(reference.parameters(), max_norm), atol=0.0)
    ref = dict(reference.named_parameters(remove_duplicate=False))
    compared = 0
    for pname, param in model.named_parameters():
        if param.grad is not None:
            want = expected_shard(model, pname, ref[pname].grad)
            assert_close(f"{name} {pname}.grad clipped", _whole(param.grad), want, atol=1e-6)
            compared += 1
    assert compared > 0, name
    after = clip_grad_norm_(stage, None)
    assert_close(f"{name} norm after clipping", after, torch.tensor(max_norm), atol=0.0, rtol=1e-4)
    return float(total)


def _hf_case(name: str, plan: dict, **overrides) -> float:
    config = build_config("tiny-llama", **overrides)
    model = build_model(config, seed=0)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan)
    assert_counted_once(name, stage, reference)
    per_replica = 2
    ids, targets = _batch(config, per_replica * stage.dp, seq=8)  # the global batch, alike on every rank
    mine = slice(stage.dp_rank * per_replica, (stage.dp_rank + 1) * per_replica)
    loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
    assert_close(f"{name} loss", loss, reference_step(reference, ids, targets))
    return _measure_and_clip(name, stage, model, reference)


def _fx_case(name: str) -> float:
    model, reference, xs, ys = toy_step_setup(2)
    stage = rewrite.apply_plan(model, _plan({"pp": 2}))
    assert_counted_once(name, stage, reference)
    rewrite.run_schedule(stage, xs, ys, loss_fn=F.mse_loss)
    sum(F.mse_loss(reference(x), y) / len(xs) for x, y in zip(xs, ys)).backward()
    return _measure_and_clip(name, stage, stage.module, reference)


def _refusals(name: str) -> list[str]:
    """Bad arguments raise on every rank before any collective."""
    stage = rewrite.apply_plan(build_model("tiny-llama", seed=0), _plan({"pp": 2}))
    messages = []
    for max_norm, norm_type in ((0.0, 2.0), (-1.0, 2.0), (float("nan"), 2.0), (1.0, 1.0), (1.0, "fro")):
        with _CountAllReduce() as seen, CountCollectives() as others, pytest.raises(ValueError) as err:
            clip_grad_norm_(stage, max_norm, norm_type=norm_type)
        assert (seen.calls, others.made()) == (0, {}), f"{name}: a refusal made a collective"
        messages.append(str(err.value))
    dist.barrier()  # every rank is still in step
    return messages


def _group(rank: int, ws: int, group: str) -> dict:
    torch.manual_seed(0)
    if group == "tp2_pp2_tied":
        return {"norms": [_hf_case(group, _plan({"tp": 2, "pp": 2}, LAYERS), tie_word_embeddings=True)]}
    if group == "tp4_vocab_sp":
        plan = _plan({"tp": 4}, {**LAYERS, **VOCAB_RULES}, loss_parallel=True, sequence_parallel=True)
        return {"norms": [_hf_case(group, plan)]}
    if group == "dp2_tp2":
        return {"norms": [
            _hf_case(f"{group} {sharding}", _plan({"dp": 2, "tp": 2}, LAYERS, data_parallel={"sharding": sharding}))
            for sharding in ("full", "replicate")
        ]}
    return {"norms": [_hf_case("pp2", _plan({"pp": 2})), _fx_case("pp2 fx")], "refusals": _refusals("pp2")}


@pytest.mark.parametrize("group, world_size", [("tp2_pp2_tied", 4), ("tp4_vocab_sp", 4), ("dp2_tp2", 4), ("pp2", 2)])
def test_global_norm_and_clipped_grads_match_one_process(group, world_size):
    results = run(_group, world_size, group, timeout_s=120)
    assert all(r["norms"] == results[0]["norms"] for r in results), [r["norms"] for r in results]
    if group == "pp2":
        for refusals in (r["refusals"] for r in results):
            assert "max_norm must be > 0, got 0.0" in refusals[0]
            assert "got -1.0" in refusals[1] and "got nan" in refusals[2]
            assert "norm_type must be 2 or float('inf'), got 1.0" in refusals[3] and "'fro'" in refusals[4]
