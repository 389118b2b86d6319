"""The search space of `search`: meshes, microbatch counts, checkpointing, and a plan bound once
per mesh and switches with its variants (schedule, microbatches, sharding, checkpointing) derived.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch
from torch import nn

from ..plan.from_hf import plan_from_hf
from ..binding.resolve import BindSteps, ResolvedPlan, resolve_with
from ..plan.loading import load_plan
from ..plan.schema import PlanError
from ..schedules import placement, plan_table, splits_backward
from .activations import compute_dtype, place_peaks, plan_sizes, stage_activations
from .layer_activations import Sizes
from .plan_parts import selective_problem
from .dp_time import DpTime
from .hardware import Hardware
from .param_memory import footprint, param_sums, rank_parameters, reduce_as_run
from .stage_time import StageTimes, stage_times
from .step_bound import step_lower_bound
from .step_time import stage_parameters, world_sync_s

__all__ = ["CHECKPOINTING", "SCHEDULES_BY_STAGES", "Bound", "divisors", "microbatch_counts", "meshes", "bind", "binds_sp",
           "variant", "checkpointed", "collector_paused", "expert_count"]

# In the order tried, each adding recompute: 'selective' runs a layer's elementwise work and every other product
# again, half the layers run everything again, then all of them.
CHECKPOINTING = ("off", "selective", "every other layer", "every layer")
SCHEDULES_BY_STAGES = {1: ("1f1b", "afab", "zero-bubble"), 2: ("interleaved-1f1b", "zbv", "zero-bubble")}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(per_replica: int, stages: int) -> list[int]:
    """Microbatch counts tried for `per_replica` sequences over `stages` pipeline stages: the smallest
    divisors at or above the stage count and 2 and 4 times it (a 1F1B bubble of at most 1 / 5), capped
    at every sequence its own; without a pipeline 1, 2, 4 and every sequence its own (less memory each)."""
    found = divisors(per_replica)
    wanted = [stages, 2 * stages, 4 * stages] if stages > 1 else [1, 2, 4, per_replica]
    return sorted({next((d for d in found if d >= w), per_replica) for w in wanted})


def checkpointed(resolved: ResolvedPlan, mode: str) -> tuple[dict, tuple[str, ...]]:
    """The plan's activation_checkpointing patterns for `mode` and the layers they match."""
    bb = resolved.backbone
    indices = [i for s in resolved.layer_indices for i in s]
    if mode == "off":
        return {}, ()
    if mode in ("every layer", "selective"):
        return ({f"{bb.layers}.*": "selective" if mode == "selective" else "full"},
                tuple(bb.layer(i) for i in sorted(indices)))
    even = sorted(i for i in indices if i % 2 == 0)  # `*4` matches 4, 14, 24 ...: the even indices by last digit
    return {f"{bb.layers}.*{d}": "full" for d in sorted({i % 10 for i in even})}, tuple(bb.layer(i) for i in even)


def _rules(model: nn.Module, tp: int, vocab_loss: bool) -> dict:
    if tp == 1:
        return {}
    rules = dict(plan_from_hf(model, tp=tp, loss_parallel=vocab_loss).tensor_parallel)
    if vocab_loss:
        from ..models.hf_decoder import find_backbone

        rules[find_backbone(model).embed] = "vocab"
    return rules


def expert_count(model: nn.Module) -> int | None:
    """The count every ep must divide (`models.experts.expert_block`: the experts of each splittable experts
    module of `model`, with identity experts the largest block of both), when its family's ep plan names
    them (`plan_from_hf(model, ep=...)`); None for a dense model, or experts it cannot split alike."""
    from ..models.experts import expert_block, experts_problem

    counts = {expert_block(m) for m in model.modules() if expert_block(m) and experts_problem(m) is None}
    if len(counts) != 1:
        return None
    try:
        rules = plan_from_hf(model, ep=2, dp=2).tensor_parallel
    except (PlanError, ValueError):
        return None
    return counts.pop() if "expert_parallel" in rules.values() else None


def bind(model, *, dp, pp, tp, k, vocab_loss, sp, seq_len, steps: BindSteps | None = None, cp: int = 1,
         ep: int = 1, lora: dict | None = None) -> ResolvedPlan | str:
    """The mesh and switches bound to the model (the reason it does not bind, as text); `steps`: the binding
    steps kept across the binds of one search (`bind_memo.MemoSteps(model)`). `ep` > 1: the experts split as the
    family's ep plan says. `lora`: the plan's `lora` section."""
    try:
        rules = _rules(model, tp, vocab_loss)
        if ep > 1:
            rules.update({p: s for p, s in plan_from_hf(model, ep=ep, dp=dp, tp=tp).tensor_parallel.items()
                          if s == "expert_parallel"})
        data = {
            "mesh": {"dp": dp, "pp": pp, "cp": cp, "tp": tp, **({"ep": ep} if ep > 1 else {})},
            "tensor_parallel": rules,
            "pipeline": {"schedule": SCHEDULES_BY_STAGES[k][0], "virtual_stages": k, "seq_len": seq_len,
                         **({"cut_points": "auto"} if pp > 1 else {})},
            "loss_parallel": vocab_loss, "sequence_parallel": sp, **({"lora": lora} if lora else {}),
        }
        return resolve_with(steps or BindSteps(model), load_plan(data))
    except (PlanError, ValueError) as exc:
        return exc.problems[0] if isinstance(exc, PlanError) and exc.problems else str(exc)


def binds_sp(model: nn.Module, base: ResolvedPlan, steps: BindSteps | None = None) -> bool:
    """Whether `base`'s plan binds with sequence_parallel on (the model's layers allow it); `steps` as `bind`'s."""
    data = base.plan.model_dump(mode="json", exclude_none=True)
    try:
        resolve_with(steps or BindSteps(model), load_plan({**data, "sequence_parallel": True}))
        return True
    except (PlanError, ValueError):
        return False


def variant(base: ResolvedPlan, *, schedule: str, microbatches: int, sharding: str, checkpointing: str,
            reduce: str = "step") -> ResolvedPlan:
    """`base` with another schedule, microbatch count, sharding, reduce and checkpointing: what `resolve`
    gives for that plan (the stages and shards stay; the placement, recomputed layers and plan change)."""
    plan, pipe = base.plan, base.plan.pipeline
    patterns, layers = checkpointed(base, checkpointing)
    new = plan.model_copy(update={
        "pipeline": pipe.model_copy(update={"schedule": schedule, "microbatches": microbatches}),
        "data_parallel": plan.data_parallel.model_copy(update={"sharding": sharding, "reduce": reduce}),
        "activation_checkpointing": patterns,
    })
    return dataclasses.replace(base, plan=new, recomputed=layers, selective=layers if checkpointing == "selective" else (),
                               stage_rank=placement(schedule, base.pp, pipe.virtual_stages))


class Bound:
    """What a search shares across candidates of one binding: parameters per stage, footprints per sharding."""

    def __init__(self, base: ResolvedPlan, model: nn.Module, dtype: str | torch.dtype | None = None,
                 twin: Bound | None = None) -> None:
        """`dtype`: the compute dtype (default the parameters', which are the master weights). `twin`: a
        binding of the same mesh, stages and shards (sequence parallelism switched, which moves no
        parameter): its parameters and footprints are this one's."""
        self.base, self.model = base, model
        self.compute = compute_dtype(model, dtype)
        same = twin is not None and twin.base.shards is base.shards and twin.base.stages is base.stages
        self.parameters = twin.parameters if same else stage_parameters(base, model)
        self.sims: dict = {}
        self._feet: dict = twin._feet if same else {}  # (sharding, split, placement, reduce) -> peaks
        self._group_feet: dict = twin._group_feet if same else {}  # (schedule, m, sharding, reduce) -> the same
        self._acts: dict = {}
        self._params: dict = twin._params if same else {}  # placement -> each rank's `param_sums`
        self._experts: dict = twin._experts if same else {}  # placement -> each rank's experts' footprint
        self._stages: dict = {}  # (checkpointing, batch size) -> per stage activations
        self._times: dict = {}  # (checkpointing, batch size) -> `stage_times`
        self._sizes: dict = {}  # batch size -> `plan_sizes`: a variant changes none of what they read
        self._dp: DpTime | None = None
        self._sync: float | None = None  # `world_sync_s`
        self._costs: dict = {}  # (sharding, split, checkpointing, batch size, reduce) -> `DpTime.costs`
        self._tails: dict = {}  # the same and the placement -> each rank's least tail
        self.dtype_bytes = compute_dtype(model).itemsize  # the master weights'
        self.mixed = self.compute.itemsize < self.dtype_bytes  # `footprint`'s compute_bytes, else None
        self._selective: bool | None = twin._selective if same else None

    def allows(self, mode: str) -> bool:
        """Whether the estimates take this checkpointing mode on the binding (`plan_parts.selective_problem`)."""
        if mode != "selective":
            return True
        if self._selective is None:
            self._selective = selective_problem(self.model, cp=self.base.plan.mesh.cp) is None
        return self._selective

    def dp_time(self, hw: Hardware, G: int) -> DpTime:
        """The binding's `DpTime` (one hardware and node size a search)."""
        if self._dp is None:
            self._dp = DpTime(self.base, self.parameters[0], hw, G, gathered=self.compute.itemsize / self.dtype_bytes)
        return self._dp

    def activation_peaks(self, schedule: str, m: int, mode: str, batch_size: int) -> list[int]:
        """Each pp rank's activation peak under a variant: `place_peaks` (the sharding changes none)."""
        key = (schedule, m, mode, batch_size)
        if key not in self._acts:
            if (mode, batch_size) not in self._stages:  # nor do the schedule and microbatches a stage's bytes
                v = variant(self.base, schedule=schedule, microbatches=m, sharding="full", checkpointing=mode)
                self._stages[mode, batch_size] = stage_activations(v, self.model, batch_size=batch_size,
                                                                   dtype=self.compute, sizes=self.sizes(batch_size))
            pp, k = self.base.pp, self.base.plan.pipeline.virtual_stages
            self._acts[key] = place_peaks(plan_table(schedule, None, pp, k, m), placement(schedule, pp, k),
                                          *self._stages[mode, batch_size])
        return self._acts[key]

    def stage_times(self, mode: str, batch_size: int, hw: Hardware, G: int) -> list[StageTimes]:
        """`stage_times` of the variants with this checkpointing and batch size (one hardware a search)."""
        if (mode, batch_size) not in self._times:
            pipe = self.base.plan.pipeline
            v = variant(self.base, schedule=pipe.schedule, microbatches=pipe.microbatches,
                        sharding=self.base.plan.data_parallel.sharding, checkpointing=mode)
            self._times[mode, batch_size] = stage_times(v, self.model, hw, batch_size=batch_size, gpus_per_node=G,
                                                        layer_weights=self.parameters[1], root_weights=self.parameters[2],
                                                        dtype=self.compute, sizes=self.sizes(batch_size))
        return self._times[mode, batch_size]

    def sizes(self, batch_size: int) -> Sizes:
        """`plan_sizes` of the binding at `batch_size` sequences a microbatch."""
        if batch_size not in self._sizes:
            self._sizes[batch_size] = plan_sizes(self.base, self.model, batch_size=batch_size, dtype=self.compute)
        return self._sizes[batch_size]

    def lower_bound(self, schedule: str, m: int, sharding: str, reduce: str, mode: str, batch_size: int,
                    hw: Hardware, G: int) -> float:
        """`step_lower_bound` of a variant, from what it shares with others: costs per sharding, reduce,
        checkpointing and batch size, each rank's tail per placement too."""
        split, pp, k = splits_backward(schedule), self.base.pp, self.base.plan.pipeline.virtual_stages
        stage_rank = placement(schedule, pp, k)
        dpt = self.dp_time(hw, G)
        key = (sharding if dpt.dp > 1 else None, split, mode, batch_size, reduce)
        times = self.stage_times(mode, batch_size, hw, G)
        if key not in self._costs:
            self._costs[key] = dpt.costs(times, key[0], split, reduce)
        if key + (stage_rank,) not in self._tails:
            self._tails[key + (stage_rank,)] = [
                sum(dpt.tail(tuple(s for s, o in enumerate(stage_rank) if o == r), times, key[0], split, float("inf"),
                             self.dtype_bytes, reduce)) for r in range(pp)]
        # Ranks sharing cores (`step_time.core_sharing`) run up to a whole core each: as fast as 1 / share.
        share = 1.0 if hw.cores_per_node is None else min(1.0, hw.cores_per_node / hw.devices_per_node)
        if self._sync is None:  # one hardware and node size a search, as `dp_time`
            self._sync = world_sync_s(hw, self.base.plan.mesh.shape.world, G)
        return self._sync + share * step_lower_bound(stage_rank, split, m, self._costs[key],
                                                     self._tails[key + (stage_rank,)])

    def footprint_peaks(self, schedule: str, m: int, sharding: str, reduce: str = "step") -> list[int]:
        """Each pp rank's parameters, gradients, AdamW state and gathers under a variant (`footprint`'s peak)."""
        found = self._group_feet.get((schedule, m, sharding, reduce))
        if found is None:
            found = self._group_feet[schedule, m, sharding, reduce] = self._footprint_peaks(schedule, m, sharding, reduce)
        return found

    def _footprint_peaks(self, schedule: str, m: int, sharding: str, reduce: str) -> list[int]:
        split, k = splits_backward(schedule), self.base.plan.pipeline.virtual_stages
        reduce = reduce_as_run(reduce, microbatches=m, virtual_stages=k, split=split)
        stage_rank = placement(schedule, self.base.pp, k)
        key = (sharding, split, stage_rank, reduce)
        if key not in self._feet:
            mesh = self.base.plan.mesh
            dp = mesh.dp * mesh.cp  # the ranks sharing the parameters
            if stage_rank not in self._params:  # what each rank holds depends on the placement only
                placed = dataclasses.replace(self.base, stage_rank=stage_rank)
                self._params[stage_rank] = [param_sums(rank_parameters(placed, self.model, r), dp)
                                            for r in range(placed.pp)]
                # experts split over ep: whole on each rank, never gathered, cast (`memory.rank_footprints`)
                compute = self.compute.itemsize if self.mixed else None
                self._experts[stage_rank] = [footprint(rank_parameters(placed, self.model, r, by_expert=True),
                                                       compute_bytes=compute) for r in range(placed.pp)]
            compute = self.compute.itemsize if self.mixed else None
            self._feet[key] = [(footprint(p, dp=dp, sharding=sharding, split=split, reduce=reduce,
                                          compute_bytes=compute) + experts).peak
                               for p, experts in zip(self._params[stage_rank], self._experts[stage_rank])]
        return self._feet[key]


def meshes(world: int, G: int, num_layers: int, *, seq_len: int = 1, max_cp: int | None = 1):
    """(dp, pp, cp, tp) of `world` devices: tp within a node, at most a stage a layer, cp up to `max_cp`
    (None: any) where 2 cp chunks split `seq_len` evenly."""
    for tp in divisors(world):
        if tp > G or G % tp:
            continue  # tp within a node
        for pp in divisors(world // tp):
            if pp > num_layers:
                continue
            for cp in divisors(world // (tp * pp)):
                if cp == 1 or ((max_cp is None or cp <= max_cp) and seq_len % (2 * cp) == 0):
                    yield world // (tp * pp * cp), pp, cp, tp


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the search, as it was after. The search makes millions
    of short-lived objects without cycles (reference counting frees them), and each collection they
    set off walked every object alive, the model's too: a quarter of a 70B search's time. What it leaves
    alive (the model built on meta, modules imported) goes to the oldest generation, as if it had survived
    two collections, instead of one pass walking all of it (~0.5 s) when the collector is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():  # a caller's frozen objects stay frozen: only then
            gc.freeze()
            gc.unfreeze()  # the permanent generation back into the oldest: nothing walked now
        if was:
            gc.enable()
