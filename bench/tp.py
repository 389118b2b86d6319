"""TP = 2: rewrite's Megatron layers vs DTensor `parallelize_module` vs one process.

DTensor gets the model's own `base_model_tp_plan`, rewrite the same rules as a
plan. Both run the same gradient-accumulation loop over the microbatches, in the
same two processes, alternating step by step. Collectives are counted from the profiler's
`gloo:*` events, so both implementations are counted the same way. `bench.tp_options`
measures the plan's tensor-parallel options (vocab, loss_parallel, sequence_parallel,
activation checkpointing) against the same two and one process, side by side.
"""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile

import rewrite
from bench import common
from rewrite.tensor_parallel import comm

_COLLECTIVES = ("gloo:all_reduce", "gloo:all_gather", "gloo:reduce_scatter", "gloo:broadcast", "gloo:allgather")


def _ours(world: int):
    lm = common.model()
    rules = rewrite.plan_from_hf(lm.config, tp=world).tensor_parallel
    # As DTensor below: the decoder layers only (plan_from_hf may also map embeddings and heads).
    rules = {k: v for k, v in rules.items() if k.startswith("model.layers.")}
    stage = rewrite.apply_plan(lm, {"mesh": {"tp": world}, "tensor_parallel": rules,
                                    "pipeline": {"microbatches": common.MICROBATCHES}})
    assert stage.model is lm  # with pp == 1 the rewritten model is a complete HF model
    return lm, common.accumulation_step(lm)


def _dtensor(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    lm = common.model()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {f"model.{k}": styles[v]() for k, v in lm.config.base_model_tp_plan.items()}
    mesh = init_device_mesh("cpu", (world,))
    # parallelize_module takes '*' for one path segment, like our plans.
    parallelize_module(lm, mesh, plan)
    return lm, common.accumulation_step(lm)


def _collectives(step) -> dict:
    """Collectives of one step: count and bytes (fp32), by kind.

    gloo's own collectives come from the profiler. rewrite's sums run over P2P on
    gloo, so they are counted where they are made (`all_reduce_sum`), once per sum
    whatever the transport, with the bytes of the tensor summed.
    """
    out: dict[str, dict[str, int]] = {}
    original = comm.all_reduce_sum

    def counted(x, group=None):
        entry = out.setdefault("all_reduce", {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += x.numel() * x.element_size()
        return original(x, group)

    comm.all_reduce_sum = counted
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
    finally:
        comm.all_reduce_sum = original
    for event in prof.events():
        if event.name.startswith(_COLLECTIVES):
            numel = sum(_numel(shape) for shape in event.input_shapes if shape)
            entry = out.setdefault(event.name.removeprefix("gloo:"), {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += 4 * numel
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def timing(rank: int, world: int, warmup: int, steps: int) -> dict:
    ours_model, ours_step = _ours(world)
    dt_model, dt_step = _dtensor(world)
    ours, dtensor = [], []
    for i in range(warmup + steps):
        t_ours = common.timed(ours_step, warmup=0, steps=1)[0]
        t_dt = common.timed(dt_step, warmup=0, steps=1)[0]
        if i >= warmup:
            ours.append(t_ours)
            dtensor.append(t_dt)
    return {
        "ours": ours,
        "dtensor": dtensor,
        "collectives_ours": _collectives(ours_step),
        "collectives_dtensor": _collectives(dt_step),
    }


def memory(rank: int, world: int, impl: str) -> dict:
    module, step = _dtensor(world) if impl == "dtensor" else _ours(world)
    for _ in range(2):
        step()
    return {"param_bytes": common.param_bytes(module), "peak_rss_mib": common.peak_rss_mib()}
