"""The step-time model: a plan's training step on a hardware profile, in seconds, tokens/s and MFU.

Each stage's forward, input- and weight-backward per microbatch (`stage_time`) become the
durations of the plan's schedule table, simulated on paper with the pipeline's transfers (the
simulator that checks tables, `rewrite.schedules.simulate`). Data parallelism (over the dp x cp
ranks holding the same parameters: `dp_time`) then adds, per rank, what torch does not hide:
    full        each F all-gathers its stage's FSDP2 units and each backward the layers again
                (the root stays gathered), the next unit's gather beside this one's compute; a
                split backward keeps them gathered through the step, as grad_op does
    grad_op     the first forward of a stage gathers its units once a step
    replicate   one all-reduce of the gradients (DDP's buckets) beside the last backward, where DDP
                fits (one stage a rank, whole backwards); elsewhere FSDP2's replicate: no gathers
and full / grad_op (and FSDP2's replicate) one reduce-scatter (all-reduce) of the gradients beside the last
backward, unit by unit; what exceeds
that backward is exposed, and at least the last unit's (or bucket's) share. Under
`data_parallel.reduce: microbatch` every whole backward reduces its units beside itself instead,
its last unit's reduce exposed. FSDP2's own work per unit (`unit_overhead_s`: its hooks on each pass of
the units it holds, the copies around each gather and reduce-scatter) adds to the action or the step's end
that runs it, hidden by nothing. Then AdamW, bound by
memory traffic over the parameters the rank holds. The step is the slowest rank's end, plus the
step's small all-reduces over the whole world, which wait for every rank (`WORLD_SYNCS`: the inputs'
check with the trained-token count, the step's loss, the gradient norm), each priced as the profile
prices an all-reduce of a few bytes over the world. Where a CPU
profile's ranks share fewer cores than they are (`cores_per_node`), the table runs its rows at the share of
the cores they get while running (`core_sharing`, `schedules.simulate.simulate_shared`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.flops import TRAINING, head_flops, layer_flops
from ..binding.params import held_parameters
from ..binding.resolve import ResolvedPlan
from ..schedules import plan_table, splits_backward
from ..schedules.simulate import Summary, bubble_of, simulate_shared, simulate_summary
from .activations import activation_problem, compute_dtype, plan_sizes
from .collectives import collective_s, groups_link, p2p_s
from .layer_activations import Sizes
from .hardware import Hardware, load_hardware
from .dp_time import EXPERTS, DpTime
from .memory import param_unit, with_run
from .stage_time import StageTimes, stage_times

__all__ = ["StepPrediction", "predict_step", "model_flops", "stage_parameters", "core_sharing", "world_sync_s"]

# The all-reduces over the whole world a training step makes beside its schedule's own: `run_schedule`'s inputs
# check (with the trained tokens counted), its loss, and `clip_grad_norm_`'s norm: a few bytes each.
WORLD_SYNCS, SYNC_BYTES = 3, 64


@dataclass(frozen=True)
class StepPrediction:
    """What a step is predicted to take (`predict_step`)."""

    step_s: float
    tokens_per_s: float  # per device
    mfu: float  # model FLOPs (no recompute) / (step x devices x peak)
    bubble: float  # the idle share of the simulated schedule
    pipeline_s: float  # the simulated table's span
    dp_s: float  # data-parallel time exposed on the slowest rank
    optimizer_s: float
    sync_s: float  # the step's small all-reduces over the world (`world_sync_s`)
    stages: tuple[StageTimes, ...]

    def as_dict(self) -> dict:
        """`{"step_s", "tokens_per_s", "mfu", "bubble", "pipeline_s", "dp_s", "optimizer_s", "sync_s"}`."""
        return {k: getattr(self, k) for k in ("step_s", "tokens_per_s", "mfu", "bubble", "pipeline_s", "dp_s",
                                              "optimizer_s", "sync_s")}


def model_flops(config, *, seq_len: int, num_layers: int, has_head: bool = True) -> int:
    """Training FLOPs of one sequence through the whole model, without recompute (MFU's numerator)."""
    per = layer_flops(config, seq_len=seq_len) * num_layers + head_flops(config, seq_len=seq_len, has_head=has_head)
    return TRAINING * per


def stage_parameters(resolved: ResolvedPlan, model: nn.Module) -> tuple[list[dict[str, int]], dict[int, int], tuple[int, int]]:
    """Per stage, FSDP2 unit -> bytes on a rank; per layer index its bytes; (embedding, head + norm) bytes.

    The experts split over ep (which FSDP2 leaves whole) are the stage's unit `EXPERTS`, and count in
    their layer's bytes. What `predict_step` reads of the parameters; it depends on the stages and
    shards only, so a search passes it once for plans that differ in schedule, microbatches or sharding.
    """
    bb, stages, layer_bytes, root = resolved.backbone, [], {}, [0, 0]
    for spec in resolved.stages:
        units: dict[str, int] = {}
        layers = frozenset(spec.layers)
        for p in spec.held or held_parameters(model, spec.modules, resolved.shards):
            unit = param_unit(p.name, layers)
            if unit != "root":
                index = int(unit.rsplit(".", 1)[1])
                layer_bytes[index] = layer_bytes.get(index, 0) + p.nbytes
            unit = EXPERTS if p.by_expert else unit
            units[unit] = units.get(unit, 0) + p.nbytes
            if unit == "root":
                root[0 if p.name.startswith(bb.embed + ".") else 1] += p.nbytes
        stages.append(units)
    return stages, layer_bytes, (root[0], root[1])


def predict_step(
    resolved: ResolvedPlan,
    model: nn.Module,
    hardware: Hardware | str,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    microbatches: int | None = None,
    gpus_per_node: int | None = None,
    parameters: tuple | None = None,
    sim_cache: dict | None = None,
    dp_time: DpTime | None = None,
    dtype: str | torch.dtype | None = None,
    times: list[StageTimes] | None = None,
    sizes: Sizes | None = None,
) -> StepPrediction:
    """The predicted time of one training step of `resolved` on `hardware`.

    Args:
        resolved: `rewrite.resolve(plan, model)` of a Hugging Face LLaMA-family model.
        model: the model it was resolved against (meta will do); its parameters' dtype is
            the master weights' (gradients, AdamW's reads and writes, gradient reductions).
        hardware: a profile, its name or file (`hardware.load_hardware`).
        batch_size: sequences per microbatch; seq_len, microbatches: override the plan's.
        gpus_per_node: devices per node (default the profile's): which groups cross nodes.
        parameters: `stage_parameters(resolved, model)`, when the caller has it.
        sim_cache: a dict kept across calls: tables timed alike are simulated once.
        dp_time: `DpTime(resolved, parameters[0], hardware, gpus_per_node)`, when the caller has it.
        dtype: the compute dtype (default the parameters'): its peak FLOP/s, the activations'
            bytes, FSDP2's gathers (`apply_plan(compute_dtype=)`).
        times, sizes: `stage_times` and `activations.plan_sizes` of this run, when the caller has them.

    Raises:
        ValueError: a layout the model does not time (torch.fx splits, non-LLaMA layers), a
            dtype the profile has no peak for, a run setting below 1.

    Example:
        >>> predict_step(rewrite.resolve("plans/llama-tp2.yaml", model), model, "h100-sxm").step_s
    """
    hw = load_hardware(hardware)
    problem = activation_problem(resolved, model)
    if problem:
        raise ValueError(problem.replace("activations are estimated", "step time is predicted", 1))
    run = with_run(resolved, seq_len=seq_len, microbatches=microbatches)
    plan, pipe = run.plan, run.plan.pipeline
    G = gpus_per_node or hw.devices_per_node
    units, layer_weights, root_weights = parameters or stage_parameters(run, model)
    times = times or stage_times(run, model, hw, batch_size=batch_size, gpus_per_node=G, layer_weights=layer_weights,
                                 root_weights=root_weights, dtype=dtype)
    master, compute = compute_dtype(model), compute_dtype(model, dtype)
    dp, pp, cp, tp, m = plan.mesh.dp, run.pp, plan.mesh.cp, run.tp, pipe.microbatches
    split = splits_backward(pipe.schedule, pipe.table)
    dpt = dp_time or DpTime(run, units, hw, G, gathered=compute.itemsize / master.itemsize)
    sharding, reduce = dpt.sharding(run), plan.data_parallel.reduce

    z = sizes or plan_sizes(run, model, batch_size=batch_size, dtype=compute)
    hop = z.chunk * z.dtype_bytes * z.hidden  # a stage's output (each tp and cp rank its sequence chunk)
    table = plan_table(pipe.schedule, pipe.table, pp, pipe.virtual_stages, m)
    world = dp * pp * cp * tp
    sharing, busy_pace = core_sharing(hw, min(world, G), pp)
    sim = _simulated(run, table, times, dpt, (sharding, split, reduce), hop, hw, G, sim_cache, sharing)
    ends, worst_dp, worst_opt = [], 0.0, 0.0
    for r, last in enumerate(sim.last):  # a row's actions run one after another: its last ends last
        window = (last[1] - last[0]) if last else 0.0
        exposed, optimizer = dpt.tail(run.rank_stages(r), times, sharding, split, window, master.itemsize, reduce)
        ends.append((last[1] if last else 0.0) + exposed + optimizer * busy_pace)
        worst_dp, worst_opt = max(worst_dp, exposed), max(worst_opt, optimizer)
    sync = world_sync_s(hw, world, G)
    step = max(ends) + sync
    sequences = dp * m * batch_size
    num_layers = sum(len(x) for x in run.layer_indices)
    flops = model_flops(model.config, seq_len=z.seq_len, num_layers=num_layers, has_head=run.backbone.has_head) * sequences
    return StepPrediction(
        step_s=step, tokens_per_s=sequences * z.seq_len / step / world,
        mfu=flops / (step * world * hw.flops(str(compute).removeprefix("torch."))),
        bubble=bubble_of(sim, len(table)), pipeline_s=sim.span, dp_s=worst_dp, optimizer_s=worst_opt * busy_pace,
        sync_s=sync, stages=tuple(times),
    )


def world_sync_s(hw: Hardware, world: int, gpus_per_node: int) -> float:
    """Seconds a step spends in its WORLD_SYNCS all-reduces of a few bytes over all `world` ranks (0 for one):
    each as long as the profile's all-reduce of that size over the world (measured where `collective_times` has
    it for the world on one node, else the ring formula on the link the world spans).

    Example:
        >>> world_sync_s(load_hardware("h100-sxm"), 8, 8)  # 3 x 2 x 7 ring steps of NVLink's 5 us
        0.00021...
    """
    if world <= 1:
        return 0.0
    link = groups_link(hw, [range(world)], gpus_per_node)
    return WORLD_SYNCS * collective_s(hw, "all_reduce", SYNC_BYTES, world, link)


def core_sharing(hw: Hardware, ranks: int, rows: int) -> tuple[tuple[float, int, float] | None, float]:
    """How `ranks` ranks of a node in `rows` pp rows share the profile's `cores_per_node` C: ((the share of a core
    its terms were measured at, C, ranks per row), the pace of every rank busy at once), or (None, 1) for devices
    of their own. Its terms were measured with N = devices_per_node ranks busy, each at s = min(1, C / N) of a
    core; a table's rows run at the share they get while running (`simulate_shared`); every rank busy at once
    (AdamW) runs at min(1, C / ranks) of a core, s / that of its measured time."""
    cores = hw.cores_per_node
    if cores is None:
        return None, 1.0
    measured = min(1.0, cores / hw.devices_per_node)
    return (measured, cores, ranks / rows), measured / min(1.0, cores / ranks)


def _simulated(run: ResolvedPlan, table, times: list, dpt: DpTime, dp_mode: tuple[str, bool, str], hop: int,
               hw: Hardware, G: int, sim_cache: dict | None, sharing: tuple | None = None) -> Summary:
    """The schedule table simulated with the stages' durations and the transfers between pp ranks, in brief
    (`schedules.simulate.Summary`: each rank's last action, the span, the busy time). `dp_mode`: (sharding,
    split backward, reduce); `sharing`: `core_sharing`'s, for ranks sharing cores."""
    sharding, split, reduce = dp_mode
    plan, eff = run.plan, hw.efficiency.collective

    def hop_s(a: int, b: int) -> float:  # pp rank a to pp rank b, over the slowest pair of global ranks
        pairs = [[ranks[a], ranks[b]] for ranks in plan.mesh.shape.along("pp")]
        return p2p_s(hop, groups_link(hw, pairs, G), eff)

    # The table's timing depends on these durations only: plans alike in them (dp 1 and replicate; grad_op too
    # where FSDP2's passes cost nothing) share one simulation through `sim_cache`.
    key = (id(table), run.stage_rank, hop, tuple((t.forward, t.input_backward, t.weight_backward) for t in times),
           dpt.per_microbatch(sharding, split) and tuple(map(tuple, dpt.gather.values())),
           dpt.reduces_each(sharding, split, reduce) and sharding,
           bool(dpt.unit_pass) and dpt.on_fsdp(sharding, split), sharing)
    if sim_cache is not None and key in sim_cache and sim_cache[key][0] is table:
        return sim_cache[key][1]
    # Durations per (kind, stage) and transfers per pair of pp ranks: each computed once, not per cell.
    costs = dpt.costs(times, sharding, split, reduce)
    # An action waits on the stage before or after its own: the pairs of neighbouring stages' ranks, both ways.
    hops = {pair for s in range(1, len(times)) for pair in ((run.stage_rank[s - 1], run.stage_rank[s]),
                                                              (run.stage_rank[s], run.stage_rank[s - 1]))}
    delays = {(a, b): hop_s(a, b) for a, b in hops if a != b}
    if sharing is None:
        sim = simulate_summary(table, run.stage_rank, costs, delays)
    else:
        share, cores, per_row = sharing
        sim = simulate_shared(table, run.stage_rank, costs, delays, share=share, cores=cores, per_row=per_row)
    if sim.stuck:
        raise ValueError("the schedule table deadlocks: " + "; ".join(sim.stuck))
    if sim_cache is not None:
        sim_cache[key] = (table, sim)
    return sim
