"""A steady step: what it sends and reads, and that the checks it caches still refuse every bad input."""

from __future__ import annotations

import collections

import torch
from torch.profiler import ProfilerActivity, profile

import rewrite
from rewrite.run.presets import build_model
from tests.distributed.test_validation import _expect_error
from tests.multiproc import run

# Reading a tensor's value on the host: on a GPU each of these waits for the device.
HOST_READS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")


def _ids(shape=(2, 16), high=256, n=4) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randint(0, high, shape) for _ in range(n)]


def _made(stage, inputs, targets) -> dict[str, int]:
    """The collectives (c10d ops, by name) and host reads one `run_schedule` step makes."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rewrite.run_schedule(stage, inputs, targets)
    seen = collections.Counter(e.name.removeprefix("c10d::") for e in prof.events()
                               if e.name.startswith("c10d::") or e.name in HOST_READS)
    return dict(seen)


def _cached_checks(rank: int, ws: int) -> dict:
    stage = rewrite.apply_plan(build_model("tiny-llama", seed=0), "plans/llama-tp2-pp2.yaml")
    got = {}
    for shape in ((2, 16), (4, 8)):  # both structures seen, checked and cached on every rank
        assert torch.isfinite(rewrite.run_schedule(stage, _ids(shape), _ids(shape)))
    got["steady"] = _made(stage, _ids((4, 8)), _ids((4, 8)))
    # Each rank passes a structure it has seen before, but not the one its peers pass.
    shape = (4, 8) if rank >= 2 else (2, 16)
    got["shapes"] = _expect_error(lambda: rewrite.run_schedule(stage, _ids(shape), _ids(shape)))
    big = _ids()
    big[2][1, 3] = 300
    got["input 300"] = _expect_error(lambda: rewrite.run_schedule(stage, big, _ids()))
    got["target 300"] = _expect_error(lambda: rewrite.run_schedule(stage, _ids(), big))
    ignored = _ids()
    ignored[0][0, 0] = -7
    got["target -7"] = _expect_error(lambda: rewrite.run_schedule(stage, _ids(), ignored))
    # One rank alone: its tp peer passes good ids, so only it sees the bad one.
    got["one rank"] = _expect_error(lambda: rewrite.run_schedule(stage, big if rank == 0 else _ids(), _ids()))
    one_more = _ids(n=5 if rank == 3 else 4)
    got["count"] = _expect_error(lambda: rewrite.run_schedule(stage, one_more, one_more))
    ignored = _ids()
    ignored[1][:, :4] = -100
    assert torch.isfinite(rewrite.run_schedule(stage, _ids(), ignored)), "after refusals a good step runs"
    return got


def test_cached_checks_refuse_every_bad_input_on_every_rank():
    results = run(_cached_checks, 4, timeout_s=120)
    for case in results[0]:
        if case != "steady":
            assert len({r[case] for r in results}) == 1, f"{case}: ranks raised different errors"
    got = results[0]
    assert "ranks 0, 1: 4 x [2, 16] int64; ranks 2, 3: 4 x [4, 8] int64" in got["shapes"], got["shapes"]
    assert "ranks 0, 1: inputs[2] holds id 300 at (1, 3), outside the vocabulary [0, 256)" in got["input 300"]
    assert "ranks 2, 3: targets[2] holds 300 at (1, 3), outside [0, 256) and not -100" in got["target 300"]
    assert "ranks 2, 3: targets[0] holds -7 at (0, 0), outside [0, 256)" in got["target -7"]
    assert "rank 0: inputs[2] holds id 300 at (1, 3)" in got["one rank"] and "rank 1" not in got["one rank"]
    assert "ranks 0, 1, 2: 4 x [2, 16] int64; rank 3: 5 x [2, 16] int64" in got["count"], got["count"]
    # A steady tp 2 x pp 2 step: one all-reduce to agree on the inputs, one for the loss; the
    # rest are point-to-point (gloo's tp sums and gathers go over P2P); no host reads.
    for r in results:
        assert r["steady"]["allreduce_"] == 2 and set(r["steady"]) == {"allreduce_", "send", "recv_"}, r["steady"]


PLANS = {
    "replicate": {"mesh": {"dp": 2}, "data_parallel": {"sharding": "replicate"}},
    "full": {"mesh": {"dp": 2}, "data_parallel": {"sharding": "full"}},
    "1f1b": {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 4}},
    "full, 2 microbatches": {"mesh": {"dp": 2}, "pipeline": {"microbatches": 2}},
    "full, reduced per microbatch": {"mesh": {"dp": 2}, "pipeline": {"microbatches": 2},
                                     "data_parallel": {"reduce": "microbatch"}},
}


def _steady(rank: int, ws: int) -> dict[str, dict[str, int]]:
    made = {}
    for name, plan in PLANS.items():
        stage = rewrite.apply_plan(build_model("tiny-llama", seed=0), plan)
        inputs, targets = rewrite.microbatches(_ids((8, 16), n=1)[0], stage.resolved.plan.pipeline.microbatches,
                                               dp_rank=stage.dp_rank, dp=stage.dp)
        rewrite.run_schedule(stage, inputs, targets)
        made[name] = _made(stage, inputs, targets)
        assert len(stage.timeline) == 2 * len(inputs), "a forward and a backward per microbatch, timed"
    return made


def test_a_steady_step_makes_one_collective_of_its_own_and_reads_nothing():
    """Ours per step: one all-reduce agreeing on the inputs and one for the loss; the rest is the plan's."""
    for made in run(_steady, 2, timeout_s=120):
        assert made["replicate"] == {"allreduce_": 3}, made  # + the gradients, in one bucket
        # + FSDP2's own: a gather per unit in the forward and again in the backward (the root
        # unit stays gathered), a reduce-scatter per unit.
        assert made["full"] == {"allreduce_": 2, "_allgather_base_": 9, "_reduce_scatter_base_": 5}, made
        assert made["1f1b"] == {"allreduce_": 2, "send": 4, "recv_": 4}, made  # + an activation or gradient per microbatch
        # data_parallel.reduce: each of the 5 units reduce-scatters once per step, or after each microbatch's backward.
        step, each = made["full, 2 microbatches"], made["full, reduced per microbatch"]
        assert (step["_reduce_scatter_base_"], each["_reduce_scatter_base_"]) == (5, 10), made
        assert step["_allgather_base_"] == each["_allgather_base_"] and step["allreduce_"] == each["allreduce_"] == 2, made
