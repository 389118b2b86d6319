"""What data parallelism adds to a step: the all-gathers inside each action's duration, and per rank
the gradient reduction torch does not hide, then AdamW (see `step_time` for the model).

One `DpTime` per binding (mesh, stages, shards): the sharding, the schedule and the rank's last
backward window vary per call. `step_time.predict_step` times a plan with it; the plan search
bounds candidates by it before simulating their tables.

Experts split over ep (`step_time.stage_parameters`' unit `EXPERTS`) are neither gathered nor
reduce-scattered: after the dense reduction their gradients are all-reduced over the ranks holding
the same experts ((dp / ep) x cp, `plan.ranks.expert_groups`), nothing beside it, and AdamW reads
them whole.

FSDP2's own seconds per unit (`Hardware.unit_overhead_s`, measured on CPU ranks; none on a GPU, where the
host queues the copies ahead of the device) run on the rank's thread, beside nothing: `pass` on every F and
whole or input backward of a stage FSDP2 holds (half each), `gather` on each unit's all-gather, `reduce` on each
unit's reduce-scatter, `all_reduce` on each unit's all-reduce under its `replicate`, and `optimizer` per parameter
it holds on the step's end (AdamW through DTensor). `replicate` is torch's DDP where it fits (`schedules.last_backward_reaches_all`: one
stage on the rank, whole backwards), one bucketed all-reduce; elsewhere FSDP2's `replicate`, priced as `grad_op`
is, less its gathers and with each unit's all-reduce in place of its reduce-scatter.

A collective beside compute hides `overlap` of the shorter of the two (the profile's measured share:
1 where the collective runs on its own engine, as NCCL beside kernels; about 0 on CPU ranks, where
gloo's threads take the cores the compute needs): beside(a, b) = a + b - overlap * min(a, b).
"""

from __future__ import annotations

from ..plan.ranks import expert_groups
from ..binding.resolve import ResolvedPlan
from ..schedules import last_backward_reaches_all
from .collectives import collective_s, groups_link
from .hardware import Hardware
from .param_memory import param_unit

__all__ = ["DpTime", "DDP_BUCKET", "ADAMW_TRAFFIC", "EXPERTS"]

EXPERTS = "experts"  # a stage's unit of the experts split over ep

DDP_BUCKET = 25 * 1024**2  # DistributedDataParallel's default bucket_cap_mb
ADAMW_TRAFFIC = 16  # float32 moments, each read and written, per element; plus 3x the dtype (w r/w, g r)


class DpTime:
    """Data-parallel costs of one binding: `units` per stage (FSDP2 unit -> bytes on a rank)."""

    def __init__(self, resolved: ResolvedPlan, units: list[dict[str, int]], hw: Hardware, gpus_per_node: int,
                 *, gathered: float = 1.0) -> None:
        """`gathered`: bytes a gathered parameter moves per byte it is stored in (0.5: FSDP2 gathers
        float32 weights in bfloat16); gradients reduce in the stored dtype. The group is every rank
        holding the same parameters: the dp replicas times the cp ranks (`dp` below counts them all)."""
        shape = resolved.plan.mesh.shape
        self.dp, self.hw = shape.dp * shape.cp, hw
        self.stages_here = len(resolved.rank_stages(0))
        self.overlap = hw.overlap
        self.gathered = gathered
        self.link = groups_link(hw, shape.along("dp", "cp"), gpus_per_node)
        replicas = expert_groups(shape)[1]
        self.expert_replicas = len(replicas[0]) if replicas else 1
        self.expert_link = groups_link(hw, replicas, gpus_per_node)
        self.units = [{k: b for k, b in u.items() if k != EXPERTS} for u in units]  # the dense ones, FSDP2's
        self.experts = [u.get(EXPERTS, 0) for u in units]
        self.gather = {s: [self._ag(b) for b in u.values()] for s, u in enumerate(self.units)}
        self.layers_only = {s: [self._ag(b) for name, b in u.items() if name != "root"]
                            for s, u in enumerate(self.units)}
        # Per stage, what each step's costs read: (sum, first) of its gathers, its bytes and smallest unit.
        self._gathers = {s: (sum(ags), ags[0] if ags else 0.0) for s, ags in self.gather.items()}
        self._layer_gathers = {s: (sum(ags), ags[0] if ags else 0.0) for s, ags in self.layers_only.items()}
        # What has gradients to reduce and AdamW state to update: everything, or a LoRA plan's adapters.
        self.grad_units = _trained_units(resolved) if resolved.plan.lora is not None else self.units
        if resolved.plan.lora is not None:
            self.experts = [0 for _ in units]  # frozen: no gradient to reduce
        self._held = [sum(u.values()) for u in self.grad_units]
        # The parameters FSDP2 holds per stage (trained, not split over ep), each stepped through DTensor.
        self._tensors = [sum(1 for p in spec.held if p.trained and not p.by_expert) for spec in resolved.stages]
        self._smallest = [min(u.values(), default=None) for u in self.grad_units]
        self._reduces: dict = {}  # (sharding, stage) -> (sum, least) of its units' reduces
        calls = hw.unit_overhead_s  # FSDP2's own seconds per unit: a pass (its hooks), a gather, a reduce
        self.unit_pass, self.unit_gather = calls.get("pass", 0.0), calls.get("gather", 0.0)
        self.unit_reduce = {"reduce_scatter": calls.get("reduce", 0.0), "all_reduce": calls.get("all_reduce", 0.0)}
        self.unit_optimizer = calls.get("optimizer", 0.0)

    def _ag(self, nbytes: float) -> float:
        return collective_s(self.hw, "all_gather", nbytes * self.gathered, self.dp, self.link)

    def sharding(self, resolved: ResolvedPlan) -> str | None:
        """The plan's data-parallel sharding, None without data parallelism."""
        return resolved.plan.data_parallel.sharding if self.dp > 1 else None

    def on_fsdp(self, sharding: str | None, split: bool) -> bool:
        """Whether FSDP2 holds the rank's units (its hooks on every pass): sharded, or replicated off DDP."""
        return sharding in ("full", "grad_op") or (sharding == "replicate" and not self.on_ddp(sharding, split))

    def on_ddp(self, sharding: str | None, split: bool) -> bool:
        """Whether the rank's gradients reduce through DDP's buckets (`replicate` where DDP fits)."""
        return sharding == "replicate" and last_backward_reaches_all(self.stages_here, split)

    def reduces_each(self, sharding: str | None, split: bool, reduce: str) -> bool:
        """Whether each whole backward reduces its units' gradients (`data_parallel.reduce: microbatch`)."""
        return reduce == "microbatch" and sharding is not None and not split

    def _reduce(self, nbytes: float, sharding: str) -> float:
        return collective_s(self.hw, _reduce_kind(sharding), nbytes, self.dp, self.link)

    def per_microbatch(self, sharding: str | None, split: bool) -> bool:
        """Whether each F and B gathers its stage's units again (full sharding, whole backwards)."""
        return sharding == "full" and not split

    def costs(self, times: list, sharding: str | None, split: bool, reduce: str = "step") -> dict[tuple[str, int], float]:
        """Each (kind, stage)'s duration: its compute and the collectives beside it (`beside`), plus what
        nothing hides: the first unit's gather (per-microbatch gathers), the last unit's reduce
        (a backward that reduces its units, `reduce: microbatch`)."""
        gathers, reduces = self.per_microbatch(sharding, split), self.reduces_each(sharding, split, reduce)
        hooked = self.on_fsdp(sharding, split)
        out = {}
        for s, t in enumerate(times):
            for kind, base in (("F", t.forward), ("B", t.backward), ("I", t.input_backward), ("W", t.weight_backward)):
                beside, unhidden = 0.0, 0.0
                if hooked and kind != "W":  # FSDP2's hooks, half on the way in, half on the way back
                    unhidden += len(self.units[s]) * self.unit_pass / 2
                if gathers and kind != "W":
                    units = self.units[s] if kind == "F" else self.layers_only[s]
                    beside, first = (self._gathers if kind == "F" else self._layer_gathers)[s]
                    unhidden += first + len(units) * self.unit_gather
                if reduces and kind == "B":
                    if (sharding, s) not in self._reduces:
                        rss = [self._reduce(b, sharding) for b in self.grad_units[s].values()]
                        self._reduces[sharding, s] = (sum(rss), min(rss, default=0.0))
                    total, least = self._reduces[sharding, s]
                    unit = self.unit_reduce[_reduce_kind(sharding)]
                    beside, unhidden = beside + total, unhidden + least + len(self.grad_units[s]) * unit
                out[kind, s] = self.beside(base, beside) + unhidden
        return out

    def beside(self, compute: float, collectives: float) -> float:
        """Seconds for `compute` and `collectives` run side by side: the longer, plus what `overlap` leaves
        of the shorter (the longer of the two where the overlap is whole)."""
        return compute + self.exposed(compute, collectives)

    def exposed(self, compute: float, collectives: float) -> float:
        """What `collectives` add to `compute` beside them (`compute` may be infinite: the least they add)."""
        return collectives - self.overlap * min(compute, collectives)

    def tail(self, stages: tuple[int, ...], times: list, sharding: str | None, split: bool,
             window: float, dtype_bytes: int, reduce: str = "step") -> tuple[float, float]:
        # dtype_bytes: the parameters' (master) bytes per element: AdamW reads and writes them
        """(data-parallel seconds exposed after a rank's last action, AdamW's seconds) for a rank holding
        `stages`. `window`: that action's duration, beside which the gradients reduce; an infinite one
        gives the least exposed. Under `reduce: microbatch` the backwards reduced as they went (`costs`)."""
        hw, dp, link = self.hw, self.dp, self.link
        held = sum(self._held[s] for s in stages)
        exposed = 0.0
        if sharding == "grad_op" or (sharding == "full" and split):  # gathered once, beside the first forward
            for st in stages:
                total, first = self._gathers[st]
                exposed += self.exposed(times[st].forward, total) + first + len(self.units[st]) * self.unit_gather
        # The step's one reduce, beside the last backward; reduced per microbatch, each backward's
        # duration already holds its own (`costs`).
        if self.on_ddp(sharding, split) and not self.reduces_each(sharding, split, reduce):
            whole = collective_s(hw, "all_reduce", held, dp, link)
            exposed += max(self.exposed(window, whole), collective_s(hw, "all_reduce", min(held, DDP_BUCKET), dp, link))
        elif sharding is not None and not self.reduces_each(sharding, split, reduce):  # FSDP2's, unit by unit
            last_unit = min((self._smallest[s] for s in stages if self._smallest[s] is not None), default=0)
            exposed += max(self.exposed(window, collective_s(hw, _reduce_kind(sharding), held, dp, link)),
                           collective_s(hw, _reduce_kind(sharding), last_unit, dp, link))
            exposed += sum(len(self.grad_units[s]) for s in stages) * self.unit_reduce[_reduce_kind(sharding)]
        experts = sum(self.experts[s] for s in stages)  # reduced after the dense gradients, nothing beside it
        exposed += collective_s(hw, "all_reduce", experts, self.expert_replicas, self.expert_link)
        held_elems = held / dtype_bytes / (dp if sharding in ("full", "grad_op") else 1) + experts / dtype_bytes
        optimizer = held_elems * (3 * dtype_bytes + ADAMW_TRAFFIC) / (hw.optimizer_bandwidth or hw.memory_bandwidth)
        if self.on_fsdp(sharding, split):
            optimizer += sum(self._tensors[s] for s in stages) * self.unit_optimizer
        return exposed, optimizer


def _reduce_kind(sharding: str) -> str:
    return "all_reduce" if sharding == "replicate" else "reduce_scatter"


def _trained_units(resolved: ResolvedPlan) -> list[dict[str, int]]:
    """Per stage, FSDP2 unit -> bytes on a rank of its trained parameters (a LoRA plan's adapters)."""
    out = []
    for spec in resolved.stages:
        layers, units = frozenset(spec.layers), {}
        for p in spec.held:
            if p.trained and not p.by_expert:
                unit = param_unit(p.name, layers)
                units[unit] = units.get(unit, 0) + p.nbytes
        out.append(units)
    return out
