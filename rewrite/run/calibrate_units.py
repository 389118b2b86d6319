"""What FSDP2 costs a step beyond its collectives' time alone, per data-parallel unit: the profile's
`unit_overhead_s`, fitted by `rewrite calibrate` from one model run under each sharding at two microbatch
counts, and FSDP2's `replicate` beside DDP (`unit_step_times`, priced by `unit_overheads`).

On CPU ranks each of FSDP2's all-gathers copies the unit's shards into one buffer and out again into the
unpadded parameters (strided), and each reduce-scatter copies the gradients in and the reduced shard out,
one operator at a time in Python; every forward and backward through a sharded unit runs its hooks
whether or not it gathers. Measured on 2 ranks (bench layers of hidden 128 to 512, 0.7-11.6 MB a unit):
~3 ms a gather beyond the all-gather's time whatever the unit's size, ~1 ms a unit a microbatch of hooks.
AdamW and the gradients' norm run one operator at a time on CPU tensors, each through DTensor's dispatch
where FSDP2 holds the parameters: 0.14-0.2 ms a parameter beyond the plain tensors' step (the bench model, one
thread).
"""

from __future__ import annotations

import statistics
import time

__all__ = ["UNIT_LAYERS", "UNIT_MICROBATCHES", "unit_overheads", "unit_step_times"]

UNIT_LAYERS = 4  # the bench model's layers timed: 5 units (4 layers and the root)
UNIT_MICROBATCHES = (1, 8)  # of one sequence of SEQUENCE tokens each
# Each way the units run: the plan's data_parallel.sharding, and FSDP2's `replicate` (two stages on the rank, where
# DDP does not fit: `schedules.last_backward_reaches_all`) beside DDP's.
_WAYS = {"replicate": {}, "grad_op": {}, "full": {},
         "fsdp_replicate": {"schedule": "interleaved-1f1b", "virtual_stages": 2}}


def unit_step_times(repeats: int, together=None) -> dict:
    """`run_schedule`'s seconds for a bench model of UNIT_LAYERS layers with dp over the whole default group,
    each way of `_WAYS` at each of UNIT_MICROBATCHES microbatch counts, then the step's end (the gradients' norm
    clipped, AdamW), taking turns (the median of each; the first round warms up, untimed): {"times": {"<way> <m>":
    s}, "ends": {"<way>": s}, "units": [bytes of each unit, the root's last], "parameters": count}. Collective:
    every rank of the default group calls it."""
    import torch
    import torch.distributed as dist

    from ..mesh import release_groups
    from ..plan.loading import load_plan
    from ..pipeline.grad_norm import clip_grad_norm_
    from ..pipeline.runner import run_schedule
    from ..rewriter import apply_plan
    from .calibrate_layers import SEQUENCE
    from .presets import build_config, build_model

    config = build_config("bench-llama", num_hidden_layers=UNIT_LAYERS)
    steps = {}
    for way, pipeline in _WAYS.items():
        for m in UNIT_MICROBATCHES:
            plan = load_plan({"mesh": {"dp": dist.get_world_size()},
                              "data_parallel": {"sharding": way.removeprefix("fsdp_")},
                              "pipeline": {"microbatches": m, "seq_len": SEQUENCE, **pipeline}})
            stage = apply_plan(build_model(config, seed=0), plan)
            ids = [torch.zeros(1, SEQUENCE, dtype=torch.long)] * m
            steps[f"{way} {m}"] = (stage, ids, torch.optim.AdamW(stage.parameters(), lr=1e-9))
    timed = together or (lambda: None)
    times: dict[str, list[float]] = {key: [] for key in steps}
    ends: dict[str, list[float]] = {way: [] for way in _WAYS}
    for i in range(max(repeats // 2, 2) + 1):
        for key, (stage, ids, optimizer) in steps.items():
            timed()
            start = time.perf_counter()
            run_schedule(stage, ids, ids)
            mid = time.perf_counter()
            timed()
            end = time.perf_counter()
            clip_grad_norm_(stage, 1.0)
            optimizer.step()
            if i:
                times[key].append(mid - start)
                ends[key.split()[0]].append(time.perf_counter() - end)
            optimizer.zero_grad(set_to_none=True)
    meshes = [stage.mesh for stage, _, _ in steps.values()]
    del steps, stage
    for mesh in meshes:  # their groups' threads would slow what calibrate measures next
        release_groups(mesh)
    model = build_model(config, seed=0)
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"times": {key: statistics.median(t) for key, t in times.items()},
            "ends": {way: statistics.median(t) for way, t in ends.items()},
            "units": [layer] * UNIT_LAYERS + [whole - UNIT_LAYERS * layer],
            "parameters": sum(1 for _ in model.parameters())}


def unit_overheads(hardware, found: dict, world: int) -> dict[str, float]:
    """The profile's `unit_overhead_s` from `unit_step_times` on `world` ranks, each collective priced as
    `hardware` prices it, never below 0:
    - `pass`: per unit and microbatch, what `grad_op` adds to `replicate` (DDP) with each further
      microbatch (its hooks; neither gathers nor reduces again);
    - `gather`: per all-gather, what `full` adds to `grad_op` with each further microbatch (it gathers every
      unit in the forward and the layers again in the backward) beyond those all-gathers' time;
    - `reduce`: per reduce-scatter, what is left of `grad_op`'s one-microbatch step beyond `replicate`'s once
      its units' passes, gathers (each at its time and `gather`) and reduce-scatters are taken away and
      replicate's one all-reduce of every gradient given back;
    - `all_reduce`: per all-reduce of FSDP2's `replicate`, alike: what is left of its one-microbatch step beyond
      DDP's once its units' passes and all-reduces are taken away and DDP's one all-reduce given back;
    - `optimizer`: per parameter, what the step's end (norm and AdamW) takes on FSDP2's `replicate` beyond DDP's on
      the same bytes.
    A `found` without FSDP2's `replicate` (an older calibration's) gives the first three."""
    from ..estimate.collectives import collective_s

    t, units = found["times"], found["units"]
    lo, hi = UNIT_MICROBATCHES
    link = hardware.intra_node

    def price(kind: str, nbytes: float) -> float:
        return collective_s(hardware, kind, nbytes, world, link)

    def slope(a: str, b: str) -> float:  # what `a` adds to `b` with each further microbatch
        return ((t[f"{a} {hi}"] - t[f"{b} {hi}"]) - (t[f"{a} {lo}"] - t[f"{b} {lo}"])) / (hi - lo)

    n, layers = len(units), units[:-1]
    ags = [price("all_gather", b) for b in units]
    unit_pass = max(slope("grad_op", "replicate") / n, 0.0)
    gathered = sum(ags) + sum(ags[:-1])  # a microbatch's gathers under `full`: every unit, then the layers
    gather = max((slope("full", "grad_op") - gathered) / (n + len(layers)), 0.0)
    ddp_reduce = price("all_reduce", sum(units))
    extra = (t[f"grad_op {lo}"] - t[f"replicate {lo}"] - n * unit_pass * lo - sum(ags) - n * gather
             - sum(price("reduce_scatter", b) for b in units) + ddp_reduce)
    out = {"pass": unit_pass, "gather": gather, "reduce": max(extra / n, 0.0)}
    if f"fsdp_replicate {lo}" in t:
        extra = (t[f"fsdp_replicate {lo}"] - t[f"replicate {lo}"] - n * unit_pass * lo
                 - sum(price("all_reduce", b) for b in units) + ddp_reduce)
        out["all_reduce"] = max(extra / n, 0.0)
        ends = found["ends"]
        out["optimizer"] = max((ends["fsdp_replicate"] - ends["replicate"]) / found["parameters"], 0.0)
    return out
