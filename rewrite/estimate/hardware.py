"""Hardware profiles as data: a device's memory, peak FLOP/s, bandwidths and links, and the
fractions of them a training step reaches. What the step-time model (`step_time`) and the plan
search (`search`) read; shipped as YAML in `profiles/`, `rewrite calibrate` writes one for this machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = ["Link", "Efficiency", "CompiledCosts", "LargeMicrobatch", "ContextWork", "Hardware", "HARDWARE_NAMES", "PROFILES", "default_dtype", "load_hardware"]

PROFILES = Path(__file__).with_name("profiles")
HARDWARE_NAMES = tuple(sorted(p.stem for p in PROFILES.glob("*.yaml")))

_Positive = Annotated[float, Field(gt=0)]
_Fraction = Annotated[float, Field(gt=0, le=1)]
_Seconds = Annotated[float, Field(ge=0)]
# What a run's collectives are, as `rewrite calibrate` times them (`estimate.collectives.collective_s` reads them):
# on activations, the tensor-parallel layers' own `sum`, `gather` and `scatter` (sequence and context
# parallelism) and the experts' `all_to_all`; on parameters and gradients, torch's `all_reduce` (DDP, replicate,
# expert replicas), `all_gather` and `reduce_scatter` (FSDP2).
CollectiveKind = Literal["sum", "gather", "scatter", "all_to_all", "all_reduce", "all_gather", "reduce_scatter"]
CallKind = Literal["sum", "gather", "scatter", "all_to_all", "all_to_all_tp"]  # `call_overhead_s`'s
_Curve = dict[Annotated[int, Field(gt=0)], _Seconds]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Link(_Strict):
    """One device's share of a link: what it sends per second in one direction, and a message's fixed cost."""

    bandwidth: Annotated[float, Field(gt=0, description="bytes per second, per device, one direction")]
    latency: Annotated[float, Field(ge=0, description="seconds per message (per ring step of a collective)")]


class Efficiency(_Strict):
    """The fractions of the peaks a training step reaches."""

    matmul: Annotated[float, Field(gt=0, le=1, description="of the peak FLOP/s, at transformer shapes")]
    collective: Annotated[float, Field(gt=0, le=1, description="of the link bandwidth, for large messages")]


class LargeMicrobatch(_Strict):
    """A microbatch of more than `tokens` tokens on a rank computes slower per token than the layer terms' linear
    fit charges (its activations outgrow the caches): at twice `tokens`, `ratio` times as long per token as at
    `tokens` (measured), reached linearly in the tokens past `tokens` and held beyond."""

    tokens: Annotated[int, Field(ge=1, description="the largest microbatch per rank the layer terms were fitted on")]
    ratio: Annotated[float, Field(gt=0, description="the time per token at twice `tokens` over that at `tokens`")]

    def scale(self, tokens: float) -> float:
        """What a microbatch of `tokens` tokens per rank multiplies its linearly charged compute by."""
        past = min(max(tokens - self.tokens, 0), self.tokens) / self.tokens
        return 1.0 + (self.ratio - 1.0) * past


class CompiledCosts(_Strict):
    """What a decoder layer and a microbatch cost beyond their FLOPs when each block runs under torch.compile
    (inductor): the same three terms as an eager step's, measured the same way (`rewrite calibrate`)."""

    layer_overhead_s: Annotated[float, Field(ge=0, description="a compiled layer's fixed cost per microbatch")]
    activation_bandwidth: Annotated[float | None, Field(gt=0, description=(
        "bytes per second a compiled layer's fused elementwise kernels move the counted activations at; None: "
        "the profile's memory_bandwidth"))] = None
    microbatch_overhead_s: Annotated[float, Field(ge=0, description=(
        "a microbatch's cost outside its compiled layers"))] = 0.0


class ContextWork(_Strict):
    """What a context-parallel decoder layer computes beyond its FLOPs and its keys' and values' exchanges, per
    microbatch: the gathered keys and values put in sequence order, each query chunk's blocks merged, the
    gathered gradients zero-filled and summed (`rewrite.context_parallel.attention`); a fixed part and a part per
    byte of the keys and values gathered, half in the forward and half in the input backward."""

    layer_s: Annotated[float, Field(ge=0, description="seconds per layer and microbatch")]
    per_byte_s: Annotated[float, Field(ge=0, description=(
        "seconds per byte of the whole sequence's keys and values a rank gathers in a layer"))]

    def seconds(self, kv_bytes: float) -> float:
        """A layer's forward and backward together, gathering `kv_bytes`."""
        return self.layer_s + self.per_byte_s * kv_bytes


class Hardware(_Strict):
    """A device and how it is connected (`rewrite show --hardware`, `rewrite plan --hardware`).

    Example:
        >>> load_hardware("h100-sxm").peak_flops["bfloat16"]
        989400000000000.0
    """

    name: str
    description: str = ""
    memory_gib: Annotated[float, Field(gt=0, description="memory per device a process can allocate, GiB")]
    peak_flops: Annotated[dict[str, _Positive], Field(description="dense FLOP/s per dtype (float32, bfloat16, float16)")]
    memory_bandwidth: Annotated[float, Field(gt=0, description="device memory, bytes per second")]
    devices_per_node: Annotated[int, Field(ge=1, description="devices joined by the intra-node link")]
    intra_node: Link
    inter_node: Link
    efficiency: Efficiency
    layer_overhead_s: Annotated[float, Field(ge=0, description=(
        "seconds one decoder layer's forward and backward cost a microbatch beyond their FLOPs and memory "
        "traffic: operator dispatch, kernel launches (0: not modelled)"))] = 0.0
    activation_bandwidth: Annotated[float | None, Field(gt=0, description=(
        "bytes per second a decoder layer's elementwise operators (norms, rotary, activation, residuals) move "
        "its activations at; None: memory_bandwidth"))] = None
    microbatch_overhead_s: Annotated[float, Field(ge=0, description=(
        "seconds a stage spends on each microbatch outside its decoder layers' operators: the forward and "
        "backward calls, the embedding, head and loss modules' dispatch (0: not modelled)"))] = 0.0
    selective_overhead_s: Annotated[float, Field(ge=0, description=(
        "seconds a decoder layer checkpointed 'selective' costs each microbatch beyond the work its recompute "
        "repeats: torch's checkpoint policy consulted on each operator of its forward and again of the recompute, "
        "the kept products stored and looked up (eager; a compiled block applies the policy while tracing and "
        "pays none); 0: not modelled"))] = 0.0
    context_work: Annotated[ContextWork | None, Field(description=(
        "what a decoder layer under context parallelism computes beyond its FLOPs and exchanges (eager; measured "
        "on a cp 2 layer with its exchanges looped back against a plain one on the same tokens, `rewrite "
        "calibrate`; a compiled step is charged the same, not measured apart); None: not modelled"))] = None
    large_microbatch: Annotated[LargeMicrobatch | None, Field(description=(
        "compute per token past the microbatch sizes the layer terms were fitted on, against theirs (a CPU's "
        "caches; compiled steps too); None: linear in the tokens"))] = None
    optimizer_bandwidth: Annotated[float | None, Field(gt=0, description=(
        "bytes per second a step's end moves AdamW's counted traffic at (3 x the parameters' bytes + 16 per "
        "trained element), the gradients' norm clipped included: torch's AdamW runs an operator at a time, each "
        "reading and writing whole tensors; None: memory_bandwidth"))] = None
    collective_times: Annotated[dict[CollectiveKind, dict[Annotated[int, Field(ge=2)], _Curve]], Field(description=(
        "seconds each collective took as a run makes it, by kind, group size and bytes (the summed tensor; the "
        "gathered or scattered whole; what one rank sends to all), every group of that size on one node at once; "
        "between the sizes measured, interpolated. Missing kinds and sizes, and groups across nodes: the ring "
        "formulas on the links"))] = {}
    call_overhead_s: Annotated[dict[CallKind, _Seconds], Field(description=(
            "seconds a layer's own collective costs inside a step beyond its time alone (`collective_times`), "
            "per call: the ranks' drift between the calls that bring them together and the bookkeeping around "
            "them; fitted on a tp 2 decoder layer against this model (`rewrite calibrate`: `sum` on a plain one, "
            "`gather` and `scatter` on a sequence-parallel one), and on a MoE's experts split over a pair of "
            "ranks, each of its all-to-alls: `all_to_all` over dp ranks, `all_to_all_tp` over a tp pair beside "
            "the attention's collectives. Empty: not modelled; without `all_to_all_tp` an exchange over tp ranks "
            "is charged `all_to_all`, without that a `sum`'s"))] = {}
    unit_overhead_s: Annotated[dict[Literal["pass", "gather", "reduce", "all_reduce", "optimizer"], _Seconds], Field(
        description=(
            "seconds FSDP2 spends per data-parallel unit beyond its collectives' time alone: `pass` each "
            "microbatch's forward and backward through a unit it holds (its hooks), `gather` each all-gather (copying "
            "the shards in and the parameters out), `reduce` each reduce-scatter (the gradients in, the shard out), "
            "`all_reduce` each all-reduce of its `replicate`; and `optimizer` per parameter it holds, what the step's "
            "end (the norm, AdamW) takes beyond plain tensors' (DTensor's dispatch, an operator at a time on CPU); "
            "fitted on a bench model under each sharding at two microbatch counts and FSDP2's replicate beside DDP "
            "(`rewrite calibrate`). Empty: not modelled"))] = {}
    cores_per_node: Annotated[int | None, Field(ge=1, description=(
        "CPU cores a node's ranks share, each computing on one thread (a CPU profile, whose compute terms were "
        "measured with devices_per_node ranks busy at once); where a plan's busy ranks outnumber them, each gets "
        "its share, and a rank waiting frees its core. None: each rank has a device of its own"))] = None
    overlap: Annotated[float, Field(ge=0, le=1, description=(
        "share of the shorter of a data-parallel collective and the compute beside it that running them side "
        "by side hides: 1 where collectives run on their own engine (NCCL beside kernels), about 0 where they "
        "take the cores the compute needs (gloo on CPU ranks)"))] = 1.0
    memory_reserve_gib: Annotated[float, Field(ge=0, description=(
        "GiB of each device's memory that tensors never get: the runtime's context and the communication "
        "library's buffers"))] = 0.0
    fragmentation: Annotated[float, Field(ge=0, lt=1, description=(
        "share of the rest the allocator cannot hand out at the peak: fragmentation and cached blocks"))] = 0.0

    compiled: Annotated[CompiledCosts | None, Field(description=(
        "the fixed and elementwise terms of a step whose blocks are compiled (`compile` in the plan, inductor); "
        "None: not measured, a compiled plan is charged the eager terms"))] = None

    def stepping(self, compiled: bool) -> Hardware:
        """The profile a step's compute is charged on: with `compiled` and measured compiled terms, those in place
        of the eager ones (and no cost of selective checkpointing's policy); else this profile."""
        if not compiled or self.compiled is None:
            return self
        return self.model_copy(update={**self.compiled.model_dump(), "selective_overhead_s": 0.0})

    @field_validator("collective_times")
    @classmethod
    def _sorted_by_size(cls, tables: dict) -> dict:  # `collective_s` walks each curve by growing size
        for kind, by_n in tables.items():
            for n, curve in by_n.items():
                if len(curve) < 2:
                    raise ValueError(f"{kind}.{n} holds {len(curve)} size(s): give at least two ({{bytes: seconds}}), "
                                     "or leave the group size out to use the ring formula")
        return {kind: {n: dict(sorted(curve.items())) for n, curve in by_n.items()} for kind, by_n in tables.items()}

    @model_validator(mode="after")
    def _reserve_below_memory(self) -> Hardware:
        if self.memory_reserve_gib >= self.memory_gib:
            raise ValueError(f"memory_reserve_gib {self.memory_reserve_gib:g} leaves nothing of memory_gib "
                             f"{self.memory_gib:g}: use a reserve below the device's memory")
        return self

    def usable_gib(self, device_memory: float | None = None) -> float:
        """What a plan may fill on a device of `device_memory` GiB (default `memory_gib`): the memory less
        `memory_reserve_gib`, less `fragmentation` of what remains; 0 when the reserve takes it all.

        Example:
            >>> round(load_hardware("h100-sxm").usable_gib(), 1)
            72.8
        """
        memory = self.memory_gib if device_memory is None else device_memory
        return max(memory - self.memory_reserve_gib, 0.0) * (1 - self.fragmentation)

    def usable_text(self, device_memory: float | None = None) -> str:
        """`72.8 GiB usable on h100-sxm (79.6 GiB less 3 GiB reserved and 5 % for the allocator)`."""
        memory = self.memory_gib if device_memory is None else device_memory
        kept = [f"{self.memory_reserve_gib:g} GiB reserved"] if self.memory_reserve_gib else []
        kept += [f"{self.fragmentation:.0%} for the allocator"] if self.fragmentation else []
        how = f" ({memory:g} GiB less {' and '.join(kept)})" if kept else ""
        return f"{self.usable_gib(device_memory):.3g} GiB usable on {self.name}{how}"

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s in `dtype` ('float32', 'bfloat16', ...; a torch dtype's name).

        Raises:
            ValueError: the profile gives no peak for it.
        """
        dtype = str(dtype).removeprefix("torch.")
        if dtype not in self.peak_flops:
            raise ValueError(
                f"hardware {self.name!r} gives no peak FLOP/s for {dtype} (it has {', '.join(self.peak_flops)}); "
                f"add peak_flops.{dtype} to the profile, or set `dtype` to one of those"
            )
        return self.peak_flops[dtype]


def default_dtype(hardware: Hardware) -> str:
    """The compute dtype a run on `hardware` takes by default: bfloat16 where the profile's bfloat16
    peak passes its float32 one (a GPU's tensor cores), else float32 (a CPU). `rewrite train`'s rule
    on a device is the same: bfloat16 on a GPU that computes in it."""
    fast = hardware.peak_flops.get("bfloat16", 0.0) > hardware.peak_flops.get("float32", float("inf"))
    return "bfloat16" if fast else "float32"


def load_hardware(source: str | Path | Hardware) -> Hardware:
    """A hardware profile by name (`HARDWARE_NAMES`: h100-sxm, h100-96g, h200, a100-80g, cpu) or from a YAML file.

    Raises:
        ValueError: neither a shipped name nor a readable file, or a file that is not a valid
            profile (every problem named with its field).

    Example:
        >>> load_hardware("a100-80g").devices_per_node
        8
    """
    if isinstance(source, Hardware):
        return source
    path = PROFILES / f"{source}.yaml" if str(source) in HARDWARE_NAMES else Path(source)
    if not path.is_file():
        raise ValueError(
            f"unknown hardware {str(source)!r}: use one of {', '.join(HARDWARE_NAMES)}, or a profile file "
            "(`rewrite calibrate --out FILE` writes one for this machine)"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read the hardware profile: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a hardware profile is a mapping of keys (name, memory_gib, peak_flops, ...)")
    data.setdefault("name", path.stem)
    try:
        return Hardware.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)]
        raise ValueError(f"{path}: {len(problems)} problem(s) in the hardware profile: " + "; ".join(problems)) from None
